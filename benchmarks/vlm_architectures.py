"""The vision-language sweep: every image-text-to-text model type transformers registers, as a tiny random model,
scanned on one drawn image and a short text and checked against its own eager attention weights.

A thin command line over :mod:`sinklab.testing.vlm_conformance` (what the cell checks is written there). Each type
runs in its own forked process with a timeout, ``--jobs`` at a time. Writes ``benchmarks/results/vlm_architectures.json``
and ``docs/vlm_architectures.md``:

    PYTHONPATH=src python benchmarks/vlm_architectures.py [--types llava qwen2_vl …] [--jobs 2] [--timeout 120]

``--types`` alone writes to a temporary folder (printed at the end); ``--types … --merge`` updates the committed table.
"""

from __future__ import annotations

import argparse
import html
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

from sinklab.atomic import write_text  # noqa: E402
from sinklab.testing.conformance import crash_text, source_files, source_fingerprint  # noqa: E402
from sinklab.testing.vlm_conformance import STATUSES, all_types, run_row  # noqa: E402

DEFAULT_JSON = RESULTS / "vlm_architectures.json"
#: The module whose sinklab imports (followed) the sweep's fingerprint covers.
ROOT_MODULE = "sinklab.testing.vlm_conformance"
DEFAULT_DOCS = DOCS / "vlm_architectures.md"


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


#: The stream columns: (row key, heading).
STREAM_COLUMNS = (("stream", "stream"), ("stream_evicted", "past eviction"))


def counts(rows: list[dict]) -> dict:
    built = [r for r in rows if r["status"] != "not built"]
    out: dict = {"types": len(rows), "built": len(built), **{s: sum(r["status"] == s for r in rows) for s in STATUSES}}
    for key, _ in STREAM_COLUMNS:
        cells = [r[key]["status"] for r in built if key in r]
        out[key] = {s: cells.count(s) for s in STATUSES if s != "not built"}
    return out


def _stream_line(c: dict) -> str:
    parts = []
    for key, heading in STREAM_COLUMNS:
        k = c[key]
        parts.append(f"{heading}: {k['ok']} ok, {k['wrong']} wrong, {k['crash']} crash, {k['refused']} refused, "
                     f"{k['n/a']} n/a")
    return "**Streams — " + "; ".join(parts) + ".**"


def markdown(rows: list[dict], meta: dict) -> str:
    c = counts(rows)
    lines = [
        "# Vision-language models: the sweep",
        "",
        "Every image-text-to-text model type of transformers "
        f"{html.escape(str(meta['transformers']))} (`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`), built as a tiny "
        "random model from its own default config (text and vision sizes shrunk, multimodal token ids moved into the "
        "tiny vocabulary), scanned by `sinklab.scan.scan_images` on one drawn image and a short text. `ok`: the "
        "language model's attention maps match the eager twin's `output_attentions` on every decoder layer, and the "
        "per-modality statistics (text and image sink strength, the share of text→image attention on visual sink "
        "tokens) match a float64 loop over those weights. The vision tower is not scanned (it runs on its own "
        "attention). `stream`: the prompt, image and all, through a `StreamSession` (nothing evicted) equals the "
        "model's own forward with the image and its `generate()`; `past eviction`: the image pinned and a window of "
        "5 text tokens, the logits of the prompt and 6 decoded tokens equal the float64 stream reference over the "
        "kept tokens and the image is kept at every step (`sinklab.testing.vlm_conformance`). Regenerate: "
        "`make architectures` (with the causal-LM matrix) or `PYTHONPATH=src python benchmarks/vlm_architectures.py "
        "--jobs 2`.",
        "",
        f"Source fingerprint: `{meta['source']['fingerprint']}` — SHA-256 over the {meta['source']['files']} sinklab "
        "source files the sweep exercises; `tests/test_vlm.py` fails when the code under test has another.",
        "",
        f"**{c['types']} types: {c['built']} built, {c['ok']} ok, {c['wrong']} wrong, {c['crash']} crash, "
        f"{c['refused']} refused, {c['n/a']} n/a, {c['not built']} not built.**",
        "",
        _stream_line(c),
        "",
        "| type | status | stream | past eviction | detail |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        details = [str(r.get("detail", ""))] + [f"{heading}: {r[key]['detail']}" for key, heading in STREAM_COLUMNS
                                                if key in r and r[key]["status"] != "ok"]
        detail = " ".join(" — ".join(details).split()).replace("|", "\\|")
        streams = " | ".join(r[key]["status"] if key in r else "—" for key, _ in STREAM_COLUMNS)
        lines.append(f"| `{html.escape(r['type'])}` | {r['status']} | {streams} | {html.escape(detail)} |")
    return "\n".join(lines) + "\n"


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
        out_json, out_docs = folder / "vlm_architectures.json", folder / "vlm_architectures.md"
    meta = run_metadata(wall_seconds=round(time.monotonic() - t0, 1), transformers=transformers.__version__,
                        source=source)
    write_result(out_json, {"meta": meta, "counts": counts(rows), "rows": rows})
    write_text(out_docs, markdown(rows, meta))
    print(f"wrote {out_docs}")
    print(json.dumps(counts(rows)))


if __name__ == "__main__":
    main()
