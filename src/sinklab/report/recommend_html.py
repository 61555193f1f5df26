"""HTML fragment of a :class:`~sinklab.recommend.Recommendation` (every string escaped), for the diagnosis page."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from ..recommend import Recommendation

__all__ = ["render_recommendation"]


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "–" if x is None or x != x else fmt.format(x)


def render_recommendation(rec: Recommendation) -> str:
    """``<section>`` with the fix, its confidence, the numbers, the rules and how to apply it."""
    esc = html.escape
    ev = rec.evidence
    counts = ev["counts"]
    numbers = (
        f"<tr><th>unhoused sinks</th><td>{ev['unhoused']} ({_f(ev['share'], '{:.1%}')} of samples×layers×heads)</td></tr>"
        f"<tr><th>on registers (housed)</th><td>{ev['housed_on_registers']}</td></tr>"
        f"<tr><th>NOP / broadcast / unclassified</th><td>{counts['nop']} / {counts['broadcast']} / "
        f"{counts['unclassified']}</td></tr>"
        f"<tr><th>median r_out</th><td>{_f(ev['median_value_ratio_out'])}</td></tr>"
        f"<tr><th>layers with NOP / broadcast sinks</th><td>{esc(str(ev['layers_by_class']['nop']))} / "
        f"{esc(str(ev['layers_by_class']['broadcast']))}</td></tr>"
    )
    edits = "".join(
        f"<tr><td>L{e['layer']} H{e['head']}</td><td>{esc(str(e['class']))}</td><td>{esc(str(e['edit_signature']))}</td>"
        f"<td>{esc(str(e['agrees']))}</td><td>{_f(e['zero'])}</td><td>{_f(e['mean_sink'])}</td><td>{_f(e['ordinary'])}</td></tr>"
        for e in ev["edits"]
    )
    edit_table = (f"<table><tr><th>head</th><th>class</th><th>edit signature</th><th>agrees</th><th>zero</th>"
                  f"<th>mean sink</th><th>ordinary</th></tr>{edits}</table>" if edits else "<p>No causal edits were run.</p>")
    steps = "".join(f"<li><code>{esc(s)}</code></li>" for s in rec.how_to)
    support = "supported" if rec.support.get("supported") else "not supported"
    return f"""<section id="recommendation"><h2>Recommended fix: {esc(rec.fix)} (confidence {esc(rec.confidence)})</h2>
<p>{esc(rec.reason)}</p><table>{numbers}</table>{edit_table}
<h3>How to apply</h3><p>Variants on this architecture: <b>{esc(support)}</b> — {esc(str(rec.support.get('note')))}</p><ol>{steps}</ol>
<h3>Rule</h3><p>{esc(rec.rule)}</p><h3>Confidence rule</h3><p>{esc(rec.confidence_rule)}</p></section>"""
