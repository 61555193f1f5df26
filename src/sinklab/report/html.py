"""Self-contained HTML report (images embedded as base64 PNG, every token string HTML-escaped)."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING


from ..atomic import atomic_dir
from ..registry import REGISTRY
from ..scan import layer_label
from .figures import png_bytes, scan_figures

if TYPE_CHECKING:  # pragma: no cover
    from ..scan import ScanResult

__all__ = ["write_report", "write_outputs", "render_html", "page", "images_html", "modality_html", "IMAGE_CAPTIONS"]

_CSS = """
body{font-family:system-ui,sans-serif;margin:2rem auto;max-width:1100px;color:#222}
table{border-collapse:collapse;font-size:.85rem}td,th{border:1px solid #ccc;padding:.25rem .5rem;text-align:right}
th{background:#f3f3f7}code{background:#f3f3f7;padding:0 .2rem}img{max-width:100%;margin:.5rem 0}
.tok{display:inline-block;border:1px solid #ddd;border-radius:3px;margin:1px;padding:0 .2rem;font-family:monospace}
"""


def _fmt(value: float | None, fmt: str) -> str:
    return "–" if value is None else fmt.format(value)


def _hybrid_html(result: ScanResult) -> str:
    """A hybrid's layers without attention, and the state its recurrent layers keep."""
    kinds = result.layer_kinds or []
    others = [i for i, kind in enumerate(kinds) if kind != "attention"]
    if not others:
        return ""
    state = result.meta.get("recurrent_state_bytes") or {}
    size = f" They keep {sum(state.values()) / 1024:.1f} KiB of state per sequence, whatever its length." if state else ""
    return (f"<p>Hybrid model: {len(others)} of {result.num_layers} layers have no attention map "
            f"({', '.join(f'{i} {html.escape(kinds[i])}' for i in others)}); the sink rate counts the attention layers "
            f"only.{size}</p>")


def _gate_html(result: ScanResult) -> str:
    """Per attention layer: the output gate on queries routed to position 0 vs elsewhere, sink share without/with it."""
    gates = result.gate_statistics()
    if gates is None:
        return ""
    rows = []
    for layer in result.attention_layers:
        cells = "".join(f"<td>{_fmt(float(gates[k][layer].nanmean()), '{:.3f}')}</td>"
                        if not bool(gates[k][layer].isnan().all()) else "<td>–</td>"
                        for k in ("gate_on_sink", "gate_elsewhere", "sink_share", "gated_sink_share"))
        rows.append(f"<tr><th>{layer}</th>{cells}</tr>")
    return ("<h2>Output gate</h2><p>Mean over heads. A gate that shuts on the queries routed to the sink does the "
            "sink's no-op itself (Qiu et al. 2025).</p><table><tr><th>layer</th><th>gate on sink-routed queries</th>"
            "<th>gate elsewhere</th><th>sink share (no gate)</th><th>sink share × gate</th></tr>"
            + "".join(rows) + "</table>")


def modality_html(result: ScanResult) -> str:
    """A vision-language scan: sink rate and strength by modality, the visual sink share, the top sinks."""
    if result.modality is None:
        return ""
    esc = html.escape
    summary = result.modality_summary()
    share = summary.get("visual_sink_share") or [None] * result.num_layers
    rows = "".join(
        f"<tr><th>{layer}</th><td>{_fmt(summary['sink_rate']['text']['per_layer'][layer], '{:.1f}')}</td>"
        f"<td>{_fmt(summary['sink_rate']['image']['per_layer'][layer], '{:.1f}')}</td>"
        f"<td>{_fmt(summary['sink_strength']['text'][layer], '{:.3f}')}</td>"
        f"<td>{_fmt(summary['sink_strength']['image'][layer], '{:.3f}')}</td>"
        f"<td>{_fmt(share[layer], '{:.3f}')}</td></tr>" for layer in range(result.num_layers))
    sinks = "".join(f"<li>position {s['position']} <code>{esc(s['token'])}</code> — {esc(s['patch'] or s['modality'])}: "
                    f"dominant column of {s['heads']} layer×head pairs</li>" for s in summary["top_sinks"])
    counts = ", ".join(f"{n} {esc(name)}" for name, n in summary["positions"].items())
    return (f"<h2>By modality</h2><p>Positions: {counts}. ε = {summary['eps']}. Visual sink tokens: image keys whose "
            "column mass reaches ε; the last column is the share of the text queries' attention to the image that "
            "lands on them. The vision tower is not scanned.</p><table><tr><th>layer</th><th>Sink^ε text %</th>"
            "<th>Sink^ε image %</th><th>strength text</th><th>strength image</th><th>text→image on visual sinks</th>"
            f"</tr>{rows}</table><h3>Top sinks (sample 0)</h3><ul>{sinks}</ul>")


def render_html(result: ScanResult, images: dict[str, bytes]) -> str:
    """The report as one HTML string; ``images`` maps figure stems to PNG bytes."""
    esc = html.escape
    meta = result.meta
    table = result.per_layer()
    pos, label = result.top_sink()
    head = "".join(f"<th title='{esc(r.description)}'>{esc(r.title)}</th>" for r in REGISTRY)
    rows = []
    kinds = result.layer_kinds or ["attention"] * result.num_layers
    for layer in range(result.num_layers):
        cells = "".join(f"<td>{_fmt(table[r.name][layer], r.fmt)}</td>" for r in REGISTRY)
        rows.append(f"<tr><th>{esc(layer_label(layer, kinds[layer]))}</th>{cells}</tr>")
    mass0 = result.column_mass[0, result.attention_layers].nanmean(dim=(0, 1))  # (T,) sample 0, attention layers
    toks = []
    for i, tok in enumerate(result.tokens[0]):
        alpha = 0.0 if mass0[i] != mass0[i] else min(1.0, float(mass0[i]) * 2)
        toks.append(f"<span class='tok' style='background:rgba(220,60,60,{alpha:.2f})' "
                    f"title='position {i}, mean column mass {float(mass0[i]):.3f}'>{esc(tok)}</span>")
    figs = images_html(images, {**SCAN_CAPTIONS, **IMAGE_CAPTIONS})
    legend = "".join(f"<dt><b>{esc(r.title)}</b></dt><dd>{esc(r.description)}</dd>" for r in REGISTRY)
    provenance = esc(json.dumps(meta, indent=2, default=str))
    body = f"""<h1>sinklab scan: {esc(str(meta.get('model')))}</h1>
<p>{result.num_samples} samples × {result.seq_len} tokens, {result.num_layers} layers × {result.num_heads} heads.
Sink<sub>0</sub><sup>ε={meta['thresholds']['eps']}</sup> = <b>{result.sink_rate(0):.1f} %</b> of layer×head pairs
(T = {meta['seq_len']}). Most common sink: position {pos} (<code>{esc(label)}</code>).</p>
{_hybrid_html(result)}{_gate_html(result)}{modality_html(result)}<h2>Per layer</h2><table><tr><th>layer</th>{head}</tr>{''.join(rows)}</table>
<h3>What the columns mean</h3><dl>{legend}</dl>
<h2>Sample 0 tokens (shaded by mean column mass)</h2><p>{''.join(toks)}</p>
<h2>Figures</h2>{figs}
<h2>Provenance</h2><pre>{provenance}</pre>"""
    return page(f"sinklab scan — {meta.get('model')}", body)


def write_outputs(out_dir: Path, data: dict, figures: dict, render: Callable[[dict[str, bytes]], str],
                  json_name: str) -> Path:
    """Write ``json_name``, one PNG per figure and ``report.html`` into ``out_dir`` atomically.

    Everything goes to a temporary folder beside ``out_dir`` first and is moved in place at the end
    (:func:`sinklab.atomic.atomic_dir`), so a failure leaves no partial report behind. ``render`` turns ``{stem: PNG bytes}`` into the HTML.
    """
    out_dir = Path(out_dir)
    with atomic_dir(out_dir) as tmp:
        images = {name: png_bytes(fig) for name, fig in figures.items()}
        for name, png in images.items():
            (tmp / f"{name}.png").write_bytes(png)
        (tmp / json_name).write_text(json.dumps(data, indent=1, default=str))
        (tmp / "report.html").write_text(render(images), encoding="utf-8")
    return out_dir / "report.html"


def write_report(result: ScanResult, out_dir: Path) -> Path:
    """Write a scan's ``scan.json``, ``*.png`` and ``report.html`` to ``out_dir`` (atomically)."""
    return write_outputs(out_dir, result.to_json(), scan_figures(result), lambda images: render_html(result, images),
                         "scan.json")


def page(title: str, body: str) -> str:
    """A complete HTML document with sinklab's stylesheet; ``title`` is escaped, ``body`` must already be."""
    return (f"<!doctype html><html><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>"
            f"<style>{_CSS}</style></head><body>{body}</body></html>")


#: How to read each scan figure (shown under it in the report).
SCAN_CAPTIONS = {
    "sink_heatmap": "Mean column mass (attention received, averaged over the queries that see the key) at the most "
                    "common sink position, per layer (rows) and head (columns); 0–1. Bright cells are sinking heads.",
    "attention_map": "Sample 0's attention of the strongest sinking head: rows are queries, columns keys. A sink is "
                     "a bright vertical stripe.",
    "hidden_norms": "Hidden-state norm of each position relative to the median token, per block output. A sink "
                    "position usually stands far above 1 (high-norm / massive activations).",
    "sink_rate": "Sink^ε(k): share of layer×head pairs whose column mass at position k exceeds ε (Gu et al.), for "
                 "the first positions. Depends on T: compare scans at the same sequence length.",
}
#: The figure a vision-language scan adds.
IMAGE_CAPTIONS = {
    "image_sinks": "The image with its patches shaded by the mean attention they receive (over layers and heads); "
                   "outlined patches are some head's dominant column, with the number of such heads. The token grid "
                   "is stretched over the image as given: a processor's crop or resize is not undone.",
}


def images_html(images: dict[str, bytes], captions: dict[str, str] | None = None) -> str:
    """Embedded ``<img>`` tags (base64 PNG) with escaped titles and, where given, a caption saying how to read it."""
    captions = captions or {}
    return "".join(
        f"<h3>{html.escape(name.replace('_', ' '))}</h3><img alt='{html.escape(name)}' src='data:image/png;base64,"
        f"{base64.b64encode(png).decode()}'>"
        + (f"<p class='caption'>{html.escape(captions[name])}</p>" if name in captions else "")
        for name, png in images.items()
    )
