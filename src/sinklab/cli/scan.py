"""``sinklab scan``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ._common import (
    MODEL_HELP,
    user_errors,
    app,
    console,
    device_map_option,
    join_ranks,
    analysis_run,
    record_run,
    save_retention_plan,
    trust_remote_code_option,
)
from ..errors import InputError
from ._progress import print_warnings


def _print_table(result) -> None:
    from ..registry import REGISTRY
    from ..scan import layer_label

    table = Table(title=f"{result.meta['model']} — per layer (T={result.meta['seq_len']}, "
                        f"{result.num_samples} samples, ε={result.meta['thresholds']['eps']})")
    table.add_column("layer", justify="right")
    has_learned = bool(result.learned_sink_mass.nan_to_num(0).abs().max() > 1e-4)
    shown = [r for r in REGISTRY if r.terminal and (r.name != "learned_sink_mass" or has_learned)]
    for row in shown:
        table.add_column(row.title, justify="right")
    values = result.per_layer()
    kinds = result.layer_kinds or ["attention"] * result.num_layers
    for layer in range(result.num_layers):
        cells = ["–" if values[r.name][layer] is None else r.fmt.format(values[r.name][layer]) for r in shown]
        table.add_row(layer_label(layer, kinds[layer]), *cells)
    console.print(table)
    pos, label = result.top_sink()
    pairs = "layer×head pairs" if len(result.attention_layers) == result.num_layers else \
        f"attention layer×head pairs ({len(result.attention_layers)} of {result.num_layers} layers attend)"
    console.print(f"Sink^ε(0) = [bold]{result.sink_rate(0):.1f} %[/bold] of {pairs}; "
                  f"most common sink: position {pos} ({label!r})", markup=True, highlight=False)
    state = result.meta.get("recurrent_state_bytes")
    if state:
        console.print(f"recurrent layers keep {sum(state.values()) / 1024:.1f} KiB of state per sequence at any length "
                      f"({', '.join(f'layer {k}: {v / 1024:.1f} KiB' for k, v in state.items())})", highlight=False)
    gates = result.gate_statistics()
    if gates is not None:
        mean = {k: float(v.nanmean()) for k, v in gates.items()}
        console.print(f"output gate: mean {mean['gate_on_sink']:.3f} on queries routed to position 0 vs "
                      f"{mean['gate_elsewhere']:.3f} elsewhere; sink share {mean['sink_share']:.3f} without the gate, "
                      f"{mean['gated_sink_share']:.3f} with it", highlight=False)


def print_modality(result) -> None:
    summary = result.modality_summary()
    table = Table(title=f"{result.meta['model']} — by modality ({summary['positions']['image']} image tokens, "
                        f"{summary['positions']['text']} text, ε={summary['eps']})")
    for column in ("layer", "Sink^ε text %", "Sink^ε image %", "strength text", "strength image",
                   "text→image on visual sinks"):
        table.add_column(column, justify="right")
    share = summary.get("visual_sink_share") or [None] * result.num_layers

    def fmt(value, spec: str) -> str:
        return "–" if value is None else format(value, spec)

    for layer in range(result.num_layers):
        table.add_row(str(layer), fmt(summary["sink_rate"]["text"]["per_layer"][layer], ".1f"),
                      fmt(summary["sink_rate"]["image"]["per_layer"][layer], ".1f"),
                      fmt(summary["sink_strength"]["text"][layer], ".3f"),
                      fmt(summary["sink_strength"]["image"][layer], ".3f"), fmt(share[layer], ".3f"))
    console.print(table)
    for sink in summary["top_sinks"]:
        where = sink["patch"] or sink["modality"]
        console.print(f"  position {sink['position']} ({sink['token']!r}, {where}): dominant in {sink['heads']} "
                      f"layer×head pairs", highlight=False, markup=False)


def _scan_images(model: str, paths: list[Path], text: str | None, file: Path | None, out: Path, *, eps: float,
                 dtype: str | None, device: str | None, revision: str | None, trust_remote_code: bool,
                 tower: bool = False) -> None:
    """``sinklab scan MODEL --image FILE``: the language model's attention on the images and a prompt, by modality;
    with ``--vision-tower``, the vision tower's own attention on the images, scanned as an encoder."""
    from ..models import load_processor
    from ..report import save
    from ..scan import scan_images, scan_vision_tower
    from ..vision_inputs import check_vision_model, load_images, vision_tower
    from ._common import check_out_dir, load_for_command, read_texts

    images = load_images(paths)  # an unreadable file fails before anything loads
    texts = read_texts(text, file)
    out = check_out_dir(out)
    loaded = load_for_command(model, dtype=dtype, device=device, revision=revision,
                              trust_remote_code=trust_remote_code)
    if tower:
        vision_tower(loaded.model)  # a model without one fails before its processor is looked for
        try:
            processor = load_processor(model, revision=revision, trust_remote_code=trust_remote_code)
        except InputError:  # no processor: pixels sized by the vision config
            processor = None
            console.print("no processor: pixels resized to the vision config's image size, scaled to [-1, 1]")
        result = scan_vision_tower(loaded.model, images, processor=processor, thresholds={"eps": eps}, source=model,
                                   revision=revision)
        console.print(f"scanned the {result.meta['component']} as an encoder", highlight=False, markup=False)
        _print_table(result)
        print_warnings(result.meta)
        console.print(f"wrote {out / 'scan.json'}, figures and {save(result, out)}")
        return
    check_vision_model(loaded.model)
    processor = load_processor(model, revision=revision, trust_remote_code=trust_remote_code)
    result = scan_images(loaded.model, images, " ".join(texts) if texts else "Describe the image.",
                         processor=processor, thresholds={"eps": eps}, source=model, revision=revision)
    _print_table(result)
    print_modality(result)
    print_warnings(result.meta)
    report = save(result, out)
    console.print(f"wrote {out / 'scan.json'}, figures and {report}")


