"""The sink monitor's emergence figure: metrics vs tokens seen, one line per layer (matplotlib, Agg)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless; figures are saved, never shown
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from .figures import save_png  # noqa: E402

__all__ = ["emergence_figure", "write_emergence"]


def emergence_figure(records: list[dict]) -> Figure:
    """Sink rate, mean attention to position 0, position-0 norm ratio and loss vs tokens seen (a line per layer).

    ``records`` are :attr:`sinklab.SinkMonitor.records` (or the lines of its ``monitor.jsonl``).
    """
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5), sharex=True)
    if not records:
        return fig
    x = [r["tokens"] if r["tokens"] is not None else r["step"] for r in records]
    n_layers = len(records[0]["sink_rate_0"])
    panels = [
        (axes[0, 0], "sink_rate_0", "Sink^ε(0) % of heads", lambda r, i: r["sink_rate_0"][i]),
        (axes[0, 1], "attention_to_0", "mean attention to position 0", lambda r, i: sum(r["attention_to_0"][i]) / len(r["attention_to_0"][i])),
        (axes[1, 0], "hidden_norm_ratio_0", "‖x₀‖ / median ‖x‖", lambda r, i: r["hidden_norm_ratio_0"][i]),
    ]
    for ax, _, title, get in panels:
        for layer in range(n_layers):
            ax.plot(x, [get(r, layer) for r in records], label=f"layer {layer}")
        ax.set_title(title, fontsize=9)
    axes[0, 0].legend(fontsize=7)
    axes[1, 1].plot(x, [r["loss"] for r in records], color="black")
    axes[1, 1].set_title("training loss", fontsize=9)
    for ax in axes[1]:
        ax.set_xlabel("tokens seen" if records[0]["tokens"] is not None else "step")
    fig.tight_layout()
    return fig


def write_emergence(records: list[dict], path: str | Path) -> Path:
    """Save :func:`emergence_figure` of ``records`` as a PNG at ``path`` (atomically); return the path."""
    return save_png(emergence_figure(records), path)
