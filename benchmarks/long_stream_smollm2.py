"""Documented run (not a test): StreamingLLM on SmolLM2-135M over a long text, every method on the same positions.

Two experiments on Python's own pydoc topics (``sinklab.texts.default_texts``), ``builtin:smollm2``
(SmolLM2-135M-Instruct, Q4_1 GGUF dequantised to float32; its tokenizer adds no BOS token, so the sinks
are the text's first ordinary tokens):

* ``compare`` — dense / window / recompute / sinks and the sink-count ablation (S = 0, 1, 2, 4, 8 at equal
  cache size C = S + W) over the same scored positions (strided: recompute is O(C) per token);
* ``long`` — the paper's headline: a stream well past SmolLM2's 8,192 trained positions, dense attention
  beside sinks + window and window-only, every position scored.

Each writes ``benchmarks/results/<name>_smollm2.json`` (the eval-stream JSON plus timing and machine notes),
the figures beside it, and a small copy of the figure into ``docs/img/``.

    python benchmarks/long_stream_smollm2.py compare [--tokens 4096] [--cache 1024] [--stride 16]
    python benchmarks/long_stream_smollm2.py long [--tokens 20000] [--cache 1024]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch
from sinklab.atomic import write_json
from sinklab.report.figures import save_png

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
DOCS_IMG = ROOT / "docs" / "img"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("experiment", choices=("compare", "long", "merge"))
    ap.add_argument("--tag", default=None, help="suffix of the output name (run methods in separate processes, "
                                                "then `merge --tag long` joins long_smollm2.*.json)")
    ap.add_argument("--tokens", type=int, default=None, help="default: 4096 (compare) / 20000 (long)")
    ap.add_argument("--cache", type=int, default=1024, help="total cache size C = S + W")
    ap.add_argument("--stride", type=int, default=None, help="default: 16 (compare) / 1 (long)")
    ap.add_argument("--methods", default=None, help="default: all four (compare) / dense,window,sinks (long)")
    ap.add_argument("--sinks", default=None, help="default: 0,1,2,4,8 (compare) / 4 (long)")
    ap.add_argument("--chunk-size", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.experiment == "merge":
        return merge(args.tag or "long")

    import sinklab
    from sinklab.evaluation.stream import EvalPlan, evaluate_stream
    from sinklab.texts import default_texts

    compare = args.experiment == "compare"
    tokens = args.tokens or (4096 if compare else 20000)
    methods = args.methods or ("dense,window,recompute,sinks" if compare else "dense,window,sinks")
    sinks = args.sinks or ("0,1,2,4,8" if compare else "4")
    plan = EvalPlan(methods=methods.split(","), sinks=[int(s) for s in sinks.split(",")], cache_size=args.cache,
                    stride=args.stride or (16 if compare else 1), chunk_size=args.chunk_size)

    t0 = time.perf_counter()
    loaded = sinklab.load_model("builtin:smollm2")
    load_s = time.perf_counter() - t0
    text = "\n\n".join(default_texts())
    ids = torch.tensor(loaded.tokenizer(text[: tokens * 12], verbose=False)["input_ids"][:tokens])
    if ids.numel() < tokens:
        sys.exit(f"the text gave only {ids.numel()} tokens")
    total = plan.work(ids.numel())
    print(f"SmolLM2: {ids.numel()} tokens, cache {plan.cache_size}, {total} tokens to encode", flush=True)

    done = {"n": 0, "label": None, "t": time.perf_counter()}

    def progress(label: str, n: int) -> None:
        done["n"] += n
        if label != done["label"] or time.perf_counter() - done["t"] > 60:
            print(f"  [{time.strftime('%H:%M:%S')}] {label}: {done['n']}/{total}", flush=True)
            done["label"], done["t"] = label, time.perf_counter()

    t0 = time.perf_counter()
    result = evaluate_stream(loaded.model, ids, plan, progress=progress)
    wall = time.perf_counter() - t0
    result.meta = {
        "model": "builtin:smollm2", "notes": loaded.notes, "text": "pydoc topics (sinklab.texts.default_texts)",
        "first_token": loaded.tokenizer.convert_ids_to_tokens(int(ids[0])), "load_seconds": load_s,
        "wall_seconds": wall, "threads": args.threads, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs "
        "(shared with other jobs: timings are indicative)", "torch": torch.__version__,
        "command": " ".join(sys.argv),
    }
    data = result.to_json()
    name = f"{args.experiment}_smollm2" + (f".{args.tag}" if args.tag else "")
    RESULTS.mkdir(exist_ok=True)
    write_json((RESULTS / f"{name}.json"), data)
    if not args.tag:
        publish(data, name)
    print(f"wall {wall:.0f} s (load {load_s:.0f} s); wrote {RESULTS / name}.json")


def publish(data: dict, name: str) -> None:
    """Figures into results/ and (small) docs/img/, the split at the trained length, and the printed table."""
    from sinklab.report.stream_figures import TABLE_HEADER, eval_stream_figures, table_rows
    from sinklab.evaluation.stream import binned_nll

    pos = torch.tensor(data["scored_positions"])
    for c in data["curves"].values():  # one bin per 8 scored tokens (at most 48), also for merged runs
        centres, means = binned_nll(pos, torch.tensor(c["nll"]), min(48, max(1, len(pos) // 8)))
        c["binned"] = {"position": centres, "mean_nll": means}
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    for stem, fig in eval_stream_figures(data).items():
        save_png(fig, RESULTS / f"{name}_{stem}.png", dpi=110)
        save_png(fig, DOCS_IMG / f"{name}_{stem}.png", dpi=80)
    _before_after(data, RESULTS / f"{name}.json")
    widths = [max(len(h), *(len(r[i]) for r in table_rows(data))) for i, h in enumerate(TABLE_HEADER)]
    print(f"\n{data['num_tokens']} tokens, C = {data['cache_size']}, positions {data['positions']}")
    print(" | ".join(h.rjust(w) for h, w in zip(TABLE_HEADER, widths)))
    for row in table_rows(data):
        print(" | ".join(x.rjust(w) for x, w in zip(row, widths)))


def merge(experiment: str) -> None:
    """Join ``<experiment>_smollm2.<tag>.json`` runs (same text, cache and positions) into one result."""
    parts = sorted(RESULTS.glob(f"{experiment}_smollm2.*.json"))
    if not parts:
        sys.exit(f"no {experiment}_smollm2.*.json in {RESULTS}")
    runs = [json.loads(p.read_text()) for p in parts]
    data = runs[0]
    for other in runs[1:]:
        if other["scored_positions"] != data["scored_positions"] or other["cache_size"] != data["cache_size"]:
            sys.exit(f"cannot merge runs scored on different positions or caches: {[p.name for p in parts]}")
        data["curves"].update(other["curves"])
        data["methods"] = [m for m in ("dense", "window", "recompute", "sinks")
                           if m in set(data["methods"]) | set(other["methods"])]
    if "window" in data["curves"] and "sinks S=0" not in data["curves"] and any(
            c["method"] == "sinks" for c in data["curves"].values()):  # S = 0 is the window-only run
        data["curves"]["sinks S=0"] = dict(data["curves"]["window"], method="sinks", same_as="window")
        data["sinks"] = sorted({0, *data["sinks"]})
    data["merged_from"] = {p.name: {"wall_seconds": r.get("wall_seconds"), "command": r.get("command")}
                           for p, r in zip(parts, runs)}
    order = ["dense", "window", "recompute"]
    def rank(label: str) -> tuple:
        c = data["curves"][label]
        return (order.index(label), 0) if label in order else (len(order), c["num_sinks"])

    data["curves"] = dict(sorted(data["curves"].items(), key=lambda kv: rank(kv[0])))
    name = f"{experiment}_smollm2"
    write_json((RESULTS / f"{name}.json"), data)
    publish(data, name)
    print(f"merged {[p.name for p in parts]} into {RESULTS / name}.json")


def _before_after(data: dict, path: Path) -> None:
    """Mean NLL of each method before and after the model's trained positions (printed and stored)."""
    trained = data.get("trained_positions")
    if not trained:
        return
    pos = torch.tensor(data["scored_positions"])
    split = {}
    for label, c in data["curves"].items():
        nll = torch.tensor(c["nll"], dtype=torch.float64)
        segs = {"≤ trained": pos <= trained, "> trained": pos > trained}
        split[label] = {k: (float(nll[m].mean()) if m.any() else None) for k, m in segs.items()}
    data["split_at_trained_positions"] = split
    write_json(path, data)
    print(f"mean NLL before / after position {trained}:")
    for label, s in split.items():
        print(f"  {label:>10}: {s['≤ trained']:.3f} / " + ("–" if s["> trained"] is None else f"{s['> trained']:.3f}"))


if __name__ == "__main__":
    main()
