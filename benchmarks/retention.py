"""A retention grid that separates methods: recall and perplexity at equal KV entries, resumable.

    python benchmarks/retention.py                       # the whole grid; a killed run resumes where it stopped
    python benchmarks/retention.py --models builtin:smollm2 --contexts 2048 --sources sinklab
    python benchmarks/retention.py --table               # the table of what is measured so far
    python benchmarks/retention.py --figure out.png      # accuracy / perplexity against the KV share kept

Tasks, generated here in the style of RULER (Hsieh et al., 2024) over the Python documentation's own prose as
filler (no download; :func:`make_cell`, deterministic for a seed): ``needle`` (one "special magic number" sentence
at a random depth), ``multikey`` (four such sentences with different keys; each key is one question),
``vartrack`` (a chain of three variable assignments scattered through the text, ``VAR A = 12345 … VAR B = VAR A …
VAR C = VAR B``, asked as ``VAR C = VAR B =``: two hops back to the number; a longer chain is beyond SmolLM2 even
with the whole context) and
``ppl`` (perplexity of the 256 tokens that follow the context). An answer is right when the greedy continuation
(10 tokens) contains the number. Two regimes per recall task:

* ``agnostic`` — the context is compressed before any question is seen; it is compressed once per (prompt,
  method, fraction) and every question the context holds is asked of a copy of that compressed cache (as
  kvpress's pipeline does);
* ``aware`` — the question is inside the compressed prompt (one question per context, the one drawn by its seed).

Budgets are equal in KV entries **counted over every layer and key-value head, sliding-window layers included**:
a fraction ``f`` keeps ``f`` × the entries the model's own dense cache holds after the context (Gemma 3's sliding
layers hold only their window). sinklab's policies get the uniform per-head budget ``B`` whose total over the
layers (``Σ heads × min(B, what the layer holds dense)``) is nearest that target; kvpress presses each layer to
``f`` of what it holds. Every row records what was actually held after the compression, measured on the cache:
``kept_entries`` (KV entries summed over layers and key-value heads, mean over the prompts), ``kept_share``
(of the dense entries) and ``kept_bytes`` (entries × (key + value width) × element size).

Methods: ``dense``; sinklab (``SinkCache(model, policy=…)``): ``streaming``, ``snapkv``, ``tova``, ``knorm``,
``auto`` (per-head budgets from a scan, fitted on a calibration text — the standard library's docstrings, not the
grid's filler — at the cell's context length: :func:`sinklab.evaluation.calibration.calibrate_plan`; the prompt
scored by what the model attends to when asked to repeat it, :func:`sinklab.stream.prefill.compressed_prompt`),
``auto_uniform`` (the same scoring with every head at the uniform budget: what the fitted budgets themselves add) and
``auto_snapkv`` (the fitted budgets with SnapKV scoring the prompt: what the reconstruction scores add; on a model
with sliding-window layers the budgets split by window as ``auto``'s are, :func:`sinklab.stream.prefill.
windowed_plan`). sinklab's budget holds at
every step, the question and answer included (``--decode held``, the default); ``--decode appended`` grows it by
every token fed after the prompt (:meth:`sinklab.stream.SinkCache.grow`), so they are kept whole as kvpress keeps
them (the row's ``decode``; a perplexity continuation is one forward that sees every kept token either way).
kvpress 0.5.5 (transformers 5.2.0, in a throwaway virtualenv: ``benchmarks/_kvpress_env.py``; the worker ``_kvpress_worker.py``): ``streaming``, ``snapkv``, ``tova``,
``expected_attention``, ``kvzip`` (refuses Gemma 3), ``adakv_expected_attention`` (its per-head Ada-KV wrapper)
and ``pyramidkv`` (per-layer budgets); its presses compress the prompt once, at prefill, and the question and
answer are then appended uncompressed.

Every cell is one row of ``benchmarks/results/retention_grid.json`` under ``"rows"``: ``{model, method, source,
kv_fraction, task, context, regime, accuracy, interval, ppl, n, prompts, kept_entries, dense_entries, kept_share,
kept_bytes, seconds}`` — ``n`` questions over ``prompts`` contexts, ``interval`` the 95 % Wilson interval of the
accuracy, ``seconds`` the compression time (prefill + scoring) per prompt. A row is written (atomically, the whole
file) as soon as its cell finishes; a rerun skips the cells already there (``--restart`` starts afresh).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch

from sinklab.atomic import write_json
from sinklab.evaluation.retention import (ANSWER_TOKENS, DECODES, NUM_SINKS, PPL_TOKENS, REGIMES, TASKS, cell_row,
                                         filler_ids, layer_holds, make_cache, make_cell, run_prompt,
                                         uniform_budget)
from sinklab.report.figures import save_png

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
OUT = RESULTS / "retention_grid.json"
SINKLAB_METHODS = ("auto", "auto_uniform", "auto_snapkv", "snapkv", "streaming", "tova", "knorm")
KVPRESS_METHODS = ("streaming", "snapkv", "tova", "expected_attention", "kvzip", "adakv_expected_attention",
                   "pyramidkv")
SCAN_SEED = 1  # the auto plan's scan windows (tokenize_windows' seed): not the grid's prompts
CALIBRATION_LATER = 256  # tokens after the calibration context whose attention the auto plan's budgets keep


# ----------------------------------------------------------------------------- sinklab
def scan_for_plan(model, tokenizer):
    """The scan the auto plan is made from: 8 windows of 512 tokens of the filler text."""
    from sinklab.scan import scan_inputs
    from sinklab.texts import default_texts, tokenize_windows

    batch = tokenize_windows(tokenizer, default_texts(), 512, 8, seed=SCAN_SEED)
    return scan_inputs(model, [{"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}], batch.tokens,
                       split=False)


def decode_of(row: dict) -> str:
    """How a row decoded after the compressed prompt: ``appended`` (kvpress always; sinklab rows that say so) or
    ``held`` (sinklab's rows from before the field: the budget held at every step)."""
    return row.get("decode") or ("held" if row["source"] == "sinklab" else "appended")


def label(row: dict) -> str:
    """``source:method``, with `` (appended)`` for a sinklab row run with ``--decode appended``."""
    appended = row["source"] == "sinklab" and decode_of(row) == "appended"
    return f"{row['source']}:{row['method']}" + (" (appended)" if appended else "")


def _key(row: dict) -> tuple:
    return (row["model"], row["method"], row["source"], row["kv_fraction"], row["task"], row["context"],
            row["regime"], decode_of(row))


class Results:
    """The results file: its rows and meta, each new row written at once (atomically, the whole file)."""

    def __init__(self, path: Path, restart: bool) -> None:
        self.path = path
        data = json.loads(path.read_text()) if path.exists() and not restart else {}
        self.meta: dict = data.get("meta", {})
        self.rows: list[dict] = data.get("rows", [])
        self.done = {_key(r) for r in self.rows if r.get("prompts")}
        self.rows = [r for r in self.rows if r.get("prompts")]  # a cell that failed outright is tried again

    def add(self, row: dict) -> None:
        self.rows.append(row)
        self.done.add(_key(row))
        self.save()
        print(json.dumps(row), flush=True)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json(self.path, {"meta": self.meta, "rows": self.rows})


# ----------------------------------------------------------------------------- the grid
def _kvpress(args) -> tuple[Path | None, str]:
    sys.path.insert(0, str(HERE))
    from _kvpress_env import kvpress_python

    return kvpress_python(build=args.build_kvpress)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="builtin:smollm2,builtin:gemma3")
    ap.add_argument("--contexts", default="2048,4096")
    ap.add_argument("--fractions", default="0.25,0.5")
    ap.add_argument("--tasks", default="ppl,needle,multikey,vartrack", help="in the order they are run")
    ap.add_argument("--regimes", default=",".join(REGIMES))
    ap.add_argument("--prompts", type=int, default=10, help="contexts per cell")
    ap.add_argument("--decode", default="held", choices=DECODES,
                    help="sinklab's decoding after the compressed prompt: held (the budget holds at every step) or "
                         "appended (what follows kept whole, as kvpress keeps it: SinkCache.grow)")
    ap.add_argument("--methods", default=",".join(("dense",) + SINKLAB_METHODS), help="sinklab's methods")
    ap.add_argument("--kvpress-methods", default=",".join(KVPRESS_METHODS))
    ap.add_argument("--sources", default="sinklab,kvpress", help="sinklab (dense included), kvpress, or both")
    ap.add_argument("--build-kvpress", action="store_true", help="build the kvpress venv if it is missing")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--restart", action="store_true", help="discard the rows already in --out")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--table", action="store_true", help="only print the table of the results file")
    ap.add_argument("--figure", type=Path, default=None,
                    help="only draw the results file's figure into this PNG ('{model}' in the name: one per model)")
    args = ap.parse_args()
    if args.table or args.figure is not None:
        rows = Results(args.out, False).rows
        if args.table:
            print_table(rows)
        elif "{model}" in str(args.figure):  # one figure per model
            for name in sorted({r["model"] for r in rows}):
                short = name.split(":")[-1].replace("/", "_")
                figure([r for r in rows if r["model"] == name], Path(str(args.figure).replace("{model}", short)))
        else:
            figure(rows, args.figure)
        return
    torch.set_num_threads(args.threads)
    import transformers

    from sinklab import provenance

    res = Results(args.out, args.restart)
    res.meta |= {"machine": f"{platform.node()}: {os.cpu_count()} CPUs, {args.threads} threads",
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "python": platform.python_version(), "answer_tokens": ANSWER_TOKENS, "ppl_tokens": PPL_TOKENS,
                 "num_sinks": NUM_SINKS, "versions": provenance.versions()}
    sources = set(args.sources.split(","))
    kvpython = None
    if "kvpress" in sources:
        kvpython, note = _kvpress(args)
        res.meta["kvpress"] = note
        print(f"kvpress: {note}", flush=True)
    res.save()
    for context in [int(c) for c in args.contexts.split(",")]:
        for name in args.models.split(","):
            grid_model(args, res, name, context, sources, kvpython)
    print_table(res.rows)


