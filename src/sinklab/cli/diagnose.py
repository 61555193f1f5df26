"""``sinklab diagnose`` and ``sinklab synth``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..diagnose import DEFAULT_RULES, EDIT_LAYERS, EDIT_SAMPLES
from ..errors import SinklabError
from ..report import save
from ..scan import layer_label
from ._common import (
    MODEL_HELP,
    progress_bar,
    user_errors,
    app,
    check_out_dir,
    save_retention_plan,
    console,
    device_map_option,
    join_ranks,
    analysis_run,
    needs,
    record_run,
    trust_remote_code_option,
)
from ._progress import print_warnings
from .recommend import print_recommendation


@app.command()
def diagnose(
    model: Annotated[str, typer.Argument(help=MODEL_HELP)],
    text: Annotated[str | None, typer.Option("--text", help="text to diagnose")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="UTF-8 text file")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 64,
    samples: Annotated[int, typer.Option("--samples")] = 16,
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("sinklab-diagnose"),
    rule: Annotated[str, typer.Option("--rule", help="mass | strict | relaxed")] = "mass",
    sink_mass: Annotated[float, typer.Option("--sink-mass", help="rule 'mass': column mass above this")] = 0.3,
    nop_max: Annotated[float, typer.Option("--nop-max", help="NOP if r_out ≤ this")] = 0.2,
    broadcast_min: Annotated[float, typer.Option("--broadcast-min", help="broadcast if r_out ≥ this …")] = 0.5,
    broadcast_srank: Annotated[float, typer.Option("--broadcast-srank", help="… and stable rank ≤ this")] = 1.5,
    edits: Annotated[bool, typer.Option("--edits/--no-edits", help="run the causal value edits")] = True,
    edit_samples: Annotated[int, typer.Option("--edit-samples", help="samples the causal edits run on")] = EDIT_SAMPLES,
    edit_layers: Annotated[int, typer.Option("--edit-layers", help="sinking layers to edit, evenly spread "
                                             "(0: every sinking layer)")] = EDIT_LAYERS,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    revision: Annotated[str | None, typer.Option("--revision")] = None,
    trust_remote_code: Annotated[bool, trust_remote_code_option()] = False,
    seed: Annotated[int, typer.Option("--seed", help="0: texts in order; other: shuffled texts, random window offsets; also the control edit")] = 0,
    device_map: Annotated[str | None, device_map_option()] = None,
    image: Annotated[list[Path] | None, typer.Option(
        "--image", help="an image for a vision-language model (repeat for several; sample:NAME, a bundled photograph: "
        "chelsea, astronaut, coffee …); --text is the prompt after it")] = None,
) -> None:
    """Classify MODEL's sinks (NOP / broadcast), run causal value edits, write diagnosis.json and report.html."""
    from ..diagnose import diagnose as run_diagnose
    from ..diagnose import diagnose_inputs

    with user_errors():
        device = join_ranks(device, device_map)
        needs("--edit-samples", edit_samples, EDIT_SAMPLES, edits, "with --no-edits")
        needs("--edit-layers", edit_layers, EDIT_LAYERS, edits, "with --no-edits")
        needs("--sink-mass", sink_mass, DEFAULT_RULES["sink_mass"], rule == "mass",
              f"with --rule {rule} (it is rule 'mass''s threshold)")
        rules = {"rule": rule, "sink_mass": sink_mass, "nop_max_ratio": nop_max,
                 "broadcast_min_ratio": broadcast_min, "broadcast_max_srank": broadcast_srank}
        if image:
            if device_map is not None:
                raise SinklabError("--image diagnoses in one process on one device for now; drop --device-map "
                                   "(--device places the model)")
            _diagnose_images(model, image, text, file, out, rules=rules, edits=edits, edit_layers=edit_layers or None,
                             seed=seed, dtype=dtype, device=device, revision=revision,
                             trust_remote_code=trust_remote_code)
            return
        run = analysis_run(
            model, text, file, out, seq_len, samples=samples, batch_size=batch_size, seed=seed,
            phases={"scan": "statistics pass (samples)", "edits": "causal edits (edited passes)"}, dtype=dtype,
            device=device, revision=revision, trust_remote_code=trust_remote_code, device_map=device_map,
            on_texts=lambda loaded, texts, progress: run_diagnose(
                loaded.model, loaded.tokenizer, texts, seq_len=seq_len, samples=samples, batch_size=batch_size,
                rules=rules, edits=edits, edit_samples=edit_samples, edit_layers=edit_layers or None, seed=seed,
                source=model, revision=revision, progress=progress),
            on_images=lambda base, batches, labels, meta, progress: diagnose_inputs(
                base, batches, labels, rules=rules, edits=edits, edit_samples=edit_samples,
                edit_layers=edit_layers or None, special={"cls": "[CLS]"}, meta=meta, progress=progress, seed=seed))
        if run is None:  # not the main process: it writes the one report
            return
        d, loaded, texts, out = run
        record_run(d.scan.meta, loaded, texts, device=device, dtype=dtype)
        _print_diagnosis(d)
        print_warnings(d.scan.meta)
        print_recommendation(d.recommendation)
        report = save(d, out)
        console.print(f"wrote {out / 'diagnosis.json'}, figures and {report}")
        save_retention_plan(loaded, d.scan, out)


