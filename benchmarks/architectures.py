"""The architecture matrix: every model type transformers knows, as a tiny random model, through sinklab.

A thin command line over :mod:`sinklab.testing.conformance` (what each cell checks and against what is written
there): one row per causal-LM type of transformers (plus a few encoder and vision families as their base models,
``<type>@base``), then the extra configurations of ``conformance.CONFIGURATIONS`` (other layer counts, mixed layer
kinds). Each row runs in its own forked process with a timeout, ``--jobs`` at a time. Writes
``benchmarks/results/architectures.json`` and ``docs/architectures.md``, both with the fingerprint of the sinklab
sources the cells exercise (``conformance.source_fingerprint``); ``tests/test_architectures.py`` fails when the
committed table was made from other sources than the code under test. Regenerate it with ``make architectures``:

    PYTHONPATH=src python benchmarks/architectures.py [--types llama gpt2 …] [--jobs 2] [--timeout 120]

``--types`` alone writes to a temporary folder (printed at the end); ``--types … --merge`` updates the committed table.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection, wait
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402
from _common import DOCS, RESULTS, run_metadata, write_result  # noqa: E402

from sinklab.atomic import write_text  # noqa: E402
from sinklab.testing import conformance  # noqa: E402
from sinklab.testing.conformance import CELLS, STATUSES, Cell, crash_text, run_row  # noqa: E402

DEFAULT_JSON = RESULTS / "architectures.json"
DEFAULT_DOCS = DOCS / "architectures.md"
#: The vision-language sweep's JSON (``benchmarks/vlm_architectures.py``): its rows share this page and its columns.
VLM_JSON = RESULTS / "vlm_architectures.json"


# ----------------------------------------------------------------------------- many types, one process each
def _quiet() -> None:
    """Silence transformers' logging and Python warnings in a worker; one intra-op thread (``--jobs`` share the cores)."""
    transformers.logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)


def _child(name: str, conn: Connection) -> None:
    """Worker process: run row ``name``, sending each step's result to the parent as it happens."""
    _quiet()
    try:
        row = run_row(name, report=conn.send)
        conn.send(("done", row["seconds"]))
    except Exception as exc:  # noqa: BLE001 - a bug of this script, not of the model or sinklab: say so
        conn.send(("harness", crash_text(exc)))
    finally:
        conn.close()


def _pending_row(name: str) -> dict:
    return {"type": name, "model_type": conformance.configuration(name).type.removesuffix("@base"), "built": False,
            "cells": {}}


def _finish(row: dict, why: str) -> dict:
    """Mark what a dead or timed-out worker left unreported: not built, or the remaining cells crashed."""
    if "not_built" not in row and not row.get("built"):
        row["not_built"] = f"the worker {why} while building"
        return row
    for cell in CELLS:
        row["cells"].setdefault(cell, asdict(Cell("crash", f"the worker {why} during this cell")))
    return row


def _apply(row: dict, message: tuple) -> None:
    if message[0] == "built":
        row.update(message[1])
    elif message[0] == "cell":
        row["cells"][message[1]] = message[2]
    elif message[0] == "done":
        row["seconds"] = message[1]
    elif message[0] == "harness":
        row["harness_error"] = message[1]
        _finish(row, f"hit an error of this script ({message[1]})")


#: Modules the fork server imports once (every worker starts with them): importing transformers' model machinery
#: takes longer than a tiny model's cells.
PRELOAD = ("__main__", "transformers.modeling_utils", "transformers.generation.utils", "transformers.masking_utils",
           "transformers.activations", "transformers.integrations.hub_kernels", "tokenizers", "sinklab",
           "sinklab.stream", "sinklab.circuit", "sinklab.diagnose", "sinklab.testing.conformance")


