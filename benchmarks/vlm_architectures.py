"""The vision-language sweep: every image-text-to-text model type transformers registers, as a tiny random model,
scanned on one drawn image and a short text and checked against its own eager attention weights.

A thin command line over :mod:`sinklab.testing.vlm_conformance` (what the cells check is written there). Each type
runs in its own forked process with a timeout, ``--jobs`` at a time. Writes ``benchmarks/results/vlm_architectures.json``
and the page of both sweeps, ``docs/architectures.md`` (its vision-language section, by ``architectures.write_page``:
one generator, the causal-LM matrix's columns):

    PYTHONPATH=src python benchmarks/vlm_architectures.py [--types llava qwen2_vl …] [--jobs 2] [--timeout 120]

``--types`` alone writes to a temporary folder (printed at the end); ``--types … --merge`` updates the committed table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
import warnings
from multiprocessing.connection import Connection, wait
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from _common import DOCS, RESULTS, run_metadata, write_result  # noqa: E402
from architectures import DEFAULT_JSON as CAUSAL_JSON  # noqa: E402
from architectures import write_page  # noqa: E402

from sinklab.testing.conformance import CELLS, crash_text, source_files, source_fingerprint  # noqa: E402
from sinklab.testing.vlm_conformance import STATUSES, all_types, run_row  # noqa: E402

DEFAULT_JSON = RESULTS / "vlm_architectures.json"
#: The module whose sinklab imports (followed) the sweep's fingerprint covers.
ROOT_MODULE = "sinklab.testing.vlm_conformance"
DEFAULT_DOCS = DOCS / "architectures.md"


def _child(name: str, conn: Connection) -> None:
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    try:
        conn.send(run_row(name))
    except Exception as exc:  # noqa: BLE001 - a bug of this script: say so
        conn.send({"type": name, "status": "crash", "detail": f"harness: {crash_text(exc)}"})
    finally:
        conn.close()


def run_all(names: list[str], jobs: int, timeout: float) -> list[dict]:
    """Every row in its own forked process, ``jobs`` at a time; a worker past ``timeout`` seconds is a crash."""
    ctx = mp.get_context("fork")
    todo, running, rows = list(names), {}, {}
    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(name, child), daemon=True)
            proc.start()
            child.close()
            running[parent] = (name, proc, time.monotonic())
        for conn in wait(list(running), timeout=1.0):
            name, proc, _ = running.pop(conn)  # type: ignore[index]
            try:
                rows[name] = conn.recv()  # type: ignore[union-attr]
            except EOFError:
                rows[name] = {"type": name, "status": "crash", "detail": "the worker died"}
            proc.join()
            print(f"{name:32s} {rows[name]['status']}", flush=True)
        for conn, (name, proc, t0) in list(running.items()):
            if time.monotonic() - t0 > timeout:
                proc.kill()
                proc.join()
                running.pop(conn)
                rows[name] = {"type": name, "status": "crash", "detail": f"timed out after {timeout:.0f} s"}
                print(f"{name:32s} crash (timeout)", flush=True)
    return [rows[n] for n in names]


def cell_status(row: dict, column: str) -> str:
    """A built row's status in one column of the causal-LM matrix's (the scan's is the row's own)."""
    return row["status"] if column == "scan" else row.get(column, {}).get("status", "—")


def counts(rows: list[dict]) -> dict:
    built = [r for r in rows if r["status"] != "not built"]
    out: dict = {"types": len(rows), "built": len(built), **{s: sum(r["status"] == s for r in rows) for s in STATUSES}}
    for column in CELLS[1:]:
        cells = [cell_status(r, column) for r in built]
        out[column] = {s: cells.count(s) for s in STATUSES if s != "not built"}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", nargs="*", help="model types (default: all image-text-to-text types)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0)
    parser.add_argument("--merge", action="store_true", help="with --types: update the committed table")
    args = parser.parse_args()
    names = args.types or all_types()
    t0 = time.monotonic()
    rows = run_all(names, args.jobs, args.timeout)
    out_json, out_docs = DEFAULT_JSON, DEFAULT_DOCS
    source = {"fingerprint": source_fingerprint(ROOT_MODULE), "files": len(source_files(ROOT_MODULE))}
    if args.types and args.merge and DEFAULT_JSON.exists():
        committed = json.loads(DEFAULT_JSON.read_text())
        old = {r["type"]: r for r in committed["rows"]}
        old.update({r["type"]: r for r in rows})
        rows = [old[n] for n in sorted(old)]
        if committed["meta"].get("source") != source:  # rows from other sources kept: the table is not current
            source = {**source, "fingerprint": "mixed (a --merge over other sources)"}
    elif args.types:
        folder = Path(tempfile.mkdtemp(prefix="sinklab-vlm-"))
        out_json, out_docs = folder / "vlm_architectures.json", folder / "architectures.md"
    meta = run_metadata(wall_seconds=round(time.monotonic() - t0, 1), transformers=transformers.__version__,
                        source=source)
    write_result(out_json, {"meta": meta, "counts": counts(rows), "rows": rows})
    print(f"wrote {write_page(CAUSAL_JSON, out_json, out_docs)}")
    print(json.dumps(counts(rows)))


if __name__ == "__main__":
    main()
