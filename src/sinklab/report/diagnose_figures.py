"""Figures of a diagnosis: NOP/broadcast scatter, class counts per layer, causal-edit bars."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .figures import plt  # Agg backend already selected

if TYPE_CHECKING:  # pragma: no cover
    from matplotlib.figure import Figure

    from ..diagnose import Diagnosis

__all__ = ["diagnosis_figures", "diagnostic_scatter", "class_counts", "edit_bars"]

_COLORS = {"nop": "#3b7dd8", "broadcast": "#d8583b", "unclassified": "#9a9a9a"}


def diagnostic_scatter(d: Diagnosis) -> Figure:
    """Output-space value-norm ratio vs stable rank, one point per sink, coloured by layer."""
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    if d.records:
        x = np.clip(np.array([r.value_norm_ratio_out for r in d.records]), 1e-4, None)
        y = np.array([r.stable_rank for r in d.records])
        c = np.array([r.layer for r in d.records])
        sc = ax.scatter(x, y, c=c, cmap="viridis", s=14, alpha=0.75, vmin=0, vmax=max(1, d.scan.num_layers - 1))
        fig.colorbar(sc, ax=ax, label="layer")
    else:
        ax.text(0.5, 0.5, "no sinks found", ha="center", va="center", transform=ax.transAxes)
    rules = d.rules
    ax.axvline(rules["nop_max_ratio"], color=_COLORS["nop"], ls="--", lw=1, label=f"NOP: r_out ≤ {rules['nop_max_ratio']}")
    ax.axvline(rules["broadcast_min_ratio"], color=_COLORS["broadcast"], ls="--", lw=1,
               label=f"broadcast: r_out ≥ {rules['broadcast_min_ratio']}")
    ax.axhline(rules["broadcast_max_srank"], color=_COLORS["broadcast"], ls=":", lw=1,
               label=f"… and srank ≤ {rules['broadcast_max_srank']}")
    ax.set_xscale("log")
    ax.set_xlabel("output-space value-norm ratio at the sink (r_out)")
    ax.set_ylabel("stable rank of the head update")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    return fig


def class_counts(d: Diagnosis) -> Figure:
    """Stacked counts of NOP / broadcast / unclassified sinks per layer."""
    from ..metrics import SINK_KINDS

    rows = d.per_layer()
    layers = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6.0, 3.4))
    bottom = np.zeros(len(rows))
    for kind in ("nop", "broadcast", "unclassified"):
        assert kind in SINK_KINDS
        vals = np.array([r["counts"][kind] for r in rows], dtype=float)
        ax.bar(layers, vals, bottom=bottom, color=_COLORS[kind], label=kind)
        bottom += vals
    ax.set_xticks(layers)
    ax.set_xlabel("layer")
    ax.set_ylabel("sinks (sample × head)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def edit_bars(d: Diagnosis) -> Figure | None:
    """Relative RMS change of the final hidden states for each causal edit of each edited head."""
    if not d.edits:
        return None
    from ..edits import EDITS

    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(d.edits) + 2), 3.8))
    width = 0.8 / len(EDITS)
    xs = np.arange(len(d.edits))
    for i, name in enumerate(EDITS):
        vals = [e.hidden[name] for e in d.edits]
        ax.bar(xs + i * width, vals, width, label=name)
    ax.set_xticks(xs + 0.4 - width / 2, [f"L{e.layer} H{e.head}\n{e.kind}" for e in d.edits], fontsize=7)
    ax.set_ylabel("relative RMS change, final hidden")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


def diagnosis_figures(d: Diagnosis) -> dict:
    from .vlm_figures import image_sinks

    figs = {"diagnostic_scatter": diagnostic_scatter(d), "class_counts": class_counts(d), "causal_edits": edit_bars(d),
            "image_sinks": image_sinks(d.scan)}
    return {k: v for k, v in figs.items() if v is not None}