def run_matrix(names: list[str], jobs: int = 2, timeout: float = 120.0,
               progress: Callable[[dict, int, int], None] | None = None) -> list[dict]:
    """Run every row in its own process forked from a server that imported torch, transformers and sinklab once;
    ``jobs`` at a time, each killed after ``timeout`` seconds. Returns the rows in ``names`` order."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    todo = list(names)
    running: dict[Connection, tuple[str, mp.Process, float, dict]] = {}
    rows: dict[str, dict] = {}

    def close(conn: Connection, why: str | None) -> None:
        name, proc, start, row = running.pop(conn)
        if why is not None:
            proc.kill()
            _finish(row, why)
        proc.join(5)
        if proc.exitcode not in (0, None) and why is None and "seconds" not in row:
            _finish(row, f"died (exit code {proc.exitcode})")
        row["seconds"] = row.get("seconds", round(time.perf_counter() - start, 2))
        row["wall_seconds"] = round(time.perf_counter() - start, 2)
        rows[name] = row
        conn.close()
        if progress is not None:
            progress(row, len(rows), len(names))

    while todo or running:
        while todo and len(running) < jobs:
            name = todo.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(name, child), daemon=True)
            proc.start()
            child.close()
            running[parent] = (name, proc, time.perf_counter(), _pending_row(name))
        now = time.perf_counter()
        deadline = min(start + timeout for _, _, start, _ in running.values())
        for conn in wait(list(running), timeout=max(0.0, deadline - now)):
            try:
                while conn.poll():
                    _apply(running[conn][3], conn.recv())
            except (EOFError, OSError):
                close(conn, None if "seconds" in running[conn][3] else "died")
        for conn, (_name, _proc, start, _row) in list(running.items()):
            if time.perf_counter() - start > timeout:
                close(conn, f"was killed after the {timeout:.0f} s timeout")
    return [rows[n] for n in names]


# ----------------------------------------------------------------------------- summary, JSON, Markdown
def status_of(row: dict, cell: str) -> str:
    """A row's status in one cell (``not built`` when the model was not built)."""
    if not row.get("built"):
        return "not built"
    return row["cells"].get(cell, {}).get("status", "crash")


def counts(rows: list[dict]) -> dict[str, dict[str, int]]:
    """``{cell: {status: rows}}`` over the built rows."""
    return {cell: {s: sum(status_of(r, cell) == s for r in rows) for s in STATUSES} for cell in CELLS}


def summary_table(rows: list[dict]) -> str:
    """The counts as a Markdown table (also printed at the end of a run)."""
    table = counts(rows)
    built = sum(bool(r.get("built")) for r in rows)
    lines = [f"{len(rows)} types, {built} built, {len(rows) - built} not built", "",
             "| cell | " + " | ".join(STATUSES) + " |", "|---" * (len(STATUSES) + 1) + "|"]
    for cell in CELLS:
        lines.append(f"| {cell} | " + " | ".join(str(table[cell][s]) for s in STATUSES) + " |")
    return "\n".join(lines)


