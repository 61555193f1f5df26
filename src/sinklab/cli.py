"""Command-line interface: ``sinklab scan MODEL [...]`` (a thin layer over the Python API)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from .errors import SinklabError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Find, explain, use and fix attention sinks.")
console = Console(stderr=False)
err = Console(stderr=True)


@app.callback()
def _main() -> None:
    """sinklab: attention-sink scanning for Hugging Face transformers models."""


def _print_table(result) -> None:
    from .registry import REGISTRY

    table = Table(title=f"{result.meta['model']} — per layer (T={result.meta['seq_len']}, "
                        f"{result.num_samples} samples, ε={result.meta['thresholds']['eps']})")
    table.add_column("layer", justify="right")
    has_learned = bool(result.learned_sink_mass.nan_to_num(0).abs().max() > 1e-4)
    shown = [r for r in REGISTRY if r.terminal and (r.name != "learned_sink_mass" or has_learned)]
    for row in shown:
        table.add_column(row.title, justify="right")
    values = result.per_layer()
    for layer in range(result.num_layers):
        cells = ["–" if values[r.name][layer] is None else r.fmt.format(values[r.name][layer]) for r in shown]
        table.add_row(str(layer), *cells)
    console.print(table)
    pos, label = result.top_sink()
    console.print(f"Sink^ε(0) = [bold]{result.sink_rate(0):.1f} %[/bold] of layer×head pairs; "
                  f"most common sink: position {pos} ({label!r})", markup=True, highlight=False)


@contextmanager
def _user_errors():
    """Turn sinklab's input errors into one red line and exit code 2 (no traceback, no partial output)."""
    try:
        yield
    except SinklabError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(code=2) from None


def _load(model: str, **kwargs):
    from .models import load_model

    with console.status(f"loading {model} …"):
        return load_model(model, **kwargs)


def _read_texts(text: str | None, file: Path | None) -> list[str] | None:
    if text is not None and file is not None:
        raise SinklabError("give either --text or --file, not both")
    if text is not None:
        return [text]
    if file is not None:
        if not file.is_file():
            raise SinklabError(f"--file {file}: no such file")
        return [file.read_text(encoding="utf-8")]
    return None


def _progress(total: int) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True)