def grid_model(args, res: Results, name: str, context: int, sources: set[str], kvpython: Path | None) -> None:
    """Every missing cell of one model at one context length: dense, then per fraction sinklab's methods and then
    kvpress's."""
    from sinklab.models import load_model

    fractions = [float(f) for f in args.fractions.split(",")]
    tasks = [t for t in args.tasks.split(",") if t]
    regimes = [r for r in args.regimes.split(",") if r]
    methods = [m for m in args.methods.split(",") if m] if "sinklab" in sources else []
    presses = [m for m in args.kvpress_methods.split(",") if m] if kvpython is not None else []

    def keys():
        for fraction in [1.0] + fractions:
            for source, names in (("sinklab", methods), ("kvpress", presses)):
                for task in tasks:
                    for regime in (["agnostic"] if task == "ppl" else regimes):
                        for method in names:
                            if (method == "dense") != (fraction == 1.0) or (source == "kvpress" and fraction == 1.0):
                                continue
                            src = "dense" if method == "dense" else source
                            yield {"model": name, "method": method, "source": src, "kv_fraction": fraction,
                                   "task": task, "context": context, "regime": regime,
                                   "decode": args.decode if src == "sinklab" else "appended"}

    todo = [k for k in keys() if _key(k) not in res.done]
    if not todo:
        return
    loaded = load_model(name)
    model, tok = loaded.model.eval(), loaded.tokenizer
    res.meta.setdefault("converted_folders", {})[name] = loaded.notes.get("converted_folder")
    filler = filler_ids(tok)
    cells = {t: [make_cell(tok, filler, t, context, s) for s in range(args.prompts)] for t in tasks}
    with torch.no_grad():
        dense, _ = make_cache(model, "dense", None)(cells[tasks[0]][0]["context_ids"])
    holds = layer_holds(dense)
    dense_entries = sum(h * t for h, t in holds)
    del dense
    res.meta.setdefault("dense_entries", {})[f"{name}@{context}"] = dense_entries
    plans: dict = {}
    for key in todo:
        fraction = key["kv_fraction"]
        budget = None if fraction == 1.0 else uniform_budget(holds, fraction * dense_entries)
        cs = cells[key["task"]]
        t0 = time.time()
        if key["source"] == "kvpress":
            outcomes = kvpress_outcomes(args, kvpython, loaded, key, cs)
        else:
            outcomes = sinklab_outcomes(model, tok, key, budget, cs, plans)
        row = cell_row(key, cs, outcomes, tok, dense_entries)
        row["budget"] = budget
        if key["method"] in ("auto", "auto_snapkv") and budget in plans:  # the fitted budgets' range and what the fit cost
            summary, fit = plans[budget].summary(), plans[budget].source["calibration"]
            row["plan"] = {"least_budget": summary["least_budget"], "most_budget": summary["most_budget"],
                           "calibration_seconds": fit["seconds"]}
        row["wall_s"] = round(time.time() - t0, 1)
        res.add(row)


