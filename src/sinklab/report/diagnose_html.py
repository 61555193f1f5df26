"""HTML page of a diagnosis (self-contained; every token string escaped)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..recommend import Recommendation
from ..scan import layer_label
from .diagnose_figures import diagnosis_figures
from .html import IMAGE_CAPTIONS, images_html, modality_html, page, write_outputs
from .recommend_html import render_recommendation

if TYPE_CHECKING:  # pragma: no cover
    from ..diagnose import Diagnosis

__all__ = ["render_diagnosis", "write_diagnosis"]


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None or x != x else fmt.format(x)


_GATE_KEYS = ("mean_gate_on_sink", "mean_gate_elsewhere", "mean_sink_share", "mean_gated_sink_share")
_GATE_TITLES = ("gate on sink-routed queries", "gate elsewhere", "sink share (no gate)", "sink share × gate")


def render_diagnosis(d: Diagnosis, images: dict[str, bytes], rec: Recommendation | None = None) -> str:
    esc = html.escape
    meta = d.scan.meta
    rows = d.per_layer()
    gated = any("mean_gate_on_sink" in r for r in rows)
    layer_rows = "".join(
        f"<tr><th>{esc(layer_label(r['layer'], r['kind']))}</th>"
        f"<td>{_f(r['sink_pct'], '{:.0f}')}</td><td>{r['counts']['nop']}</td>"
        f"<td>{r['counts']['broadcast']}</td><td>{r['counts']['unclassified']}</td>"
        f"<td>{esc(r['dominant_kind'] or '–')}</td><td>{esc(r['top_sink'] or '–')}</td>"
        f"<td>{_f(r['top_sink_pct'], '{:.0f}')}</td><td>{esc(r['top_token'] or '–')}</td>"
        f"<td>{_f(r['median_value_ratio_out'])}</td><td>{_f(r['median_stable_rank'])}</td>"
        + ("".join(f"<td>{_f(r.get(k))}</td>" for k in _GATE_KEYS) if gated else "") + "</tr>"
        for r in rows
    )
    gate_head = "".join(f"<th>{t}</th>" for t in _GATE_TITLES) if gated else ""
    edit_head = "".join(f"<th>{esc(n)}</th>" for n in (d.edits[0].hidden if d.edits else {}))
    edit_rows = "".join(
        f"<tr><th>L{e.layer} H{e.head}</th><td>{esc(e.kind)}</td>"
        + "".join(f"<td>{_f(v)}</td>" for v in e.hidden.values()) + "</tr>"
        for e in d.edits
    )
    status = ("" if d.found else "<p><b>No sinks found:</b> no head's dominant column passed the rule "
              f"({esc(d.rules['rule'])}).</p>")
    body = f"""<h1>sinklab diagnose: {esc(str(meta.get('model')))}</h1>{status}
<p>{d.scan.num_samples} samples × {d.scan.seq_len} tokens; {len(d.records)} sinks. Rule: <code>{esc(d.rules['rule'])}</code>.
NOP if r_out ≤ {d.rules['nop_max_ratio']}; broadcast if r_out ≥ {d.rules['broadcast_min_ratio']} and stable rank ≤
{d.rules['broadcast_max_srank']}.</p>
<h2>Per layer</h2><table><tr><th>layer</th><th>sink %</th><th>nop</th><th>broadcast</th><th>unclassified</th>
<th>dominant</th><th>top sink (role@position)</th><th>there %</th><th>its usual token</th><th>median r_out</th><th>median srank</th>{gate_head}</tr>{layer_rows}</table>
<h2>Causal value edits (relative RMS change of the final hidden states)</h2>
<table><tr><th>head</th><th>class</th>{edit_head}</tr>{edit_rows}</table>
{modality_html(d.scan)}{render_recommendation(rec) if rec is not None else ''}
<h2>Figures</h2>{images_html(images, IMAGE_CAPTIONS)}
<h2>Rules and provenance</h2><pre>{esc(json.dumps({'rules': d.rules, 'meta': meta}, indent=2, default=str))}</pre>"""
    return page(f"sinklab diagnose — {meta.get('model')}", body)


def write_diagnosis(d: Diagnosis, out_dir: Path) -> Path:
    """Write ``diagnosis.json`` (with the ``recommendation`` the diagnosis carries), ``*.png`` and ``report.html``
    to ``out_dir`` (atomically). Renders only: the recommendation was computed by the analysis."""
    return write_outputs(out_dir, d.to_json(), diagnosis_figures(d),
                         lambda images: render_diagnosis(d, images, d.recommendation), "diagnosis.json")
