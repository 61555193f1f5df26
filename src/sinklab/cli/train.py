"""``sinklab train``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import InputError
from ..variants import VARIANT_NAMES
from ._common import user_errors, app, check_out_dir, console, err, join_ranks

_VARIANTS = ", ".join(VARIANT_NAMES) + "; combine with +"


@app.command("train")
def train_cmd(
    out: Annotated[Path, typer.Option("--out", help="run folder (checkpoints, monitor.jsonl, emergence.png)")],
    data: Annotated[str, typer.Option("--data", help="pydoc (English shipped with Python), bb (Bigram-Backcopy) or a text file")] = "pydoc",
    layers: Annotated[int, typer.Option("--layers")] = 4,
    width: Annotated[int, typer.Option("--width")] = 128,
    heads: Annotated[int, typer.Option("--heads")] = 4,
    seq_len: Annotated[int, typer.Option("--seq-len", help="tokens per sample, BOS included")] = 64,
    batch_size: Annotated[int, typer.Option("--batch-size", help="samples per step")] = 32,
    batch_alias: Annotated[int | None, typer.Option("--batch", hidden=True, help="old name of --batch-size")] = None,
    steps: Annotated[int, typer.Option("--steps")] = 2000,
    lr: Annotated[float, typer.Option("--lr")] = 3e-3,
    weight_decay: Annotated[float, typer.Option("--weight-decay")] = 0.1,
    warmup: Annotated[int, typer.Option("--warmup", help="linear warm-up steps")] = 100,
    vocab_size: Annotated[int, typer.Option("--vocab-size", help="BPE vocabulary for text data")] = 4096,
    variant: Annotated[str | None, typer.Option("--variant", help=_VARIANTS)] = None,
    arch: Annotated[str, typer.Option("--arch", help="llama, or qwen3-next (transformers' Qwen3-Next: softmax "
                                      "attention layers with its sigmoid output gate, dense MLP)")] = "llama",
    output_gate: Annotated[bool, typer.Option("--output-gate/--no-output-gate", help="qwen3-next: train with the "
                                              "output gate, or hold it at ½ (the same model without a gate)")] = True,
    sink_init: Annotated[float | None, typer.Option(
        "--sink-init", help="start of the learned sink logit (sink-logit variants; default 0). ≈ log(seq-len) "
        "lets it win the race against a first-token sink (docs/sink_logit.md)")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="0: final only")] = 0,
    monitor_every: Annotated[int, typer.Option("--monitor-every")] = 100,
    max_chars: Annotated[int | None, typer.Option("--max-chars", help="cap the text corpus")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    nproc: Annotated[int, typer.Option("--nproc", help="processes (DDP, gloo on CPU): runs torchrun --standalone "
                                       "--nproc-per-node N -m sinklab train with the other options")] = 1,
) -> None:
    """Train a small causal LM on CPU with a sink monitor; safetensors checkpoints (load with sinklab.load)."""
    from .. import distributed
    from ..monitor import read_records
    from ..report.monitor_figures import write_emergence
    from ..train import TrainConfig, train

    if nproc > 1 and not distributed.launched():
        raise typer.Exit(code=_relaunch(nproc))
    with user_errors(interrupted=f"training stopped; the checkpoints written so far stay in {out}"):
        if nproc < 1:
            raise InputError(f"--nproc must be ≥ 1, got {nproc}")
        join_ranks(None)
        if batch_alias is not None:
            if batch_size != 32 and batch_alias != batch_size:
                raise InputError("--batch is the old name of --batch-size: give one of them")
            batch_size = batch_alias
        cfg = TrainConfig(data=data, layers=layers, width=width, heads=heads, seq_len=seq_len, batch=batch_size,
                          steps=steps, lr=lr, weight_decay=weight_decay, warmup=warmup, vocab_size=vocab_size,
                          variant=variant, arch=arch, output_gate=output_gate, sink_init=sink_init, seed=seed, checkpoint_every=checkpoint_every, monitor_every=monitor_every,
                          max_chars=max_chars)
        check_out_dir(out)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn(), console=err,
                      transient=True, disable=console.quiet) as progress:  # quiet: not the main rank
            task = progress.add_task("preparing data", total=steps, loss="–")
            summary = train(cfg, out, progress=lambda s, loss: progress.update(task, completed=s, loss=f"{loss:.3f}"),
                            phase=lambda name: progress.update(task, description=name))
        if not distributed.is_main():
            return
        write_emergence(read_records(out / "monitor.jsonl"), out / "emergence.png")
        last = summary["last"]
        console.print(f"trained {summary['steps']} steps ({summary['tokens']:,} tokens, {summary['seconds']:.0f} s), "
                      f"final loss {summary['final_loss']:.3f}")
        console.print("Sink^ε(0) per layer: " + ", ".join(f"{x:.0f} %" for x in last["sink_rate_0"]), highlight=False)
        if "bb" in summary:
            console.print("Bigram-Backcopy (layer 0, head 0): "
                          + ", ".join(f"{k} {v:.3f}" for k, v in summary["bb"].items()), highlight=False)
        console.print(f"wrote {out}/final (safetensors), monitor.jsonl, emergence.png, summary.json")


def _relaunch(nproc: int) -> int:
    """``sinklab train --nproc N …`` → ``torchrun --standalone --nproc-per-node N -m sinklab train …``; its exit code."""
    import subprocess
    import sys

    args, skip = [], False
    for arg in sys.argv[1:]:  # the same command line without --nproc
        if skip or arg == "--nproc" or arg.startswith("--nproc="):
            skip = arg == "--nproc"
            continue
        args.append(arg)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m", "sinklab", *args]
    return subprocess.run(cmd, check=False).returncode