def sinklab_outcomes(model, tok, key: dict, budget: int | None, cells: list[dict], plans: dict) -> list[dict]:
    """One sinklab method on every prompt of a cell: the outcomes :func:`cell_row` reads (a failure: its error)."""
    try:
        plan = _auto_plan(model, tok, key["method"], budget, key["context"], plans)
    except Exception as exc:  # noqa: BLE001 - a plan that cannot be made is a row with its error
        return [{"error": f"{type(exc).__name__}: {exc}"} for _ in cells]
    prefill = make_cache(model, key["method"], budget, plan, tok, key["decode"])
    outcomes = []
    for cell in cells:
        try:
            outcomes.append(run_prompt(model, cell, key["regime"], prefill, key["decode"]))
        except Exception as exc:  # noqa: BLE001 - a method that cannot run is a row with its error
            outcomes.append({"error": f"{type(exc).__name__}: {exc}"})
    return outcomes


def calibration_ids(tokenizer, context: int) -> list[int]:
    """The calibration text of the auto plan: the first ``context + CALIBRATION_LATER`` tokens of the standard
    library's docstrings (:func:`sinklab.corpus.stdlib_corpus` past its pydoc topics, the grid's filler)."""
    from pydoc_data.topics import topics

    from sinklab.corpus import stdlib_corpus

    skip = sum(len(" ".join(t.split())) for t in topics.values())
    texts = stdlib_corpus(max_chars=skip + 20 * (context + CALIBRATION_LATER))[len(topics):]
    ids = tokenizer(" ".join(texts), add_special_tokens=False)["input_ids"]
    return ids[:context + CALIBRATION_LATER]


