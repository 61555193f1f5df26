"""Recall and perplexity at equal KV budgets: sinklab's retention policies against kvpress's presses.

    python benchmarks/retention.py                       # both real models, the default grid
    python benchmarks/retention.py --models builtin:smollm2 --contexts 1024 --samples 2 --no-kvpress
    python benchmarks/retention.py --table               # print the table of what is measured so far

Tasks, generated here from the Python documentation's own prose as filler (no dataset download), in the style of
RULER (Hsieh et al., 2024): ``needle`` (one "special magic number" sentence at a random depth), ``multikey`` (four
such sentences with different keys, one asked for) and ``vartrack`` (a chain of variable assignments scattered
through the text, the last variable asked for); ``ppl``: perplexity of the 128 tokens that follow a context of
real text. Each prompt is a context (compressed) followed by a question; an answer is right when the greedy
continuation (10 tokens) contains the number.

Methods at equal KV budgets (``kv_fraction`` of the context's tokens, per key-value head):

* ``dense`` — the whole context;
* sinklab (``SinkCache(model, policy=…)``): ``streaming``, ``snapkv``, ``tova``, ``knorm`` and ``auto`` (per-head
  budgets from a scan of the model, :mod:`sinklab.stream.plan`) — the budget holds at every step, the question and
  the answer included;
* kvpress 0.5.5 (transformers 5.2.0, in a throwaway virtualenv: ``benchmarks/_kvpress_env.py``) — its presses
  compress the context once, at prefill; the question and the answer are then appended uncompressed (so they hold
  up to ~40 tokens more than the budget).

Every measured cell is one row of ``benchmarks/results/retention.json``: ``{model, method, source, kv_fraction,
task, context, accuracy, ppl, n}``. Rows are appended as they are measured (``--resume`` skips cells already
there), so a long run can be stopped and taken up again.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

from sinklab.stream.policy import policy_names
from sinklab.atomic import write_json
from sinklab.report.figures import save_png

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = RESULTS / "retention.json"
SINKLAB_METHODS = tuple(policy_names())  # every policy in sinklab.stream.policy.POLICIES, then "auto"
KVPRESS_METHODS = ("streaming", "snapkv", "tova", "knorm", "expected_attention")
TASKS = ("needle", "multikey", "vartrack", "ppl")
ANSWER_TOKENS = 10
PPL_TOKENS = 128
NUM_SINKS = 4
WORDS = ("amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp",
         "lumen", "marble", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra")


# ----------------------------------------------------------------------------- tasks
def _filler_ids(tokenizer) -> list[int]:
    from sinklab.texts import default_texts

    return tokenizer(" ".join(default_texts()), add_special_tokens=False)["input_ids"]


def _boundary(tokenizer, ids: list[int], at: int) -> int:
    """The first token boundary at or after ``at`` that follows a sentence's full stop (within 80 tokens)."""
    for i in range(at, min(len(ids), at + 80)):
        if tokenizer.decode(ids[i - 1:i]).rstrip().endswith("."):
            return i
    return at