def _diagnose_images(model: str, paths: list[Path], text: str | None, file: Path | None, out: Path, *, rules: dict,
                     edits: bool, edit_layers: int | None, seed: int, dtype: str | None, device: str | None,
                     revision: str | None, trust_remote_code: bool) -> None:
    """``sinklab diagnose MODEL --image FILE``: the language model's sinks on the images and a prompt."""
    from ..diagnose import diagnose_images
    from ..models import load_processor
    from ..vision_inputs import check_vision_model, load_images
    from ._common import load_for_command, read_texts
    from .scan import print_modality

    images = load_images(paths)  # an unreadable file fails before anything loads
    texts = read_texts(text, file)
    out = check_out_dir(out)
    loaded = load_for_command(model, dtype=dtype, device=device, revision=revision,
                              trust_remote_code=trust_remote_code)
    check_vision_model(loaded.model)
    processor = load_processor(model, revision=revision, trust_remote_code=trust_remote_code)
    d = diagnose_images(loaded.model, images, " ".join(texts) if texts else "Describe the image.",
                        processor=processor, rules=rules, edits=edits, edit_layers=edit_layers, seed=seed,
                        source=model, revision=revision)
    _print_diagnosis(d)
    print_modality(d.scan)
    print_warnings(d.scan.meta)
    print_recommendation(d.recommendation)
    console.print(f"wrote {out / 'diagnosis.json'}, figures and {save(d, out)}")


