"""Figure, table and HTML of ``kv-quant`` (drawn from ``kv_quant.json``, so they never need the model).

* ``kl_vs_bytes`` — median KL of the next-token distribution against bytes per cached token, one line per
  protection (points are bit widths), transformers' ``QuantizedCache`` as its own line.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from matplotlib.figure import Figure

from .figures import plt
from .html import images_html, page, write_outputs

__all__ = ["kl_vs_bytes", "kv_quant_figures", "render_kv_quant", "table_header", "table_rows", "TABLE_HEADER",
           "write_kv_quant"]

TABLE_HEADER = ("bits", "protect", "median KL", "p90 KL", "top-1", "PPL", "bytes/token", "× 16-bit", "ms/token")
_COLOURS = {"none": "tab:red", "first": "tab:orange", "detected": "tab:blue", "hf-quanto": "tab:purple",
            "hf-hqq": "tab:green"}
CAPTIONS = {
    "kl_vs_bytes": "Median KL(full ‖ quantized) of the next-token distribution over the scored tokens against the "
                   "bytes one cached token takes (packed codes, scales, zero points, the full-precision residual and "
                   "protected tokens included), one line per protection; each point is a bit width. Lower left is "
                   "better. The dashed line is a 16-bit unquantized cache.",
}


def _fmt(value: float, spec: str) -> str:
    return "–" if value is None or value != value else format(value, spec)


def table_header(data: dict) -> tuple[str, ...]:
    """:data:`TABLE_HEADER` plus one ``× 16-bit`` column per extra cached length of the plan."""
    return TABLE_HEADER[:-1] + tuple(f"× 16-bit @{n}" for n in data["plan"].get("bytes_lengths", ())) + TABLE_HEADER[-1:]


def table_rows(data: dict) -> list[tuple[str, ...]]:
    """One tuple of strings per row, in :func:`table_header` order."""
    lengths = data["plan"].get("bytes_lengths", ())
    return [(str(r["bits"]), r["protect"], _fmt(r["median_kl"], ".4g"), _fmt(r["p90_kl"], ".4g"),
             _fmt(100 * r["top1"], ".1f") + " %", _fmt(r["ppl"], ".3f"), _fmt(r["bytes_per_token"], ",.0f"),
             _fmt(r["bytes_ratio_16bit"], ".3f"), *(_fmt(r.get(f"bytes_ratio_16bit_{n}", math.nan), ".3f")
                                                     for n in lengths),
             _fmt(r["ms_per_token"], ".1f")) for r in data["rows"]]


def kl_vs_bytes(data: dict) -> Figure:
    """Median KL against bytes per cached token, one line per protection (see :data:`CAPTIONS`)."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    lines: dict[str, list[dict]] = {}
    for r in data["rows"]:
        if r["protect"] != "full":
            lines.setdefault(r["protect"], []).append(r)
    for name, rows in lines.items():
        rows = sorted(rows, key=lambda r: r["bytes_per_token"])
        x = [r["bytes_per_token"] for r in rows]
        y = [max(r["median_kl"], 1e-7) for r in rows]
        ax.plot(x, y, marker="o", label=name, color=_COLOURS.get(name), ls=":" if name.startswith("hf-") else "-")
        for r, xi, yi in zip(rows, x, y):
            ax.annotate(f"{r['bits']}b", (xi, yi), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axvline(data["dense_bytes_per_token_16bit"], color="grey", ls="--", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bytes per cached token")
    ax.set_ylabel("median KL (nats)")
    plan = data["plan"]
    ax.set_title(f"{data['meta'].get('model', '')}: {plan['samples']} × ({plan['context']} cached + {plan['score']} "
                 f"scored) tokens, G = {_groups(plan)}, R = {plan['residual']}", fontsize=8)
    ax.legend(fontsize=8, title="protection", title_fontsize=8)
    fig.tight_layout()
    return fig


def _ranges(plan: dict) -> str:
    """How each group's range was taken (``plan['clip']``: None — least squares at 2 bits only)."""
    clip = plan.get("clip")
    if clip is None:
        return "Group ranges: least-squares (clipped) at 2 bits, min/max at other widths."
    return "Group ranges: least-squares (clipped) at every width." if clip else "Group ranges: min/max."


def _groups(plan: dict) -> str:
    g, g2 = plan["group_size"], plan.get("group_size_2bit", plan["group_size"])
    return str(g) if g == g2 else f"{g} ({g2} at 2 bits)"


def kv_quant_figures(data: dict) -> dict[str, Figure]:
    return {"kl_vs_bytes": kl_vs_bytes(data)}


def render_kv_quant(data: dict, images: dict[str, bytes]) -> str:
    """The report as one HTML string (every token string and model name escaped)."""
    esc = html.escape
    meta, plan = data["meta"], data["plan"]
    head = "".join(f"<th>{esc(h)}</th>" for h in table_header(data))
    body_rows = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in table_rows(data))
    tokens = meta.get("detected_tokens") or [[] for _ in data["detected"]]
    sinks = "".join(
        f"<li>sample {i}: " + (", ".join(f"{p} <code>{esc(str(t))}</code>" for p, t in zip(pos, toks)) or "none")
        + "</li>" for i, (pos, toks) in enumerate(zip(data["detected"], tokens)))
    prefix = meta.get("window_prefix")
    starts = (" Each window starts with " + " ".join(f"<code>{esc(str(t))}</code>" for t in prefix)
              + ", as the tokenizer starts a prompt.") if prefix else ""
    body = f"""<h1>sinklab kv-quant: {esc(str(meta.get('model')))}</h1>
<p>{plan['samples']} samples of {plan['context']} cached tokens; the next {plan['score']} tokens are scored against the
unquantized cache.{starts} Keys are quantized per channel over blocks of G = {_groups(plan)} tokens, values per token
over groups of {plan.get('value_group') or 'G'} channels (at most the head width); the R = {plan['residual']} most
recent tokens and the protected ones stay unquantized, stored in 16 bits (the <b>16-bit</b> row: every token so
stored, nothing quantized). Bytes per token are measured after the {plan['context'] + plan['score']} tokens of a
sample and, for a cache filled to each length, at {', '.join(map(str, plan.get('bytes_lengths', ()))) or '—'} tokens.
Protections: <b>none</b>; <b>first</b> (the first {plan['num_first']} tokens exact); <b>detected</b> (the positions
receiving more than ε = {plan['eps']} of the attention in at least {100 * plan['share']:.0f} % of the heads, exact).
{_ranges(plan)} A 16-bit unquantized cache takes {data['dense_bytes_per_token_16bit']:,} bytes per token.</p>
<table><tr>{head}</tr>{body_rows}</table>
<h2>Detected sinks</h2><ul>{sinks}</ul>
<h2>Figures</h2>{images_html(images, CAPTIONS)}
<h2>Provenance</h2><pre>{esc(str(meta.get('provenance', '')))}</pre>"""
    return page(f"sinklab kv-quant — {meta.get('model')}", body)


def write_kv_quant(data: dict, out_dir: Path) -> Path:
    """Write ``kv_quant.json``, ``kl_vs_bytes.png`` and ``report.html`` into ``out_dir`` atomically."""
    return write_outputs(out_dir, data, kv_quant_figures(data), lambda images: render_kv_quant(data, images),
                         "kv_quant.json")
