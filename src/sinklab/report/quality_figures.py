"""Figures and Markdown tables of the stream quality runs (:mod:`sinklab.evaluation.quality`), from their JSON."""

from __future__ import annotations

from ..evaluation.quality import block_length, block_stats

__all__ = ["endless_block", "quality_figures", "quality_tables"]

_STYLE = {"dense": ("k", "o"), "sinks": ("C0", "s"), "window": ("C3", "^"), "pinned": ("C2", "D")}
_NAMES = {"dense": "dense", "sinks": "sinks + window", "window": "window only", "pinned": "sinks + window, fact pinned"}


def endless_block(n: int) -> int:
    """Block length for an endless run of ``n`` tokens (:func:`sinklab.evaluation.quality.block_length`)."""
    return block_length(n)


def _endless_runs(data: dict) -> dict[str, list[dict]]:
    """Endless runs grouped by model: ``{"builtin:smollm2": [run, …]}`` (sinks first)."""
    groups: dict[str, list[dict]] = {}
    for key, run in data.items():
        if key.startswith("endless_") and run.get("tokens"):
            groups.setdefault(run["model"], []).append(run)
    return {m: sorted(r, key=lambda run: -run["num_sinks"]) for m, r in groups.items()}


def quality_figures(data: dict) -> dict:
    """``{stem: matplotlib Figure}`` for whichever of ``recall``, ``endless_*`` and ``prompts`` ``data`` holds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = {}
    if "recall" in data:
        r = data["recall"]
        fig, ax = plt.subplots(figsize=(6, 3.4))
        for m in r["methods"]:
            color, marker = _STYLE[m]
            ax.plot(r["distances"], [100 * a for a in r["accuracy"][m]], marker=marker, color=color, label=_NAMES[m])
        ax.axvline(r["window"], color="grey", ls=":", lw=1)
        ax.text(r["window"], 50, f" W = {r['window']}", color="grey", fontsize=8)
        ax.set(xscale="log", xlabel="tokens between the fact and its question (d)", ylabel="exact match (%)",
               ylim=(-5, 105), title="recall of a fact placed d tokens back")
        ax.legend(fontsize=8)
        fig.tight_layout()
        figs["recall"] = fig
    for model, runs in _endless_runs(data).items():
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
        for run in runs:
            block = endless_block(len(run["tokens"]))
            st = block_stats(run["tokens"], run["nll"], block)
            axes[0].plot(st["end"], st["distinct"], "o-", label=run["label"])
            axes[1].plot(st["end"], st["mean_nll"], "o-", label=run["label"])
        c = runs[0]["num_sinks"] + runs[0]["window"]
        for ax in axes:
            ax.axvline(c, color="grey", ls=":", lw=1)
        axes[0].set(title=f"distinct 4-grams per block of {block}", xlabel="tokens generated", ylim=(0, 1.05))
        axes[1].set(title="model's mean NLL of its own tokens", xlabel="tokens generated", ylabel="nats")
        axes[0].legend(fontsize=8)
        fig.suptitle(f"{model}: endless sampled generation, cache C = {c}")
        fig.tight_layout()
        figs[f"endless_{model.split(':')[-1]}"] = fig
    if "prompts" in data:
        rows = data["prompts"]["rows"]
        x = list(range(1, len(rows) + 1))
        fig, ax = plt.subplots(figsize=(8, 3.2))
        ax.plot(x, [r["stream_nll"] for r in rows], "s-", label="stream's answer")
        ax.plot(x, [r["fresh_nll"] for r in rows], "o-", label="fresh context's own answer")
        first = next((i + 1 for i, r in enumerate(rows) if r["evicted_before"] > 0), None)
        if first:
            ax.axvspan(first - 0.5, len(rows) + 0.5, color="C1", alpha=0.08, label="stream has evicted tokens")
        ax.set(xlabel="prompt (in stream order)", ylabel="mean NLL under a fresh context (nats)",
               title=f"{data['prompts'].get('model', '')}: many prompts through one stream")
        ax.legend(fontsize=8)
        fig.tight_layout()
        figs["prompts"] = fig
    return figs


def quality_tables(data: dict, answers: bool = True) -> str:
    """The runs as Markdown tables (recall accuracy, endless per-block statistics, prompt NLLs).

    ``answers=False`` leaves the prompts' answer texts out of their table (a terminal summary)."""
    out = []
    if "recall" in data:
        r = data["recall"]
        out.append(f"recall (S = {r['num_sinks']}, W = {r['window']}; {len(r['answers']) // max(1, len(r['methods']) * len(r['distances']))} facts per cell), exact match %:\n")
        out.append("| d | " + " | ".join(_NAMES[m] for m in r["methods"]) + " |")
        out.append("|---|" + "---|" * len(r["methods"]))
        for i, d in enumerate(r["distances"]):
            out.append(f"| {d} | " + " | ".join(f"{100 * r['accuracy'][m][i]:.0f}" for m in r["methods"]) + " |")
        out.append("")
    for model, runs in _endless_runs(data).items():
        block = endless_block(len(runs[0]["tokens"]))
        stats = [block_stats(run["tokens"], run["nll"], block) for run in runs]
        out.append(f"{model} endless generation (per block of {block} tokens: distinct-4-gram ratio / mean NLL):\n")
        out.append("| tokens | " + " | ".join(run["label"] for run in runs) + " |")
        out.append("|---|" + "---|" * len(runs))
        for i, end in enumerate(stats[0]["end"]):
            cells = [f"{s['distinct'][i]:.3f} / {s['mean_nll'][i]:.2f}" if i < len(s["end"]) else "–" for s in stats]
            out.append(f"| {end} | " + " | ".join(cells) + " |")
        out.append("")
    if "prompts" in data:
        p = data["prompts"]
        rows = p["rows"]
        out.append(f"{p.get('model', '')} many prompts (S = {p['num_sinks']}, W = {p['window']}, ≤ {p['max_new_tokens']} tokens per answer), "
                   "mean NLL under a fresh dense context:\n")
        head = ["#", "prompt", "evicted before", "stream", "fresh"] + (["stream answer", "fresh answer"] if answers else [])
        out.append("| " + " | ".join(head) + " |")
        out.append("|" + "---|" * len(head))
        for i, r in enumerate(rows, 1):
            def cell(text: str) -> str:
                return " ".join(text.split()).replace("|", "\\|")

            texts = f" {cell(r['stream_answer'])} | {cell(r['fresh_answer'])} |" if answers else ""
            out.append(f"| {i} | {cell(r['prompt'])} | {r['evicted_before']} | {r['stream_nll']:.2f} | "
                       f"{r['fresh_nll']:.2f} |{texts}")
        evicted = [r for r in rows if r["evicted_before"] > 0]
        if evicted:
            mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
            out.append(f"\nprompts after the first eviction ({len(evicted)}): mean NLL stream "
                       f"{mean([r['stream_nll'] for r in evicted]):.3f} vs fresh {mean([r['fresh_nll'] for r in evicted]):.3f}")
    return "\n".join(out)
