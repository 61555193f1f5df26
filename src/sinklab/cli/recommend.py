"""Printing a :class:`~sinklab.recommend.Recommendation` on the console (called by ``sinklab diagnose``)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ._common import console

__all__ = ["print_recommendation"]


def print_recommendation(rec) -> None:
    """The fix, its confidence and reason, the deciding numbers, and how to apply it."""
    ev = rec.evidence
    console.print(f"[bold]recommended fix: {escape(rec.fix)}[/bold] (confidence {rec.confidence}) — {escape(rec.reason)}")
    table = Table(title="evidence", show_header=False)
    table.add_row("unhoused sinks", f"{ev['unhoused']} ({ev['share']:.1%} of samples×layers×heads)")
    table.add_row("on registers", str(ev["housed_on_registers"]))
    c = ev["counts"]
    table.add_row("NOP / broadcast / unclassified", f"{c['nop']} / {c['broadcast']} / {c['unclassified']}")
    r = ev["median_value_ratio_out"]
    table.add_row("median r_out", "–" if r is None else f"{r:.3f}")
    for e in ev["edits"]:
        table.add_row(f"edits L{e['layer']} H{e['head']} ({e['class']})", f"signature {e['edit_signature']}, agrees {e['agrees']}")
    console.print(table)
    if not rec.support.get("supported"):
        console.print(f"[yellow]{escape(rec.support['note'])}[/yellow]")
    for step in rec.how_to:
        console.print(f"  • {escape(step)}", highlight=False)
