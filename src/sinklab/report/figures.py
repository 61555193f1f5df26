"""Figures of a scan: sink heatmap, strongest-head attention map, hidden-norm curve, Sink^ε bars."""

from __future__ import annotations

import io
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # headless; figures are saved, never shown
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from ..atomic import atomic_file  # noqa: E402
from ..scan import layer_label  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from ..scan import ScanResult

__all__ = ["scan_figures", "sink_heatmap", "attention_map", "hidden_norm_curve", "sink_rate_bars", "png_bytes",
           "save_png"]

DPI = 110


def png_bytes(fig: Figure, **kwargs) -> bytes:
    """``fig`` as PNG bytes (for embedding in a report); the figure is closed."""
    buf = io.BytesIO()
    try:
        fig.savefig(buf, format="png", dpi=DPI, **kwargs)
    finally:
        plt.close(fig)
    return buf.getvalue()


def save_png(fig: Figure, path: str | Path, **kwargs) -> Path:
    """Write ``fig`` as a PNG file at ``path`` atomically (a failure leaves the previous file or none); the figure
    is closed. The one way a figure reaches a file outside a report folder."""
    data = png_bytes(fig, **kwargs)
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def _short(token: str, width: int = 12) -> str:
    return token if len(token) <= width else token[: width - 1] + "…"


def sink_heatmap(result: ScanResult) -> Figure:
    """Layer × head heatmap of the mean column mass at the most common sink position."""
    pos, label = result.top_sink()
    mass = result.column_mass[..., pos].double().nanmean(dim=0)  # (L, H)
    fig, ax = plt.subplots(figsize=(1.0 + 0.45 * result.num_heads, 1.2 + 0.4 * result.num_layers))
    im = ax.imshow(mass.numpy(), vmin=0.0, vmax=1.0, cmap="magma", aspect="auto")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(result.num_heads))
    kinds = result.layer_kinds or ["attention"] * result.num_layers
    ax.set_yticks(range(result.num_layers),
                  [layer_label(i, k) for i, k in enumerate(kinds)])
    ax.set_title(f"column mass at position {pos} ({_short(label)!r})")
    fig.colorbar(im, ax=ax, label="mean attention received")
    fig.tight_layout()
    return fig


def strongest_head(result: ScanResult) -> tuple[int, int, int]:
    """(layer, head, position) of sample 0's largest column mass."""
    strength = result.sink_strength()[0].nan_to_num(-1.0)  # (L, H); a hybrid's recurrent layers: NaN, never chosen
    flat = int(strength.flatten().argmax())
    layer, head = divmod(flat, result.num_heads)
    return layer, head, int(result.dominant_columns()[0, layer, head])


def attention_map(result: ScanResult) -> Figure | None:
    """Sample 0's attention map of the strongest sink head (first ``map_len`` positions)."""
    if result.attention_maps is None:
        return None
    layer, head, pos = strongest_head(result)
    amap = result.attention_maps[layer, head]
    n = min(amap.shape[-1], int(result.token_mask[0].sum()))
    labels = [_short(t, 10) for t in result.tokens[0][:n]]
    fig, ax = plt.subplots(figsize=(6.5, 6.0))
    im = ax.imshow(amap[:n, :n].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
    ax.set_title(f"layer {layer} head {head}: sink at {pos} ({_short(result.token_label(0, pos))!r})")
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    if n <= 48:
        ax.set_xticks(range(n), labels, rotation=90, fontsize=6)
        ax.set_yticks(range(n), labels, fontsize=6)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


def hidden_norm_curve(result: ScanResult) -> Figure:
    """Hidden-state norm per layer: the sink token vs the median of the other tokens."""
    pos, label = result.top_sink()
    norms = result.hidden_norm.double()  # (S, L+1, T)
    sink = norms[..., pos].nanmean(dim=0)
    others = torch.cat([norms[..., :pos], norms[..., pos + 1 :]], dim=-1)
    rest = others.nanmedian(dim=-1).values.nanmean(dim=0)
    xs = list(range(norms.shape[1]))
    fig, ax = plt.subplots(figsize=(6.0, 3.6))
    ax.plot(xs, sink.numpy(), "o-", label=f"sink position {pos} ({_short(label)!r})")
    ax.plot(xs, rest.numpy(), "s--", label="median of the other tokens")
    ax.set_xlabel("block (0 = embeddings)")
    ax.set_ylabel("hidden-state ℓ2 norm")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    return fig


def sink_rate_bars(result: ScanResult, positions: int = 8) -> Figure:
    """Sink^ε (percent of layer×head pairs) over the first positions."""
    n = min(positions, result.seq_len)
    rates = [result.sink_rate(p) for p in range(n)]
    fig, ax = plt.subplots(figsize=(6.0, 3.2))
    ax.bar(range(n), rates, color="#5b6abf")
    ax.set_xticks(range(n), [f"{p}\n{_short(result.token_label(0, p), 8)}" for p in range(n)], fontsize=7)
    ax.set_ylim(0, 100)
    ax.set_ylabel(f"Sink^ε % (ε={result.meta['thresholds']['eps']})")
    ax.set_title(f"sink rate by position, T={result.meta['seq_len']}")
    fig.tight_layout()
    return fig


def scan_figures(result: ScanResult) -> dict[str, Figure]:
    """All scan figures keyed by file stem (a vision-language scan's image with its sink patches too)."""
    from .vlm_figures import image_sinks

    figs = {
        "sink_heatmap": sink_heatmap(result),
        "attention_map": attention_map(result),
        "hidden_norms": hidden_norm_curve(result),
        "sink_rate": sink_rate_bars(result),
        "image_sinks": image_sinks(result),
    }
    return {k: v for k, v in figs.items() if v is not None}