def _auto_plan(model, tok, method: str, budget: int | None, context: int, plans: dict):
    """The auto plan at ``budget`` tokens per head: made from the scan, its budgets fitted on the calibration text
    (:func:`sinklab.evaluation.calibration.calibrate_plan`); ``auto_uniform``: the same plan, every head at ``budget``."""
    if method not in ("auto", "auto_uniform", "auto_snapkv"):
        return None
    from sinklab.evaluation.calibration import calibrate_plan
    from sinklab.stream.plan import plan_from_scan
    from sinklab.stream.prefill import windowed_plan

    if "scan" not in plans:
        plans["scan"] = scan_for_plan(model, tok)
    plan = plan_from_scan(model, plans["scan"], num_sinks=NUM_SINKS, window=budget - NUM_SINKS)  # type: ignore[operator]
    if method == "auto_uniform":
        return plan.uniform()
    if budget not in plans:
        t0 = time.perf_counter()
        plans[budget] = calibrate_plan(model, plan, calibration_ids(tok, context), context)
        plans[budget].source["calibration"]["seconds"] = round(time.perf_counter() - t0, 1)
    if method == "auto_snapkv":  # split by window on a model with sliding layers, as compressed_prompt splits it
        return windowed_plan(model, plans[budget], context)
    return plans[budget]