@app.command()
def scan(
    model: Annotated[str, typer.Argument(help="builtin:minilm, builtin:tiny-llama, a local path or a hub id")],
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
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code", help="run the model repo's own code")] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Scan MODEL for attention sinks; print a per-layer table and write scan.json, figures, report.html."""
    from .scan import scan as run_scan

    with _user_errors():
        texts = _read_texts(text, file)
        loaded = _load(model, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code)
        with _progress(samples) as progress:
            task = progress.add_task("scanning", total=samples)
            result = run_scan(loaded.model, loaded.tokenizer, texts, seq_len=seq_len, samples=samples,
                              batch_size=batch_size, thresholds={"eps": eps}, seed=seed, source=model,
                              revision=revision, progress=lambda n: progress.advance(task, n))
        _print_table(result)
        report = result.save(out)
        console.print(f"wrote {out / 'scan.json'}, figures and {report}")


@app.command()
def diagnose(
    model: Annotated[str, typer.Argument(help="builtin:minilm, builtin:tiny-llama, a local path or a hub id")],
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
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    revision: Annotated[str | None, typer.Option("--revision")] = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Classify MODEL's sinks (NOP / broadcast), run causal value edits, write diagnosis.json and report.html."""
    from .diagnose import diagnose as run_diagnose

    with _user_errors():
        texts = _read_texts(text, file)
        loaded = _load(model, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code)
        rules = {"rule": rule, "sink_mass": sink_mass, "nop_max_ratio": nop_max,
                 "broadcast_min_ratio": broadcast_min, "broadcast_max_srank": broadcast_srank}
        with _progress(samples) as progress:
            task = progress.add_task("diagnosing", total=samples)
            d = run_diagnose(loaded.model, loaded.tokenizer, texts, seq_len=seq_len, samples=samples, rules=rules,
                             edits=edits, seed=seed, source=model, revision=revision,
                             progress=lambda n: progress.advance(task, n))
        _print_diagnosis(d)
        report = d.save(out)
        console.print(f"wrote {out / 'diagnosis.json'}, figures and {report}")


@app.command()
def synth(
    task: Annotated[str, typer.Argument(help="nop (conditional damping) or broadcast (global broadcast)")],
    steps: Annotated[int | None, typer.Option("--steps", help="training steps (default: 2000 nop, 3000 broadcast)")] = None,
    batch: Annotated[int, typer.Option("--batch")] = 256,
    lr: Annotated[float, typer.Option("--lr")] = 3e-3,
    gamma: Annotated[float, typer.Option("--gamma", help="nop: active tokens' target is gamma·x")] = 0.0,
    dim: Annotated[int, typer.Option("--dim", help="model width d")] = 64,
    tokens: Annotated[int, typer.Option("--tokens", help="sequence length N")] = 32,
    out: Annotated[Path | None, typer.Option("--out", help="output folder (default sinklab-synth-TASK)")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Train a synthetic task on CPU, diagnose it with the same pipeline, write synth.json and the report."""
    import json

    from .synth import BroadcastTask, NopTask, run_broadcast, run_nop

    with _user_errors():
        if task not in ("nop", "broadcast"):
            raise SinklabError(f"unknown synthetic task {task!r}; choose 'nop' or 'broadcast'")
        if (steps is not None and steps < 1) or batch < 1 or dim < 2 or tokens < 2:
            raise SinklabError("--steps, --batch must be ≥ 1 and --dim, --tokens ≥ 2")
        out = out or Path(f"sinklab-synth-{task}")
        with console.status(f"training the {task} task on CPU …"):
            if task == "nop":
                result = run_nop(NopTask(d=dim, n=tokens, gamma=gamma, seed=seed), steps=steps or 2000, batch=batch,
                                 lr=lr, seed=seed)
            else:
                result = run_broadcast(BroadcastTask(d=dim, n=tokens, seed=seed), steps=steps or 3000, batch=batch,
                                       lr=lr, seed=seed)
        _print_diagnosis(result.diagnosis)
        table = Table(title=f"synthetic {task} task")
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key, value in result.metrics.items():
            table.add_row(key, f"{value:.4f}" if isinstance(value, float) else str(value))
        console.print(table)
        report = result.diagnosis.save(out)
        (out / "synth.json").write_text(json.dumps({"task": task, "metrics": result.metrics, "log": result.log}, indent=1))
        console.print(f"wrote {out / 'synth.json'}, {out / 'diagnosis.json'}, figures and {report}")


@app.command()
def stream(
    model: Annotated[str, typer.Argument(help="a RoPE causal LM: builtin:tiny-llama, a local path or a hub id")],
    prompt: Annotated[str | None, typer.Option("--prompt", help="prompt text")] = None,
    file: Annotated[Path | None, typer.Option("--file", help="read the prompt from a UTF-8 file")] = None,
    sinks: Annotated[int, typer.Option("--sinks", help="attention sinks kept forever (S)")] = 4,
    window: Annotated[int, typer.Option("--window", help="recent tokens each query sees, itself included (W)")] = 1020,
    pin_prompt: Annotated[bool, typer.Option("--pin-prompt", help="keep the whole prompt forever")] = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 256,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k")] = 0,
    chunk_size: Annotated[int, typer.Option("--chunk-size", help="prompt tokens per prefill chunk")] = 256,
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Generate with attention sinks + a sliding window in constant memory; tokens print as they come."""
    import sys as _sys
    import time

    from .stream import StreamSession, stream_generate

    with _user_errors():
        texts = _read_texts(prompt, file)
        if texts is None:
            raise SinklabError("give a prompt with --prompt or --file")
        loaded = _load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        session = StreamSession(loaded.model, num_sinks=sinks, window=window, chunk_size=chunk_size)
        start = time.perf_counter()
        count = 0
        with session:
            for piece in stream_generate(loaded.model, loaded.tokenizer, texts[0], num_sinks=sinks, window=window,
                                         pin_prompt=pin_prompt, max_new_tokens=max_new_tokens, temperature=temperature,
                                         top_k=top_k, seed=seed, session=session):
                _sys.stdout.write(piece)
                _sys.stdout.flush()
                count += 1
                if count % 16 == 0 or count == max_new_tokens:
                    rate = count / max(1e-9, time.perf_counter() - start)
                    err.print(f"[{count} tokens, {rate:.1f} tok/s, cache {session.cache_tokens()} / "
                              f"{session.state.capacity} tokens]", highlight=False)
        _sys.stdout.write("\n")


@app.command("eval-stream")
def eval_stream(
    model: Annotated[str, typer.Argument(help="a RoPE causal LM: builtin:tiny-llama, a local path or a hub id")],
    file: Annotated[Path | None, typer.Option("--file", help="long UTF-8 text (default: Python's pydoc topics)")] = None,
    tokens: Annotated[int, typer.Option("--tokens", help="tokens to evaluate")] = 4000,
    sinks: Annotated[int, typer.Option("--sinks")] = 4,
    window: Annotated[int, typer.Option("--window")] = 256,
    dense_limit: Annotated[int, typer.Option("--dense-limit", help="dense attention stops here")] = 2048,
    recompute_limit: Annotated[int, typer.Option("--recompute-limit", help="recompute is O(W)/token")] = 300,
    out: Annotated[Path, typer.Option("--out")] = Path("sinklab-eval-stream"),
    dtype: Annotated[str | None, typer.Option("--dtype")] = None,
    device: Annotated[str | None, typer.Option("--device")] = None,
    trust_remote_code: Annotated[bool, typer.Option("--trust-remote-code")] = False,
) -> None:
    """Running perplexity over a long text: dense, window-only, recompute, sinks + window (JSON and a plot)."""
    import json

    import torch

    from .stream.evaluate import evaluate_stream, running_ppl
    from .texts import default_texts

    with _user_errors():
        if tokens < 2 or window < 1 or sinks < 0:
            raise SinklabError("--tokens must be ≥ 2, --window ≥ 1 and --sinks ≥ 0")
        text = file.read_text(encoding="utf-8") if file is not None else "\n\n".join(default_texts())
        if file is not None and not text.strip():
            raise SinklabError(f"--file {file} is empty")
        loaded = _load(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
        ids = torch.tensor(loaded.tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"][:tokens])
        with _progress(tokens) as progress:
            task = progress.add_task("sinks + window", total=ids.numel() - 1)
            result = evaluate_stream(loaded.model, ids, num_sinks=sinks, window=window, dense_limit=dense_limit,
                                     recompute_limit=recompute_limit, progress=lambda n: progress.advance(task, n))
        result["model"] = model
        table = Table(title=f"{model}: running perplexity over {ids.numel()} tokens (S={sinks}, W={window})")
        for col in ("method", "tokens", "PPL", "s/token"):
            table.add_column(col, justify="right")
        for name, curve in result["curves"].items():
            table.add_row(name, str(curve["tokens"]), "–" if curve["ppl"] is None else f"{curve['ppl']:.2f}",
                          f"{curve['seconds_per_token'] * 1e3:.2f} ms")
        console.print(table)
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval_stream.json").write_text(json.dumps(result, indent=1))
        from .report.figures import plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, curve in result["curves"].items():
            ppl = running_ppl(torch.tensor(curve["nll"]))
            if ppl:
                ax.plot(range(1, len(ppl) + 1), ppl, label=name)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("running perplexity")
        ax.axvline(sinks + window, color="grey", ls=":", lw=1, label="first eviction")
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / "eval_stream.png", dpi=110)
        console.print(f"wrote {out / 'eval_stream.json'} and {out / 'eval_stream.png'}")


@app.command("train")
def train_cmd(
    out: Annotated[Path, typer.Option("--out", help="run folder (checkpoints, monitor.jsonl, emergence.png)")],
    data: Annotated[str, typer.Option("--data", help="pydoc (English shipped with Python), bb (Bigram-Backcopy) or a text file")] = "pydoc",
    layers: Annotated[int, typer.Option("--layers")] = 4,
    width: Annotated[int, typer.Option("--width")] = 128,
    heads: Annotated[int, typer.Option("--heads")] = 4,
    seq_len: Annotated[int, typer.Option("--seq-len", help="tokens per sample, BOS included")] = 64,
    batch: Annotated[int, typer.Option("--batch")] = 32,
    steps: Annotated[int, typer.Option("--steps")] = 2000,
    lr: Annotated[float, typer.Option("--lr")] = 3e-3,
    weight_decay: Annotated[float, typer.Option("--weight-decay")] = 0.1,
    warmup: Annotated[int, typer.Option("--warmup")] = 100,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="BPE vocabulary for text data")] = 4096,
    variant: Annotated[str | None, typer.Option("--variant", help="sink-logit, softmax1, kv-bias, gated, gated-headwise, registers; combine with +")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="0: final only")] = 0,
    monitor_every: Annotated[int, typer.Option("--monitor-every")] = 100,
    max_chars: Annotated[int | None, typer.Option("--max-chars", help="cap the text corpus")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Train a small causal LM on CPU with a sink monitor; safetensors checkpoints (load with sinklab.load)."""
    from .train import TrainConfig, train

    with _user_errors():
        cfg = TrainConfig(data=data, layers=layers, width=width, heads=heads, seq_len=seq_len, batch=batch, steps=steps,
                          lr=lr, weight_decay=weight_decay, warmup=warmup, vocab_size=vocab_size, variant=variant,
                          seed=seed, checkpoint_every=checkpoint_every, monitor_every=monitor_every, max_chars=max_chars)
        with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"),
                      TimeElapsedColumn(), console=err, transient=True) as progress:
            task = progress.add_task("train", total=steps, loss="–")
            summary = train(cfg, out, progress=lambda s, loss: progress.update(task, completed=s, loss=f"{loss:.3f}"))
        last = summary["last"]
        console.print(f"trained {summary['steps']} steps ({summary['tokens']:,} tokens, {summary['seconds']:.0f} s), "
                      f"final loss {summary['final_loss']:.3f}")
        console.print("Sink^ε(0) per layer: " + ", ".join(f"{x:.0f} %" for x in last["sink_rate_0"]))
        if "bb" in summary:
            console.print("Bigram-Backcopy: " + ", ".join(f"{k} {v:.3f}" for k, v in summary["bb"].items()))
        console.print(f"wrote {out}/final (safetensors), monitor.jsonl, emergence.png, summary.json")


def _print_diagnosis(d) -> None:
    if not d.found:
        console.print(f"no sinks found (rule {d.rules['rule']!r}): no head's dominant column passed it")
    table = Table(title=f"{d.scan.meta['model']} — sinks per layer ({len(d.records)} in {d.scan.num_samples} samples)")
    for col in ("layer", "sink %", "nop", "broadcast", "unclass.", "top token", "med r_out", "med srank"):
        table.add_column(col, justify="right")
    for r in d.per_layer():
        table.add_row(str(r["layer"]), f"{r['sink_pct']:.0f}", str(r["counts"]["nop"]), str(r["counts"]["broadcast"]),
                      str(r["counts"]["unclassified"]), str(r["top_token"] or "–"),
                      "–" if r["median_value_ratio_out"] is None else f"{r['median_value_ratio_out']:.3f}",
                      "–" if r["median_stable_rank"] is None else f"{r['median_stable_rank']:.2f}")
    console.print(table)
    if d.edits:
        edits = Table(title="causal value edits: relative RMS change of the final hidden states")
        edits.add_column("head")
        edits.add_column("class")
        for name in d.edits[0].hidden:
            edits.add_column(name, justify="right")
        for e in d.edits:
            edits.add_row(f"L{e.layer} H{e.head}", e.kind, *[f"{v:.4f}" for v in e.hidden.values()])
        console.print(edits)


def main() -> None:  # pragma: no cover - console-script entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
