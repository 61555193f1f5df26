"""``sinklab circuit`` and ``sinklab circuit-sweep``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from ..circuit.analysis import CAUSAL_SAMPLES, CONDITION_SAMPLES, LOSS_STRIDE
from ..errors import InputError
from ._common import (
    MODEL_HELP,
    progress_bar,
    read_texts,
    user_errors,
    app,
    check_out_dir,
    console,
    device_map_option,
    err,
    needs,
)


def _print_result(result) -> None:
    names = list(result.conditions)
    table = Table(title=f"P0 sink circuit — T={result.seq_len}, {result.num_samples} samples, ε={result.eps}")
    for col in ["block", "r", "c_attn", "c_mlp", "cos x₀", *[f"Sink_0 {n}" for n in names]]:
        table.add_column(col, justify="right")

    def f(x, fmt="{:.2f}"):
        return "–" if x is None else fmt.format(x)

    table.add_row("emb", f(result.ratio[0]), "", "", f(result.direction_cosine[0], "{:.3f}"), *[""] * len(names))
    for layer in range(result.num_layers):
        mark = "★" if layer in result.amplification_blocks else ""
        table.add_row(f"{layer}{mark}", f(result.ratio[layer + 1]), f(result.contributions["attn"][layer]),
                      f(result.contributions["mlp"][layer]), f(result.direction_cosine[layer + 1], "{:.3f}"),
                      *[f(result.conditions[n]["sink_rate"][0][layer], "{:.0f}") for n in names])
    console.print(table)
    _print_destinations(result, f)
    console.print(result.summary(), highlight=False, markup=False)
    console.print("★ = " + result.rules["amplification"], highlight=False, markup=False)


def _print_destinations(result, f) -> None:
    """The "where the attention goes" table: the sink-losing condition next to the reference, per block."""
    name = result.ablation.get("attention_condition")
    if not name:
        return
    ref, cond = result.ablation["attention"]["as_tokenized"], result.ablation["attention"][name]
    table = Table(title=f"Where the attention goes under {name} (as tokenized in brackets)")
    for col in ("block", "Sink_0", "entropy", "pos 0 mass", "top pos (token)", "share", "diagonal", "previous",
                "other sink % (token)", "‖out‖"):
        table.add_column(col, justify="right")
    for layer in range(result.num_layers):
        other = cond["other_sink_pct"][layer]
        tok = cond["other_sink_token"][layer]
        table.add_row(
            str(layer), f"{f(result.conditions[name]['sink_rate'][0][layer], '{:.0f}')} "
                        f"({f(result.conditions['as_tokenized']['sink_rate'][0][layer], '{:.0f}')})",
            f"{f(cond['entropy'][layer])} ({f(ref['entropy'][layer])})",
            f"{f(cond['position0_mass'][layer], '{:.3f}')} ({f(ref['position0_mass'][layer], '{:.3f}')})",
            f"{cond['top_position'][layer]} ({cond['top_token'][layer]!r})", f(cond["top_share"][layer], "{:.3f}"),
            f"{f(cond['diagonal'][layer], '{:.3f}')} ({f(ref['diagonal'][layer], '{:.3f}')})",
            f"{f(cond['previous'][layer], '{:.3f}')} ({f(ref['previous'][layer], '{:.3f}')})",
            f"{f(other, '{:.0f}')}" + (f" ({tok!r})" if tok is not None else ""),
            f"{f(cond['out_norm'][layer], '{:.3g}')} ({f(ref['out_norm'][layer], '{:.3g}')})")
    console.print(table, markup=False)


@app.command("circuit")
def circuit_cmd(
    model: Annotated[str, typer.Argument(help=MODEL_HELP + " (a sinklab train checkpoint too; hub ids take @revision)")],
    text: Annotated[str | None, typer.Option("--text", help="text to analyse")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="UTF-8 text file")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 64,
    samples: Annotated[int, typer.Option("--samples")] = 16,
    batch_size: Annotated[int, typer.Option("--batch-size")] = 8,
    special_token: Annotated[str | None, typer.Option("--special-token", help="token to prepend when the tokenizer adds no BOS")] = None,
    no_causal: Annotated[bool, typer.Option("--no-causal", help="skip the patching passes")] = False,
    causal_samples: Annotated[int, typer.Option("--causal-samples", help="samples the causal patches run on "
                                                "(0: every sample)")] = CAUSAL_SAMPLES,
    condition_samples: Annotated[int, typer.Option("--condition-samples", help="samples the other first-token "
                                                   "conditions run on (0: every sample)")] = CONDITION_SAMPLES,
    loss_stride: Annotated[int, typer.Option("--loss-stride", help="the loss scores every k-th next-token target, "
                                             "counting back from each row's last (1: every one)")] = LOSS_STRIDE,
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("sinklab-circuit"),
    device_map: Annotated[str | None, device_map_option()] = None,
    image: Annotated[list[Path] | None, typer.Option(
        "--image", help="a vision-language model's images, one sample each (repeat; sample:NAME, a bundled "
        "photograph); --text is the prompt")] = None,
) -> None:
    """The P0 sink circuit: first-token ablation, amplification layer, attention vs MLP, causal check."""
    from ..circuit.sweep import Checkpoint, circuit_source, load_source
    from ..report import save

    with user_errors():
        texts = read_texts(text, file)
        needs("--causal-samples", causal_samples, CAUSAL_SAMPLES, not no_causal, "with --no-causal")
        if image:
            if device_map is not None:
                raise InputError("--image runs the circuit in one process on one device for now; drop --device-map")
            _circuit_images(model, image, " ".join(texts) if texts else "Describe the image.", out,
                            causal=not no_causal)
            return
        out = check_out_dir(out)
        path = Path(model)
        if path.is_dir():
            parent = path.parent if (path.parent / "train_config.json").exists() else None
            ck = Checkpoint(path.name, 0, str(path), run_dir=str(path) if (path / "train_config.json").exists()
                            else (str(parent) if parent else None))
        elif model.startswith("builtin:"):
            ck = Checkpoint(model, 0, model, kind="hub")
        else:
            name, _, rev = model.partition("@")
            ck = Checkpoint(model, 0, name, kind="hub", revision=rev or None)
        with console.status(f"loading {model} …"):
            net, tokenizer, cfg = load_source(ck, device_map=device_map)
        passes = 5 if not no_causal else 3
        with progress_bar(passes * samples) as progress:
            task = progress.add_task("circuit", total=passes * samples)
            result = circuit_source(net, tokenizer, cfg, texts=texts, seq_len=seq_len, samples=samples, source=model,
                                    batch_size=batch_size, causal=not no_causal,
                                    causal_samples=causal_samples or None,
                                    condition_samples=condition_samples or None, loss_stride=loss_stride,
                                    progress=lambda k: progress.advance(task, k),
                                    set_total=lambda n: progress.update(task, total=n),
                                    **({"special_token": special_token} if tokenizer is not None else {}))
        _print_result(result)
        report = save(result, out)
        console.print(f"wrote {out}/circuit.json, figures and {report}")


def _circuit_images(model: str, paths: list[Path], text: str, out: Path, *, causal: bool) -> None:
    """``sinklab circuit MODEL --image FILE …``: the circuit on one sample per image, the pixels in every forward."""
    from ..circuit import circuit_images
    from ..models import load_processor
    from ..report import save
    from ..vision_inputs import check_vision_model, load_images
    from ._common import load_for_command

    images = load_images(paths)  # an unreadable file fails before anything loads
    out = check_out_dir(out)
    loaded = load_for_command(model)
    check_vision_model(loaded.model)
    processor = load_processor(model)
    with console.status(f"the circuit on {len(images)} image(s) …"):
        result = circuit_images(loaded.model, images, text, processor=processor, causal=causal, source=model)
    _print_result(result)
    console.print(f"wrote {out}/circuit.json, figures and {save(result, out)}")


@app.command("circuit-sweep")
def circuit_sweep_cmd(
    checkpoints: Annotated[list[str], typer.Argument(help="run folders, checkpoint folders or hub ids (id@revision)")],
    text: Annotated[str | None, typer.Option("--text")] = None,
    file: Annotated[Path | None, typer.Option("--file")] = None,
    seq_len: Annotated[int, typer.Option("--seq-len")] = 64,
    samples: Annotated[int, typer.Option("--samples")] = 16,
    no_init: Annotated[bool, typer.Option("--no-init", help="do not add a run's rebuilt random initialisation (step 0)")] = False,
    no_causal: Annotated[bool, typer.Option("--no-causal", help="skip the patching passes")] = False,
    out: Annotated[Path, typer.Option("--out", help="output folder")] = Path("sinklab-circuit-sweep"),
) -> None:
    """The circuit on every checkpoint: amplification layer, Sink_0 per layer and the stage vs training step."""
    from ..circuit.sweep import circuit_sweep, discover_checkpoints
    from ..report import save

    with user_errors():
        texts = read_texts(text, file)
        out = check_out_dir(out)
        found = discover_checkpoints(checkpoints, include_init=not no_init)
        passes = 5 if not no_causal else 3  # per checkpoint; raised when a checkpoint needs the early patches too
        table = Table(title="circuit sweep")
        for col in ("checkpoint", "step", "stage", "location", "amp. layer", "Sink_0 % per layer"):
            table.add_column(col, no_wrap=col in ("checkpoint", "stage"))

        def row(ck, r):
            if r["error"]:
                err.print(f"[red]{ck.label}: failed[/red] — {r['error']}", highlight=False)
                table.add_row(ck.label, str(ck.step), "failed", "", "", "")
            else:
                table.add_row(ck.label, str(ck.step), r["stage"], r["location"], str(r["amplification_layer"]),
                              " ".join(f"{v:.0f}" for v in r["sink_rate"][0]))
            progress.update(task, description=f"sweep ({ck.label} done)")

        with progress_bar(len(found) * passes * samples) as progress:
            task = progress.add_task("sweep", total=len(found) * passes * samples)
            def more(n):  # this checkpoint needs n sample passes instead of the planned passes × samples
                progress.update(task, total=progress.tasks[0].total + n - passes * samples)

            sweep = circuit_sweep(checkpoints, include_init=not no_init, texts=texts, seq_len=seq_len, samples=samples,
                                  causal=not no_causal, on_checkpoint=row, progress=lambda k: progress.advance(task, k),
                                  set_total=more)
        console.print(table)
        console.print("stage rule: " + sweep.rules["stage"], highlight=False, markup=False)
        report = save(sweep, out)
        console.print(f"wrote {out}/sweep.json, figures and {report}")
