"""``sinklab vit-experiment``: registers vs gating vs both on a small ViT, at one identical budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ..vit.experiment import VARIANT_SPECS
from ._common import user_errors, app, console, err


@app.command("vit-experiment")
def vit_experiment(
    variants: Annotated[str, typer.Option("--variants", help="comma-separated: "
                                          + ", ".join(VARIANT_SPECS))] = "baseline,registers,gated,gated+registers",
    seeds: Annotated[int, typer.Option("--seeds")] = 3,
    minutes: Annotated[float, typer.Option("--minutes", help="total budget; one step count for every run")] = 10.0,
    out: Annotated[Path, typer.Option("--out", help="run folder (resumable)")] = Path("sinklab-vit-experiment"),
    image_size: Annotated[int, typer.Option("--image-size", help="square images, pixels")] = 24,
    patch_size: Annotated[int, typer.Option("--patch-size")] = 4,
    width: Annotated[int, typer.Option("--width")] = 48,
    layers: Annotated[int, typer.Option("--layers")] = 4,
    heads: Annotated[int, typer.Option("--heads")] = 4,
    registers: Annotated[int, typer.Option("--registers")] = 4,
    batch: Annotated[int, typer.Option("--batch")] = 32,
    lr: Annotated[float, typer.Option("--lr")] = 2e-3,
) -> None:
    """Train each variant with identical data and budget, probe frozen features, diagnose; table + figures."""
    from ..report.vit_figures import write_experiment_figures
    from ..vit.experiment import VitExperimentConfig, experiment_runs, run_experiment

    with user_errors():
        cfg = VitExperimentConfig(variants=[v.strip() for v in variants.split(",") if v.strip()], seeds=seeds,
                                  minutes=minutes, image_size=image_size, patch_size=patch_size, width=width, layers=layers, heads=heads, registers=registers,
                                  batch=batch, lr=lr)
        tasks: dict[str, TaskID] = {}
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, transient=True) as progress:
            def update(name: str, done: int, total: int) -> None:
                if name not in tasks:
                    tasks[name] = progress.add_task(f"training {name}", total=total)
                progress.update(tasks[name], completed=done)

            console.print("measuring throughput …" if not (out / "plan.json").exists() else f"resuming {out}")
            summary = run_experiment(cfg, out, progress=update)
        write_experiment_figures(summary, experiment_runs(cfg, out), cfg, out)
        console.print(summary["table_md"])
        console.print(f"wrote {out}/results.json, table.md, sink_classes.png, attention_maps.png, output_norms.png")