@app.command()
def scan(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    text: Annotated[str | None, typer.Option("--text", help="text to scan")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="UTF-8 text file to scan")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len", help="tokens per sample (special tokens included)")] = 64,
    samples: Annotated[int, typer.Option("--samples", help="number of samples")] = 16,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("sinklab-out"),
    eps: Annotated[float, typer.Option("--eps", help="sink-rate threshold ε")] = 0.3,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32, bfloat16, float16")] = None,
    device: Annotated[str | None, typer.Option("--device", help="cpu, cuda, cuda:1 …")] = None,
    revision: Annotated[str | None, typer.Option("--revision")] = None,
    trust_remote_code: Annotated[bool, trust_remote_code_option()] = False,
    seed: Annotated[int, typer.Option("--seed", help="0: texts in order; other: shuffled texts, random window offsets")] = 0,
    device_map: Annotated[str | None, device_map_option()] = None,
    image: Annotated[list[Path] | None, typer.Option(
        "--image", help="an image for a vision-language model (repeat for several; sample:NAME, a bundled photograph: "
        "chelsea, astronaut, coffee …); --text is the prompt after it")] = None,
    vision_tower: Annotated[bool, typer.Option(
        "--vision-tower", help="with --image: scan the vision tower itself as an encoder (its patch tokens)")] = False,
) -> None:
    """Scan MODEL for attention sinks; print a per-layer table and write scan.json, figures, report.html."""
    from ..report import save
    from ..scan import scan as run_scan
    from ..scan import scan_inputs

    with user_errors():
        if vision_tower and not image:
            raise InputError("--vision-tower scans a vision-language model's vision tower on images: give --image FILE")
        if image:
            if device_map is not None:
                raise InputError("--image scans in one process on one device for now; drop --device-map "
                                 "(--device places the model)")
            _scan_images(model, image, text, file, out, eps=eps, dtype=dtype, device=device, revision=revision,
                         trust_remote_code=trust_remote_code, tower=vision_tower)
            return
        device = join_ranks(device, device_map)
        run = analysis_run(
            model, text, file, out, seq_len, samples=samples, batch_size=batch_size, seed=seed,
            phases={"scan": "scanning samples"}, dtype=dtype, device=device, revision=revision,
            trust_remote_code=trust_remote_code, device_map=device_map,
            on_texts=lambda loaded, texts, progress: run_scan(
                loaded.model, loaded.tokenizer, texts, seq_len=seq_len, samples=samples, batch_size=batch_size,
                thresholds={"eps": eps}, seed=seed, source=model, revision=revision, progress=progress),
            on_images=lambda base, batches, labels, meta, progress: scan_inputs(
                base, batches, labels, thresholds={"eps": eps}, progress=progress, meta=meta))
        if run is None:  # not the main process: it writes the one report
            return
        result, loaded, texts, out = run
        record_run(result.meta, loaded, texts, device=device, dtype=dtype)
        _print_table(result)
        print_warnings(result.meta)
        report = save(result, out)
        console.print(f"wrote {out / 'scan.json'}, figures and {report}")
        save_retention_plan(loaded, result, out)
