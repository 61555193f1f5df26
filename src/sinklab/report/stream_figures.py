"""Figures and HTML of ``eval-stream`` (drawn from its JSON, so they never need the model).

* ``nll_by_position`` — binned per-token NLL against position, one line per method (the shape of
  StreamingLLM's Figure 3, Xiao et al., arXiv:2309.17453);
* ``sink_ablation`` — perplexity against the number of sinks at equal total cache size ``S + W``
  (the paper's table showing that a few initial tokens restore the window's perplexity).
"""

from __future__ import annotations

import html
from pathlib import Path

from matplotlib.figure import Figure

from .figures import plt
from .html import images_html, page, write_outputs

__all__ = [
    "eval_stream_figures",
    "markdown_html",
    "nll_by_position",
    "render_eval_stream",
    "scored_note",
    "sink_ablation",
    "table_rows",
    "write_eval_stream",
]

_COLOURS = {"dense": "black", "window": "tab:red", "recompute": "tab:green"}


def scored_note(data: dict) -> str:
    p = data["positions"]
    every = "every position" if p["stride"] == 1 else f"stride {p['stride']}"
    return (f"positions {p['first']}–{p['last']}, {every} ({p['count']} tokens per method, "
            f"{p['windows_spanned']:.1f} cache lengths)")


def nll_by_position(data: dict) -> Figure:
    """Mean NLL per bin of scored positions against position, one line per run (sinks S=0 drawn as window)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    sink_runs = [c for c in data["curves"].values() if c["method"] == "sinks" and c["same_as"] is None]
    shades = plt.cm.Blues([0.45 + 0.55 * i / max(1, len(sink_runs) - 1) for i in range(len(sink_runs))])
    shade = iter(shades)
    others = iter(plt.cm.Oranges([0.5 + 0.5 * i / 4 for i in range(5)]).tolist() * 8)  # retention policies
    for label, curve in data["curves"].items():
        if curve["same_as"] is not None:
            continue
        colour = _COLOURS.get(curve["method"]) or (next(shade) if curve["method"] == "sinks" else next(others))
        b = curve["binned"]
        ax.plot(b["position"], b["mean_nll"], label=f"{label} (PPL {curve['ppl']:.1f})", color=colour, lw=1.4)
    trained = data.get("trained_positions")
    if trained and trained < data["positions"]["last"]:
        ax.axvline(trained, color="grey", ls="--", lw=1)
        ax.text(trained, ax.get_ylim()[1], " trained positions", va="top", fontsize=8, color="grey")
    ax.set_xlabel("token position")
    ax.set_ylabel("NLL per token (nats, binned)")
    ax.set_title(f"cache size S + W = {data['cache_size']}; {scored_note(data)}", fontsize=8)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def sink_ablation(data: dict) -> Figure | None:
    """Perplexity against the sink count ``S`` at fixed ``S + W`` (``None`` with fewer than two counts)."""
    runs = [c for c in data["curves"].values() if c["method"] == "sinks"]
    if len(runs) < 2:
        return None
    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    xs = [str(c["num_sinks"]) for c in runs]
    ax.bar(xs, [c["ppl"] for c in runs], color="tab:blue")
    ax.set_xlabel("sinks S (window W = C − S)")
    ax.set_ylabel("perplexity")
    ax.set_title(f"equal cache size C = {data['cache_size']}", fontsize=9)
    fig.tight_layout()
    return fig


def eval_stream_figures(data: dict) -> dict[str, Figure]:
    figures = {"nll_by_position": nll_by_position(data)}
    ablation = sink_ablation(data)
    if ablation is not None:
        figures["sink_ablation"] = ablation
    if data.get("quality"):  # --quality: recall vs distance, endless per block, many prompts
        from .quality_figures import quality_figures

        for stem, fig in quality_figures(data["quality"]).items():
            figures["quality_" + ("endless" if stem.startswith("endless") else stem)] = fig
    return figures


def markdown_html(text: str) -> str:
    """Markdown tables (``| a | b |`` rows, a ``|---|`` rule after the header) and plain lines as escaped HTML."""
    out: list[str] = []
    rows: list[str] = []

    def flush() -> None:
        if rows:
            cells = [[c.strip().replace("\\|", "|") for c in r.strip().strip("|").split(" | ")] for r in rows]
            head = "".join(f"<th>{html.escape(c)}</th>" for c in cells[0])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in cells[1:])
            out.append(f"<table><tr>{head}</tr>{body}</table>")
            rows.clear()

    for line in text.splitlines():
        if line.startswith("|---"):
            continue
        if line.startswith("|"):
            rows.append(line)
            continue
        flush()
        if line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    flush()
    return "\n".join(out)


def table_rows(data: dict) -> list[tuple[str, ...]]:
    """``(method, S, W, scored, mean NLL, PPL, ms / scored token)`` for each run, as printed."""
    rows: list[tuple[str, ...]] = []
    for label, c in data["curves"].items():
        sw = ("–", "–") if c["num_sinks"] is None else (str(c["num_sinks"]), str(c["window"]))
        speed = f"= {c['same_as']}" if c["same_as"] else f"{c['seconds_per_scored_token'] * 1e3:.1f}"
        rows.append((label, *sw, str(c["scored"]), f"{c['mean_nll']:.3f}", f"{c['ppl']:.2f}", speed))
    return rows


TABLE_HEADER = ("method", "S", "W", "scored", "mean NLL", "PPL", "ms / scored token")


def _quality_html(data: dict) -> str:
    if not data.get("quality"):
        return ""
    from .quality_figures import quality_tables

    return ("<h2>Quality beyond perplexity</h2><p>Recall of a fact placed d tokens before its question (exact match), "
            "endless sampled generation (distinct 4-grams and the model's NLL of its own tokens per block) and many "
            "prompts through one stream (each answer's mean NLL under a fresh dense context of its prompt).</p>"
            + markdown_html(quality_tables(data["quality"])))


def render_eval_stream(data: dict, images: dict[str, bytes]) -> str:
    esc = html.escape
    head = "".join(f"<th>{esc(h)}</th>" for h in TABLE_HEADER)
    body_rows = "".join("<tr>" + "".join(f"<td>{esc(x)}</td>" for x in row) + "</tr>" for row in table_rows(data))
    trained = data.get("trained_positions")
    beyond = (f" The model was trained on {trained} positions; the text runs to {data['positions']['last']}."
              if trained else "")
    body = f"""<h1>sinklab eval-stream: {esc(str(data.get('model')))}</h1>
<p>{data['num_tokens']} tokens; every bounded method keeps C = S + W = {data['cache_size']} tokens. All methods are
scored on the same positions: {esc(scored_note(data))}. NLL of token t is −log p(x<sub>t</sub> | x<sub>&lt;t</sub>)
in nats; PPL = exp(mean NLL).{esc(beyond)}</p>
<table><tr>{head}</tr>{body_rows}</table>
{_quality_html(data)}<h2>Figures</h2>{images_html(images)}
<p>dense: full attention, no eviction. window: the last C tokens, no sinks. recompute: each scored token
re-encodes its last C tokens from scratch. sinks S=k: k first tokens kept forever + a window of C − k
(StreamingLLM, Xiao et al., arXiv:2309.17453).</p>"""
    return page(f"sinklab eval-stream — {data.get('model')}", body)


def write_eval_stream(data: dict, out_dir: Path) -> Path:
    """Write ``eval_stream.json``, the figures and ``report.html`` into ``out_dir`` atomically."""
    return write_outputs(out_dir, data, eval_stream_figures(data), lambda images: render_eval_stream(data, images),
                         "eval_stream.json")
