"""What the benchmark scripts share: where results go, each result's metadata, atomic JSON, Markdown tables.

Small on purpose; a script imports what it needs (``from _common import RESULTS, print_table, run_metadata,
write_result``, this folder being the script's own on ``sys.path`` when it runs):

* :data:`ROOT`, :data:`RESULTS` (``benchmarks/results/``), :data:`DOCS` (``docs/``);
* :func:`run_metadata` — ``sinklab.provenance`` (command line, model, device, dtype, UTC timestamp, versions, a
  hash of the input texts) plus the machine (platform, CPUs, torch threads), the source's git state and the
  wall time; every result's ``meta``;
* :func:`write_result` — a JSON file under :data:`RESULTS` (or any path) through ``sinklab.atomic.write_json``:
  a run that fails leaves the previous file as it was;
* :func:`markdown_table` / :func:`print_table` — rows (dicts) as a Markdown table, for the terminal and docs;
* :func:`greedy_steps` — a stream session's greedy decode steps, timed one by one.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOCS = ROOT / "docs"

__all__ = ["DOCS", "RESULTS", "ROOT", "git_state", "greedy_steps", "markdown_table", "print_table", "run_metadata",
           "write_result"]


def git_state() -> str:
    """``commit <short hash>`` of the checkout, ``… with uncommitted changes in src/`` when ``src/`` differs from
    it, or ``an unknown commit`` outside a git checkout (read-only git calls)."""

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    try:
        commit, dirty = git("rev-parse", "--short", "HEAD"), git("status", "--porcelain", "--", "src")
    except (OSError, subprocess.CalledProcessError):
        return "an unknown commit"
    return f"commit {commit}" + (" with uncommitted changes in src/" if dirty else "")


def run_metadata(argv: Sequence[str] | None = None, *, model: object = None, device: object = None,
                 dtype: object = None, texts: Sequence[str] | None = None, wall_seconds: float | None = None,
                 **extra: Any) -> dict:
    """The ``meta`` record of one benchmark result.

    ``sinklab.provenance.provenance`` (``argv``, default ``sys.argv``, as ``python <script> <args>``; the model,
    device, dtype and texts as that function takes them), plus ``machine`` (platform, CPU count, torch's intra-op
    threads), ``git`` (:func:`git_state`), ``wall_seconds`` when given, and every ``extra`` field as it is.
    """
    import torch

    from sinklab.provenance import provenance

    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv else None
    if script is not None and script.suffix == ".py":  # `python benchmarks/x.py …`, relative to the repository
        argv[0] = script.resolve().relative_to(ROOT).as_posix() if script.resolve().is_relative_to(ROOT) else str(script)
        argv.insert(0, "python")
    meta = provenance(argv, model, device, dtype, texts)
    meta["machine"] = {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                       "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    meta["git"] = git_state()
    if wall_seconds is not None:
        meta["wall_seconds"] = round(float(wall_seconds), 2)
    meta.update(extra)
    return meta


def write_result(name: str | Path, data: dict, *, quiet: bool = False) -> Path:
    """Write ``data`` as indented JSON to ``RESULTS / name`` (an absolute path is used as it is), atomically
    (``sinklab.atomic.write_json``: a failed run leaves the old file). Returns the path; prints it unless
    ``quiet``."""
    from sinklab.atomic import write_json

    path = Path(name) if Path(name).is_absolute() else RESULTS / name
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)
    if not quiet:
        print(f"wrote {path}")
    return path


def _cell(value: object, digits: int) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return "" if value is None else str(value).replace("|", "/")


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | dict[str, str] | None = None,
                   digits: int = 4) -> str:
    """``rows`` as a Markdown table: ``columns`` the keys to show (a dict maps each key to its header; default
    the first row's keys), floats to ``digits`` significant digits, a missing value blank."""
    if columns is None:
        columns = list(rows[0]) if rows else []
    headers = dict(columns) if isinstance(columns, dict) else {c: c for c in columns}
    lines = ["| " + " | ".join(headers.values()) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_cell(row.get(key), digits) for key in headers) + " |" for row in rows]
    return "\n".join(lines)


def print_table(rows: Sequence[dict], columns: Sequence[str] | dict[str, str] | None = None, digits: int = 4,
                title: str | None = None) -> None:
    """Print :func:`markdown_table` (after ``title`` when given)."""
    if title:
        print(f"\n{title}\n")
    print(markdown_table(rows, columns, digits), flush=True)


def greedy_steps(session: Any, logits: Any, steps: int, warm: int = 0) -> tuple[Any, list[float]]:
    """``warm`` untimed, then ``steps`` timed greedy decode steps of a ``StreamSession`` from ``logits`` (the last
    step's or the prompt's): the last logits and each timed step's milliseconds."""
    import time

    for _ in range(warm):
        logits = session.step(logits.argmax(-1))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = session.step(logits.argmax(-1))
        times.append(1e3 * (time.perf_counter() - start))
    return logits, times