def kvpress_outcomes(args, python: Path | None, loaded, key: dict, cells: list[dict]) -> list[dict]:
    """One press on every prompt of a cell, in the kvpress venv: the outcomes :func:`cell_row` reads."""
    from _kvpress_env import run_worker

    items = []
    for i, c in enumerate(cells):
        item: dict = {"id": str(i), "context_ids": c["context_ids"]}
        if "continuation_ids" in c:
            item.update(kind="ppl", continuation_ids=c["continuation_ids"])
        elif key["regime"] == "aware":
            item.update(kind="generate", context_ids=c["context_ids"] + c["questions"][c["aware"]]["question_ids"],
                        questions=[[]], max_new_tokens=ANSWER_TOKENS)
        else:
            item.update(kind="generate", questions=[q["question_ids"] for q in c["questions"]],
                        max_new_tokens=ANSWER_TOKENS)
        items.append(item)
    job = {"model_dir": loaded.notes["converted_folder"], "threads": args.threads,
           "presses": [{"method": key["method"], "kv_fraction": key["kv_fraction"]}], "items": items}
    try:
        got = {r["id"]: r for r in run_worker(python, job, timeout=6 * 3600)}  # type: ignore[arg-type]
    except RuntimeError as exc:
        return [{"error": str(exc)[-300:]} for _ in cells]
    out = []
    for i in range(len(cells)):
        r = got.get(str(i), {"error": "no result"})
        if "error" in r:
            out.append({"error": r["error"]})
            continue
        o = {"seconds": r["prefill_s"], "entries": r["kept_entries"], "bytes": r["kept_bytes"]}
        if "nll_sum" in r:
            o.update(nll=r["nll_sum"], count=r["n_scored"])
        else:
            o["generated"] = r["generated"]
        out.append(o)
    return out


# ----------------------------------------------------------------------------- reading the results
def print_table(rows: list[dict]) -> None:
    """One table per model, context, task and regime: methods down, fractions across; accuracy [95 % interval]
    or perplexity, and the share of the dense entries held."""
    groups = sorted({(r["model"], r["context"], r["task"], r["regime"]) for r in rows},
                    key=lambda g: (g[0], g[1], TASKS.index(g[2]), g[3]))
    for model, context, task, regime in groups:
        sel = [r for r in rows if (r["model"], r["context"], r["task"], r["regime"]) == (model, context, task, regime)]
        fracs = sorted({r["kv_fraction"] for r in sel}, reverse=True)
        value = "ppl" if task == "ppl" else "accuracy"
        print(f"\n{model} · {context} tokens · {task} · {regime} ({value}; kept share of dense entries)")
        print("method".ljust(34) + "".join(f"{f:g}".rjust(26) for f in fracs))
        for name in sorted({label(r) for r in sel}, key=lambda m: (not m.startswith("dense"), m)):
            cells = {r["kv_fraction"]: r for r in sel if label(r) == name}
            print(name.ljust(34) + "".join(_fmt(cells.get(f), value).rjust(26) for f in fracs))


def _fmt(row: dict | None, value: str) -> str:
    if row is None:
        return "—"
    if row.get(value) is None:
        return "error"
    share = f" ({row['kept_share']:.3f})" if row.get("kept_share") is not None else ""
    if value == "ppl":
        return f"{row['ppl']:.3f}{share}"
    lo, hi = row["interval"]
    return f"{row['accuracy']:.2f} [{lo:.2f},{hi:.2f}]{share}"


SOURCE_COLOURS = {"sinklab": "#1f77b4", "kvpress": "#ff7f0e"}