@app.command()
def synth(
    task: Annotated[str, typer.Argument(help="nop (conditional damping) or broadcast (global broadcast)")],
    steps: Annotated[int | None, typer.Option("--steps", help="training steps (default: 2000 nop, 3000 broadcast)")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="samples per step")] = 256,
    batch_alias: Annotated[int | None, typer.Option("--batch", hidden=True, help="old name of --batch-size")] = None,
    lr: Annotated[float, typer.Option("--lr")] = 3e-3,
    gamma: Annotated[float, typer.Option("--gamma", help="nop: active tokens' target is gamma·x")] = 0.0,
    dim: Annotated[int, typer.Option("--dim", help="model width d")] = 64,
    seq_len: Annotated[int, typer.Option("--seq-len", help="tokens per sample N (the BOS slot comes on top)")] = 32,
    tokens_alias: Annotated[int | None, typer.Option("--tokens", hidden=True, help="old name of --seq-len")] = None,
    out: Annotated[Path | None, typer.Option("--out", help="output folder (default sinklab-synth-TASK)")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Train a synthetic task on CPU, diagnose it with the same pipeline, write synth.json and the report."""
    import json

    from ..synth import BroadcastTask, NopTask, run_broadcast, run_nop
    from ..atomic import atomic_dir
    from ._common import check_count

    with user_errors():
        if task not in ("nop", "broadcast"):
            raise SinklabError(f"unknown synthetic task {task!r}; choose 'nop' or 'broadcast'")
        batch_size = batch_alias if batch_alias is not None else batch_size
        seq_len = tokens_alias if tokens_alias is not None else seq_len
        check_count(steps, "--steps")
        check_count(batch_size, "--batch-size")
        check_count(dim, "--dim", 2)
        check_count(seq_len, "--seq-len", 2)
        if not lr > 0:
            raise SinklabError(f"--lr must be > 0, got {lr}")
        out = check_out_dir(out or Path(f"sinklab-synth-{task}"))
        total = steps or (2000 if task == "nop" else 3000)
        with progress_bar(total) as progress:
            bar = progress.add_task(f"training the {task} task on CPU", total=total)
            advance = lambda step, loss: progress.update(bar, completed=step)  # noqa: E731
            if task == "nop":
                result = run_nop(NopTask(d=dim, n=seq_len, gamma=gamma, seed=seed), steps=total, batch=batch_size,
                                 lr=lr, seed=seed, progress=advance)
            else:
                result = run_broadcast(BroadcastTask(d=dim, n=seq_len, seed=seed), steps=total, batch=batch_size,
                                       lr=lr, seed=seed, progress=advance)
        _print_diagnosis(result.diagnosis)
        table = Table(title=f"synthetic {task} task")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in result.metrics.items():
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        console.print(table)
        with atomic_dir(out) as tmp:
            save(result.diagnosis, tmp)
            (tmp / "synth.json").write_text(json.dumps({"task": task, "metrics": result.metrics, "log": result.log},
                                                       indent=1))
        console.print(f"wrote {out / 'synth.json'}, {out / 'diagnosis.json'}, figures and {out / 'report.html'}")


def _print_diagnosis(d) -> None:
    if not d.found:
        console.print(f"no sinks found (rule {d.rules['rule']!r}): no head's dominant column passed it")
    table = Table(title=f"{d.scan.meta['model']} — sinks per layer ({len(d.records)} in {d.scan.num_samples} samples)")
    for col in ("layer", "sink %", "nop", "broadcast", "unclass.", "top sink (role@pos)", "there %", "med r_out",
                "med srank"):
        table.add_column(col, justify="right")
    rows = d.per_layer()
    gated = any("mean_gate_on_sink" in r for r in rows)
    if gated:
        table.add_column("gate sink/else", justify="right")
    for r in rows:
        gate = [] if not gated else ["–" if r.get("mean_gate_on_sink") is None or r.get("mean_gate_elsewhere") is None
                                     else f"{r['mean_gate_on_sink']:.2f}/{r['mean_gate_elsewhere']:.2f}"]
        table.add_row(layer_label(r["layer"], r["kind"]), "–" if r["sink_pct"] is None else f"{r['sink_pct']:.0f}", str(r["counts"]["nop"]),
                      str(r["counts"]["broadcast"]),
                      str(r["counts"]["unclassified"]), r["top_sink"] or "–",
                      "–" if r["top_sink_pct"] is None else f"{r['top_sink_pct']:.0f}",
                      "–" if r["median_value_ratio_out"] is None else f"{r['median_value_ratio_out']:.3f}",
                      "–" if r["median_stable_rank"] is None else f"{r['median_stable_rank']:.2f}", *gate)
    console.print(table)
    if d.edits:
        n_edit = d.scan.meta.get("edit_samples", d.scan.num_samples)
        edits = Table(title=f"causal value edits: relative RMS change of the final hidden states ({n_edit} samples)")
        edits.add_column("head")
        edits.add_column("class")
        for name in d.edits[0].hidden:
            edits.add_column(name, justify="right")
        for e in d.edits:
            edits.add_row(f"L{e.layer} H{e.head}", e.kind, *[f"{v:.4f}" for v in e.hidden.values()])
        console.print(edits)