def make_item(tokenizer, filler: list[int], task: str, context: int, seed: int) -> dict:
    """One prompt: ``context_ids`` (``context`` tokens, special prefix included), ``question_ids`` and the answer
    (or, for ``ppl``, ``continuation_ids``)."""
    from sinklab.texts import special_affixes

    rng = random.Random(f"{task}-{context}-{seed}")
    prefix = special_affixes(tokenizer)[0]
    enc = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    start = rng.randrange(0, len(filler) - context - PPL_TOKENS - 1)
    if task == "ppl":
        body = filler[start:start + context - len(prefix)]
        return {"context_ids": prefix + body, "continuation_ids": filler[start + len(body):start + len(body) + PPL_TOKENS]}
    if task == "needle":
        keys = [rng.choice(WORDS)]
        facts = [(keys[0], str(rng.randrange(1_000_000, 9_999_999)))]
        inserts = [f" The special magic number for {k} is {v}." for k, v in facts]
        asked = 0
    elif task == "multikey":
        keys = rng.sample(WORDS, 4)
        facts = [(k, str(rng.randrange(1_000_000, 9_999_999))) for k in keys]
        inserts = [f" The special magic number for {k} is {v}." for k, v in facts]
        asked = rng.randrange(4)
    else:  # vartrack: VAR A = 12345, VAR B = VAR A, … ; the last variable's value is asked for
        names = ["".join(rng.choice("ABCDEFGHJKLMNPQRSTUVWXYZ") for _ in range(5)) for _ in range(4)]
        value = str(rng.randrange(10_000, 99_999))
        inserts = [f" VAR {names[0]} = {value}."] + [f" VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        facts = [(names[-1], value)]
        asked = 0
    pieces = [enc(s) for s in inserts]
    n_body = context - len(prefix) - sum(len(p) for p in pieces)
    body = filler[start:start + n_body]
    depths = sorted(rng.uniform(0.1, 0.9) for _ in pieces) if task != "vartrack" else \
        [0.1 + 0.8 * i / len(pieces) + rng.uniform(0, 0.1) for i in range(len(pieces))]
    cuts = [_boundary(tokenizer, body, max(1, int(d * len(body)))) for d in depths]
    ids, last = list(prefix), 0
    order = sorted(range(len(pieces)), key=lambda i: cuts[i])
    for i in order:
        ids += body[last:cuts[i]] + pieces[i]
        last = cuts[i]
    ids += body[last:]
    key, value = facts[asked]
    if task == "vartrack":
        question = f"\n\nAnswer: following the chain of VAR assignments above, the value of VAR {key} is"
    else:
        question = f"\n\nAnswer: the special magic number for {key} is"
    return {"context_ids": ids[:context], "question_ids": enc(question), "answer": value}


# ----------------------------------------------------------------------------- sinklab
def _plan(model, tokenizer, budget: int, cache: dict):
    """The auto plan at a per-head budget of ``budget`` tokens, from one scan of the model (cached)."""
    from sinklab.scan import scan_inputs
    from sinklab.stream.plan import plan_from_scan
    from sinklab.texts import tokenize_windows, default_texts

    if "scan" not in cache:
        batch = tokenize_windows(tokenizer, default_texts(), 512, 8, seed=1)
        cache["scan"] = scan_inputs(model, [{"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}],
                                    batch.tokens, split=False)
    return plan_from_scan(model, cache["scan"], num_sinks=NUM_SINKS, window=budget - NUM_SINKS, recent=32)


@torch.no_grad()
def run_sinklab(model, item: dict, method: str, budget: int | None, plan=None) -> dict:
    from sinklab.stream import SinkCache

    if method == "dense":
        from transformers import DynamicCache

        cache, closing = DynamicCache(config=model.config), None
    elif method == "auto":
        cache = closing = SinkCache(model, policy="auto", plan=plan)
    else:
        cache = closing = SinkCache(model, num_sinks=NUM_SINKS, window=budget - NUM_SINKS, policy=method)
    try:
        ctx = torch.tensor([item["context_ids"]])
        out = model(input_ids=ctx, cache=cache, logits_to_keep=1)
        kept = _kept(cache)
        if "continuation_ids" in item:
            cont = torch.tensor([item["continuation_ids"]])
            logits = torch.cat([out.logits[:, -1:], model(input_ids=cont[:, :-1], cache=cache).logits], 1)
            nll = torch.nn.functional.cross_entropy(logits[0].double(), cont[0], reduction="sum")
            return {"nll": float(nll), "count": cont.shape[1], "kept_tokens": kept}
        out = model(input_ids=torch.tensor([item["question_ids"]]), cache=cache, logits_to_keep=1)
        generated = []
        for _ in range(ANSWER_TOKENS):
            tok = int(out.logits[0, -1].argmax())
            generated.append(tok)
            out = model(input_ids=torch.tensor([[tok]]), cache=cache, logits_to_keep=1)
        return {"generated_ids": generated, "kept_tokens": kept}
    finally:
        if closing is not None:
            closing.close()


def _kept(cache) -> float:
    """Mean KV entries per attention layer and key-value head after the context."""
    sizes = []
    for layer in cache.layers:
        if hasattr(layer, "kept_tokens"):
            sizes.append(float(layer.kept_tokens().float().mean()))
        elif hasattr(layer, "state") and getattr(layer.state, "s_valid", None) is not None:
            sizes.append(float(layer.state.s_valid.sum(1).float().mean()))
        elif isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() == 4:
            sizes.append(float(layer.keys.shape[2]))
    return sum(sizes) / max(1, len(sizes))


# ----------------------------------------------------------------------------- bookkeeping
def _load_rows() -> list[dict]:
    if OUT.exists():
        return json.loads(OUT.read_text()).get("rows", [])
    return []


def _load_meta() -> dict:
    """The results file's meta (a resumed run adds to it: the kvpress note of an earlier run stays)."""
    if OUT.exists():
        return json.loads(OUT.read_text()).get("meta", {})
    return {}


def _save(rows: list[dict], meta: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    write_json(OUT, {"meta": meta, "rows": rows})


def _cell_row(model: str, method: str, source: str, fraction: float, task: str, context: int,
              outcomes: list[dict], answers: list[str | None], tokenizer, seconds: float) -> dict:
    errors = [o["error"] for o in outcomes if "error" in o]
    ok = [(o, a) for o, a in zip(outcomes, answers) if "error" not in o]
    row = {"model": model, "method": method, "source": source, "kv_fraction": fraction, "task": task,
           "context": context, "accuracy": None, "ppl": None, "n": len(ok),
           "kept_tokens": round(sum(o["kept_tokens"] for o, _ in ok) / len(ok), 1) if ok else None,
           "seconds": round(seconds, 1)}
    if errors:
        row["error"] = errors[0][:300]
    if not ok:
        return row
    if task == "ppl":
        row["ppl"] = round(math.exp(sum(o["nll"] for o, _ in ok) / sum(o["count"] for o, _ in ok)), 3)
    else:
        hits = [a in tokenizer.decode(o["generated_ids"]) for o, a in ok]
        row["accuracy"] = round(sum(hits) / len(hits), 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="builtin:smollm2,builtin:gemma3")
    ap.add_argument("--contexts", default="1024,2048,4096")
    ap.add_argument("--fractions", default="0.25,0.125")
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--methods", default=",".join(("dense",) + SINKLAB_METHODS))
    ap.add_argument("--kvpress-methods", default=",".join(KVPRESS_METHODS))
    ap.add_argument("--no-kvpress", action="store_true")
    ap.add_argument("--resume", action="store_true", help="skip cells already in the results file")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--table", action="store_true", help="only print the table of the results file")
    ap.add_argument("--figure", type=Path, default=None, help="only draw the results file's figure into this PNG")
    args = ap.parse_args()
    if args.table:
        print_table(_load_rows())
        return
    if args.figure is not None:
        figure(_load_rows(), args.figure)
        return
    torch.set_num_threads(args.threads)
    from sinklab.models import load_model

    rows = _load_rows() if args.resume else []
    done = {(r["model"], r["method"], r["source"], r["kv_fraction"], r["task"], r["context"]) for r in rows}
    meta = _load_meta() if args.resume else {}
    meta |= {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, {args.threads} threads", "torch": torch.__version__,
            "python": platform.python_version(), "samples": args.samples, "answer_tokens": ANSWER_TOKENS,
            "ppl_tokens": PPL_TOKENS, "num_sinks": NUM_SINKS}
    import transformers

    meta["transformers"] = transformers.__version__
    kvpython = None
    if not args.no_kvpress:
        sys.path.insert(0, str(HERE))
        from _kvpress_env import kvpress_python

        kvpython, note = kvpress_python()
        meta["kvpress"] = note
        print(f"kvpress: {note}", flush=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    fractions = [float(f) for f in args.fractions.split(",")]
    tasks = args.tasks.split(",")
    methods = [m for m in args.methods.split(",") if m]
    for name in args.models.split(","):
        loaded = load_model(name)
        model, tok = loaded.model.eval(), loaded.tokenizer
        meta.setdefault("converted_folders", {})[name] = loaded.notes.get("converted_folder")
        filler = _filler_ids(tok)
        scans: dict = {}
        for context in contexts:
            for task in tasks:
                items = [make_item(tok, filler, task, context, s) for s in range(args.samples)]
                answers = [it.get("answer") for it in items]
                cells = [("dense", None)] + [(m, f) for m in methods if m != "dense" for f in fractions]
                for method, fraction in cells:
                    key = (name, method, "dense" if method == "dense" else "sinklab", fraction or 1.0, task, context)
                    if key in done:
                        continue
                    t0 = time.time()
                    budget = None if fraction is None else max(NUM_SINKS + 33, round(fraction * context))
                    plan = _plan(model, tok, budget, scans) if method == "auto" else None
                    outcomes = []
                    for it in items:
                        try:
                            outcomes.append(run_sinklab(model, it, method, budget, plan))
                        except Exception as exc:  # noqa: BLE001 - a method that cannot run is a row with its error
                            outcomes.append({"error": f"{type(exc).__name__}: {exc}"})
                    row = _cell_row(name, method, key[2], key[3], task, context, outcomes, answers, tok,
                                    time.time() - t0)
                    rows.append(row)
                    _save(rows, meta)
                    print(json.dumps(row), flush=True)
                if kvpython is not None:
                    _kvpress_cells(args, kvpython, loaded, name, task, context, items, answers, fractions, rows,
                                   done, meta, tok)
    print_table(rows)


def _kvpress_cells(args, python, loaded, name, task, context, items, answers, fractions, rows, done, meta,
                   tok) -> None:
    from _kvpress_env import run_worker

    presses = [{"method": m, "kv_fraction": f} for m in args.kvpress_methods.split(",") for f in fractions
               if (name, m, "kvpress", f, task, context) not in done]
    if not presses:
        return
    job_items = []
    for i, it in enumerate(items):
        entry = {"id": str(i), "context_ids": it["context_ids"]}
        if "continuation_ids" in it:
            entry.update(kind="ppl", continuation_ids=it["continuation_ids"])
        else:
            entry.update(kind="generate", question_ids=it["question_ids"], max_new_tokens=ANSWER_TOKENS)
        job_items.append(entry)
    t0 = time.time()
    out = run_worker(python, {"model_dir": loaded.notes["converted_folder"], "threads": args.threads,
                              "presses": presses, "items": job_items}, timeout=6 * 3600)
    seconds = (time.time() - t0) / len(presses)
    for press in presses:
        got = {r["id"]: r for r in out if r["method"] == press["method"] and r["kv_fraction"] == press["kv_fraction"]}
        outcomes = [got.get(str(i), {"error": "no result"}) for i in range(len(items))]
        for o in outcomes:  # the worker's names for the summed NLL and its count
            if "nll_sum" in o:
                o["nll"], o["count"] = o["nll_sum"], o["n_scored"]
        row = _cell_row(name, press["method"], "kvpress", press["kv_fraction"], task, context, outcomes, answers, tok,
                        seconds)
        rows.append(row)
        _save(rows, meta)
        print(json.dumps(row), flush=True)


def print_table(rows: list[dict]) -> None:
    """One table per model and task: methods down, (context, fraction) across; accuracy or perplexity."""
    for model in sorted({r["model"] for r in rows}):
        for task in [t for t in TASKS if any(r["task"] == t and r["model"] == model for r in rows)]:
            sel = [r for r in rows if r["model"] == model and r["task"] == task]
            cols = sorted({(r["context"], r["kv_fraction"]) for r in sel if r["source"] != "dense"})
            dense = {r["context"]: r for r in sel if r["source"] == "dense"}
            value = "ppl" if task == "ppl" else "accuracy"
            print(f"\n{model} · {task} ({value}; n = samples per cell)")
            head = "method".ljust(28) + "".join(f"{c}@{f:g}".rjust(12) for c, f in cols)
            print(head)
            print("dense".ljust(28) + "".join(_fmt(dense.get(c), value).rjust(12) for c, _ in cols))
            methods = sorted({(r["source"], r["method"]) for r in sel if r["source"] != "dense"})
            for source, method in methods:
                cells = {(r["context"], r["kv_fraction"]): r for r in sel if (r["source"], r["method"]) == (source, method)}
                print(f"{source}:{method}".ljust(28) + "".join(_fmt(cells.get(c), value).rjust(12) for c in cols))


def figure(rows: list[dict], path: Path) -> None:
    """Accuracy (recall tasks) and perplexity against the KV fraction kept: one panel per model and task, one line
    per method (sinklab solid, kvpress dashed, dense a horizontal line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["task"], r["context"]) for r in rows if r["source"] != "dense"})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
    for ax, (model, task, context) in zip(axes[0], panels):
        value = "ppl" if task == "ppl" else "accuracy"
        sel = [r for r in rows if (r["model"], r["task"], r["context"]) == (model, task, context)]
        for r in sel:
            if r["source"] == "dense" and r[value] is not None:
                ax.axhline(r[value], color="black", lw=1, label="dense")
        for source, method in sorted({(r["source"], r["method"]) for r in sel if r["source"] != "dense"}):
            pts = sorted((r["kv_fraction"], r[value]) for r in sel
                         if (r["source"], r["method"]) == (source, method) and r[value] is not None)
            if pts:
                ax.plot(*zip(*pts), marker="o", ls="-" if source == "sinklab" else "--", label=f"{source}:{method}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV fraction kept")
        ax.set_ylabel(value)
        ax.set_title(f"{model.split(':')[-1]} · {task} · {context} tokens", fontsize=9)
    axes[0][-1].legend(fontsize=6, loc="best")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_png(fig, path, dpi=110)
    print(f"wrote {path}")


def _fmt(row: dict | None, value: str) -> str:
    if row is None:
        return "—"
    if row.get(value) is None:
        return "error"
    return f"{row[value]:.3f}" if value == "ppl" else f"{row[value]:.2f}"


if __name__ == "__main__":
    main()