def _bars(ax, sel: list[dict], value: str) -> None:
    """One panel at one kept fraction: a bar per method, best first (sinklab blue, kvpress orange, ``auto`` dark),
    the 95 % interval of each accuracy, dense as a vertical line."""
    bars = sorted((r for r in sel if r["source"] != "dense" and r[value] is not None),
                  key=lambda r: (r[value] if value == "ppl" else -r[value], r["source"], r["method"]))
    ys = range(len(bars))
    colours = ["#08306b" if r["method"] == "auto" else SOURCE_COLOURS.get(r["source"], "grey") for r in bars]
    widths = [r[value] for r in bars]
    errors = None
    if value == "accuracy" and all(r.get("interval") for r in bars):
        errors = [[r[value] - r["interval"][0] for r in bars], [r["interval"][1] - r[value] for r in bars]]
    ax.barh(list(ys), widths, color=colours, xerr=errors, error_kw={"lw": 0.6, "capsize": 1.5, "ecolor": "grey"})
    ax.set_yticks(list(ys), [label(r) for r in bars], fontsize=6)
    ax.invert_yaxis()
    for r in sel:
        if r["source"] == "dense" and r[value] is not None:
            ax.axvline(r[value], color="black", lw=1, ls=":", label="dense")
    if value == "ppl" and widths:
        dense = [r[value] for r in sel if r["source"] == "dense" and r[value] is not None]
        low = min(widths + dense)
        ax.set_xlim(low * 0.97, max(widths) * 1.01)
    else:
        ax.set_xlim(0, 1.05)
    fraction = sorted({r["kv_fraction"] for r in bars})
    ax.set_xlabel(f"{value} at {', '.join(f'{f:.0%}' for f in fraction)} of the dense KV entries", fontsize=7)


def figure(rows: list[dict], path: Path) -> None:
    """One panel per model, context, task and regime. A panel with one kept fraction: a bar per method (best first;
    sinklab blue, kvpress orange, sinklab's ``auto`` dark blue; accuracy with its 95 % interval; dense a dotted
    line). Several fractions: accuracy or perplexity against the measured share of dense KV entries kept, one line
    per method (sinklab solid, kvpress dashed, dense a horizontal line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["context"], r["task"], r["regime"]) for r in rows if r["source"] != "dense"})
    cols = min(4, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    names = sorted({label(r) for r in rows if r["source"] != "dense"})
    colour = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(names)}  # one colour per method, every panel
    colour["sinklab:auto"] = "#08306b"  # as in the bar panels
    for ax, panel in zip(axes.flat, panels):
        model, context, task, regime = panel
        value = "ppl" if task == "ppl" else "accuracy"
        sel = [r for r in rows if (r["model"], r["context"], r["task"], r["regime"]) == panel]
        ax.set_title(f"{model.split(':')[-1]} · {context} tokens · {task} · {regime}", fontsize=8)
        if len({r["kv_fraction"] for r in sel if r["source"] != "dense"}) == 1:
            _bars(ax, sel, value)
            continue
        for r in sel:
            if r["source"] == "dense" and r[value] is not None:
                ax.axhline(r[value], color="black", lw=1, label="dense")
        for name in sorted({label(r) for r in sel if r["source"] != "dense"}):
            pts = sorted((r["kept_share"], r[value], r.get("interval")) for r in sel if label(r) == name
                         and r[value] is not None and r.get("kept_share") is not None)
            if pts:
                xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                err = None
                if value == "accuracy" and all(p[2] for p in pts):  # the 95 % interval of each accuracy
                    err = [[y - p[2][0] for y, p in zip(ys, pts)], [p[2][1] - y for y, p in zip(ys, pts)]]
                ax.errorbar(xs, ys, yerr=err, marker="o", ms=3, lw=1.6 if name == "sinklab:auto" else 0.9,
                            capsize=1.5, elinewidth=0.5, ls="-" if name.startswith("sinklab") else "--",
                            label=name, color=colour[name])
        ax.set_xlabel("share of dense KV entries held")
        ax.set_ylabel(value)
        ax.legend(fontsize=5, loc="best")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    save_png(fig, path)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