def shorten(text: str, limit: int = 110) -> str:
    """One line of at most ``limit`` characters (Markdown table safe)."""
    text = " ".join(text.replace("|", "/").split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _cell_md(row: dict, cell: str) -> str:
    if not row.get("built"):
        return "—"
    c = row["cells"].get(cell, {"status": "crash", "message": "no result"})
    return c["status"] if not c.get("message") or c["status"] == "ok" else f"{c['status']}: {shorten(c['message'])}"


def _types_table(rows: list[dict]) -> list[str]:
    out = ["| type | " + " | ".join(CELLS) + " |", "|---" * (len(CELLS) + 1) + "|"]
    for row in rows:
        if row.get("built"):
            out.append(f"| {row['type']} | " + " | ".join(_cell_md(row, c) for c in CELLS) + " |")
        else:
            out.append(f"| {row['type']} | not built: {shorten(row.get('not_built', '?'), 160)} |"
                       + " |" * (len(CELLS) - 1))
    return out


def vlm_rows(rows: list[dict]) -> list[dict]:
    """The vision-language sweep's rows in this matrix's shape: the scan's status is the row's own, the cells after
    it are the row's ``stream`` … ``circuit``."""
    out = []
    for r in rows:
        if r["status"] == "not built":
            out.append({"type": r["type"], "built": False, "not_built": r.get("detail", "")})
            continue
        cells = {"scan": {"status": r["status"], "message": r.get("detail", "")}}
        for cell in CELLS[1:]:
            got = r.get(cell, {"status": "crash", "detail": "no result"})
            cells[cell] = {"status": got["status"], "message": got["detail"]}
        out.append({"type": r["type"], "built": True, "cells": cells})
    return out


def vlm_section(data: dict) -> list[str]:
    """The page's section on the vision-language sweep: the same columns, each with an image, its counts and types."""
    rows, meta = vlm_rows(data["rows"]), data["meta"]
    return [
        "## Vision-language models",
        "",
        "Every image-text-to-text model type of transformers " + str(meta["transformers"]) + " (its "
        "`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), built as a tiny random model from its own default config "
        "(text and vision sizes shrunk, multimodal token ids moved into the tiny vocabulary; "
        "`sinklab.testing.vlm_conformance`), with one drawn image and a short text. The same columns, each with the "
        "image:",
        "",
        "* **scan** — `sinklab.scan.scan_images`: the language model's attention maps against the eager twin's "
        "`output_attentions` on every decoder layer, and the per-modality statistics (text and image sink strength, "
        "the share of text→image attention on visual sink tokens) against a float64 loop over those weights "
        "(≤ 1e-4). The vision tower runs on its own attention (`sinklab scan --vision-tower` scans it).",
        "* **stream** — the prompt, image and all, through a `StreamSession` (nothing evicted) against the model's "
        "own forward with the image (≤ 1e-4 relative) and its own `generate()` (the same 4 greedy tokens).",
        "* **stream_evicted** — the image pinned and a window of 5 text tokens: the logits of the prompt and 6 "
        "decoded tokens against the float64 stream reference over the kept tokens, fed the embeddings the model's "
        "own forward hands its decoder (an M-RoPE model's tokens at their slot plus their offset in its own layout "
        "of the whole prompt; Qwen3-VL's deepstack additions too), and the image kept at every step.",
        "* **diagnose** — `sinklab.diagnose.diagnose_images`, one edited layer: it serialises, its causal edits are "
        "finite and its scan is split by modality.",
        "* **circuit** — `sinklab.circuit.circuit_images`: the three first-token conditions and the causal patches, "
        "every forward with the pixels; it serialises.",
        "",
        f"Made by `PYTHONPATH=src python benchmarks/vlm_architectures.py --jobs 2` in "
        f"{float(meta.get('wall_seconds', 0)) / 60:.1f} min ({str(meta.get('timestamp', ''))[:10]}). The JSON with "
        "every message in full: `benchmarks/results/vlm_architectures.json`.",
        "",
        f"Vision-language source fingerprint: `{meta['source']['fingerprint']}` — SHA-256 over the "
        f"{meta['source']['files']} sinklab source files the sweep exercises (from "
        "`sinklab.testing.vlm_conformance`); `tests/test_vlm.py` fails when the code under test has another.",
        "",
        "### Vision-language counts",
        "",
        summary_table(rows),
        "",
        "### Vision-language types",
        "",
        *_types_table(rows),
    ]


def write_page(causal: Path = DEFAULT_JSON, vlm: Path = VLM_JSON, docs: Path = DEFAULT_DOCS) -> Path:
    """Write the one page of both sweeps from their JSON files (the vision-language section where its JSON exists)."""
    data = json.loads(causal.read_text())
    vlm_data = json.loads(vlm.read_text()) if vlm.exists() else None
    write_text(docs, render_markdown(data["rows"], data["meta"], vlm_data))
    return docs


def render_markdown(rows: list[dict], meta: dict, vlm: dict | None = None) -> str:
    """``docs/architectures.md``: what each column checks and against what, how it was made (with the source
    fingerprint the suite checks), the counts, one row per type, then the extra configurations; then ``vlm`` (the
    vision-language sweep's JSON) in the same columns."""
    versions = meta["versions"]
    source = meta["source"]
    extra = {c.name: c for c in conformance.CONFIGURATIONS}
    types = [r for r in rows if r["type"] not in extra]
    configs = [r for r in rows if r["type"] in extra]
    out = [
        "# Architecture matrix",
        "",
        "Every causal-LM model type of transformers " + versions["transformers"] + " (its "
        "`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), plus a few encoder and vision families as their base models "
        "(`<type>@base`), built as a **tiny random model** from the type's own default config with every size "
        "shrunk by name (width 64, 2 layers, 4 heads, 2 KV heads, head width 16, vocabulary 128, 4 experts with "
        "top-2, small MLA ranks, per-layer lists cut to the kept layers — one local and one global layer where the "
        "model mixes them, one recurrent and one attention layer for a hybrid, whose pattern is set where the "
        "default config has no attention layer (Bamba, Granite MoE hybrid); no weights downloaded), float32, SDPA "
        "attention where the model has it (else eager), seeded; then [other configurations](#configurations) of "
        "some types (other layer counts, mixed layer kinds). Random weights: this checks that sinklab runs and "
        "computes the right numbers on each architecture, not what sinks a trained model has. The models come from "
        "`sinklab.testing.tiny.build`, the cells from `sinklab.testing.conformance` — the same code the test "
        "suite's slice of this matrix (`tests/test_architectures.py`) runs." + (
            " Every image-text-to-text type follows in the same columns, each with an image: "
            "[vision-language models](#vision-language-models)." if vlm is not None else ""),
        "",
        "Columns (each cell: `ok`, `refused` — sinklab's `UnsupportedModelError`/`InputError`, with the message a "
        "user sees —, `crash` — any other exception, with its last frame —, `wrong` — a measured error past the "
        "tolerance —, or `n/a`):",
        "",
        "* **scan** — `sinklab.scan` on two 32-token windows (a character-level tokenizer); sample 0's attention "
        "maps against the model's own eager attention weights (`output_attentions=True`) on the same tokens, max "
        "abs difference ≤ 1e-4 (where the model returns no weights: every row sums to 1 − its learned sink mass).",
        "* **stream** — `SinkCache(model, num_sinks=4, window=64)` passed to the model's own `generate` (16-token "
        "prompt, 8 greedy tokens, nothing evicted; a model's own sliding window is set to 8 tokens so it is "
        "exercised) against `generate` with the model's default cache: the same tokens and first-step logits "
        "within 1e-4 relative.",
        "* **stream_evicted** — a one-layer variant (its own sliding window widened to 64 tokens, so the check is the "
        "sinks + window rule) streamed with `SinkCache(num_sinks=4, window=8)`: a 40-token chunk, then 20 tokens one "
        "by one; at every position, the logits against a plain forward (the model's own attention, no cache) over "
        "exactly the kept tokens — the first 4 and the 8 most recent — at positions 0 … n−1. With one layer a kept "
        "key depends only on its token and its position, so the reference is exact: ≤ 1e-4 relative in float32, "
        "and again in float64 ≤ 1e-6 (transformers computes rotary tables in float32 even for a float64 model). "
        "n/a where the one block caches several attention layers (one reads another's output, so the reference is "
        "no longer exact) or where a one-layer model cannot be built. A hybrid (recurrent layers between attention "
        "layers: their state has seen every token, so the plain forward is no reference) is checked on its "
        "own model, token by token, against the float64 stream reference (`sinklab.testing.reference`: the "
        "model's own cache for the recurrent layers, the kept keys re-rotated to their slot positions by the "
        "model's own rotary code), ≤ 1e-6; the cell also says how far eviction itself moves the logits, so a "
        "check that eviction does not affect shows as such.",
        "* **diagnose** — `sinklab.diagnose` on the same windows with one edited layer and sample; the diagnosis "
        "serialises and its causal edits are finite (random weights rarely sink, so usually nothing is edited).",
        "* **circuit** — `sinklab.circuit` on the same windows, one causal and one condition sample; it serialises.",
        "",
        "`not built` rows are types whose tiny model could not be made or run by transformers itself (a vision tower "
        "needing `timm`, a default config that does not validate, …) — that is not sinklab refusing them.",
        "",
        f"Made by `{meta['command_line']}` on {meta['machine']['cpus']} CPUs in {meta['wall_seconds'] / 60:.1f} min "
        f"({meta['timestamp'][:10]}; torch {versions['torch']}, transformers {versions['transformers']}, sinklab "
        f"{versions['sinklab']} at {meta['git']}). "
        "The JSON with every message in full: `benchmarks/results/architectures.json`.",
        "",
        f"Source fingerprint: `{source['fingerprint']}` — SHA-256 over the {source['files']} sinklab source files the "
        "cells exercise (`sinklab.testing.conformance.source_files`: the conformance module and every sinklab "
        "module it imports, directly or not). `tests/test_architectures.py` recomputes it and fails when this table "
        "was made from other sources; regenerate it with `make architectures`.",
        "",
        "## Counts",
        "",
        summary_table(types),
        "",
        "## Types",
        "",
        *_types_table(types),
        "",
        "## Configurations",
        "",
        "Other configurations of some types (`sinklab.testing.conformance.CONFIGURATIONS`), each with what it "
        "exercises that the type's default row does not; the same cells.",
        "",
        "| configuration | what it exercises |",
        "|---|---|",
        *[f"| {c.name} | {c.why} |" for c in conformance.CONFIGURATIONS],
        "",
        *_types_table(configs),
        *(["", *vlm_section(vlm)] if vlm is not None else []),
    ]
    return "\n".join(out) + "\n"


def failures(rows: list[dict]) -> str:
    """Every crash and wrong cell, then every type not built, one line each (for the end of a run)."""
    lines = []
    for status in ("crash", "wrong"):
        for cell in CELLS:
            hits = [r for r in rows if status_of(r, cell) == status]
            if hits:
                lines.append(f"{status} in {cell} ({len(hits)}):")
                lines += [f"  {r['type']}: {r['cells'][cell]['message']}" for r in hits]
    missing = [r for r in rows if not r.get("built")]
    if missing:
        lines.append(f"not built ({len(missing)}):")
        lines += [f"  {r['type']}: {r.get('not_built')}" for r in missing]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", help="types to run (default: all), with their extra configurations; "
                                                   "e.g. llama gpt2 bert@base")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes at a time")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per row before its worker is killed")
    parser.add_argument("--json", type=Path, default=None,
                        help=f"where the JSON goes (default: {DEFAULT_JSON.relative_to(RESULTS.parent.parent)} for the whole matrix or "
                             "--merge; a temporary folder for --types alone, so a look at a few types never "
                             "replaces the committed table)")
    parser.add_argument("--docs", type=Path, default=None, help="where the Markdown page goes (same defaults)")
    parser.add_argument("--merge", action="store_true",
                        help="with --types: replace those rows in the existing --json and keep the others")
    parser.add_argument("--page-only", action="store_true",
                        help="only write the page again from the committed JSON files of both sweeps")
    args = parser.parse_args(argv)
    if args.page_only:
        print(f"wrote {write_page()}")
        return 0
    scratch = Path(tempfile.mkdtemp(prefix="sinklab-architectures-")) if args.types and not args.merge else None
    args.json = args.json or (scratch / "architectures.json" if scratch else DEFAULT_JSON)
    args.docs = args.docs or (scratch / "architectures.md" if scratch else DEFAULT_DOCS)
    names = conformance.row_names()
    if args.types:
        known = {conformance.configuration(n).type for n in names}
        unknown = sorted(set(args.types) - known)
        if unknown:
            parser.error(f"unknown types {unknown}")
        names = conformance.row_names(args.types)

    def progress(row: dict, done: int, total: int) -> None:
        cells = "  ".join(f"{c}={status_of(row, c)}" for c in CELLS) if row.get("built") else \
            f"not built: {shorten(row.get('not_built', ''), 90)}"
        print(f"[{done:3d}/{total}] {row['type']:<26s} {row.get('wall_seconds', 0):6.1f}s  {cells}", flush=True)

    t0 = time.perf_counter()
    rows = run_matrix(names, jobs=args.jobs, timeout=args.timeout, progress=progress)
    files = conformance.source_files()
    meta = run_metadata([sys.argv[0], *argv], wall_seconds=time.perf_counter() - t0,
                        source={"fingerprint": conformance.source_fingerprint(), "files": len(files)})
    if args.merge and args.json.exists():
        old = json.loads(args.json.read_text())
        fresh = {row["type"] for row in rows}
        order = {name: i for i, name in enumerate(conformance.row_names())}
        rows = sorted([r for r in old["rows"] if r["type"] not in fresh] + rows,
                      key=lambda r: order.get(r["type"], len(order)))
        if old["meta"].get("source") != meta["source"]:
            print("note: the kept rows were made from other sources; the table records the new fingerprint only "
                  "once every row is rerun", file=sys.stderr)
            meta["source"] = {**meta["source"], "fingerprint": "mixed (a --merge over other sources)"}
        meta = {**old["meta"], "merged": meta, "source": meta["source"]}
    write_result(args.json, {"meta": meta, "counts": counts(rows), "rows": rows}, quiet=True)
    write_page(args.json, VLM_JSON, args.docs)
    print()
    print(summary_table(rows))
    print()
    print(failures(rows))
    print(f"\nwall time {time.perf_counter() - t0:.0f} s; wrote {args.json} and {args.docs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
