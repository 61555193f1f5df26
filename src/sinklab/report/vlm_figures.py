"""The figure of a vision-language scan: the image with its patches shaded by the attention they receive and its
sink patches outlined."""

from __future__ import annotations

from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # headless; figures are saved, never shown
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from .. import vision_inputs  # noqa: E402

if TYPE_CHECKING:  # pragma: no cover
    from ..scan import ScanResult

__all__ = ["image_sinks", "patch_mass"]


def patch_mass(result: ScanResult, sample: int = 0, image: int = 0) -> tuple[np.ndarray, np.ndarray] | None:
    """``(mass, sinks)``, each ``[rows, cols]``, of one image's patches in ``sample``: the mean column mass over the
    attention layers and heads, and how many layer × head pairs have the patch as their dominant column; None when
    the scan has no grid for that image."""
    if result.modality is None:
        return None
    grids = result.meta.get("image_grids") or []
    grid_list = [tuple(g) if g else None for g in (grids[sample] if sample < len(grids) else [])]
    spans = vision_inputs.image_spans(result.modality[sample], grid_list)
    if image >= len(spans):
        return None
    span = spans[image]
    if span.rows is None or span.cols is None:
        return None
    positions = list(span.positions)
    attn = result.attention_layers
    mass = result.column_mass[sample, attn][..., positions].double().nanmean(dim=(0, 1)).numpy()
    dominant = result.dominant_columns()[sample, attn].flatten().tolist()
    counts = np.array([dominant.count(p) for p in positions], dtype=float)
    shape = (int(span.rows), int(span.cols))
    return mass.reshape(shape), counts.reshape(shape)


def image_sinks(result: ScanResult, sample: int = 0) -> Figure | None:
    """The first image of ``sample`` (as given: a processor's crop or resize is not undone, so the grid is stretched
    over the whole picture) with each patch shaded by its mean column mass and the patches that are some head's
    dominant column outlined, their count written in; None without an image or a grid."""
    images = result.images or []
    found = patch_mass(result, sample)
    if not images or found is None:
        return None
    mass, counts = found
    picture = np.asarray(images[0].convert("RGB"))
    height, width = picture.shape[:2]
    rows, cols = mass.shape
    fig, ax = plt.subplots(figsize=(5.6, 5.6 * height / max(width, 1) + 0.6))
    ax.imshow(picture, extent=(0, width, height, 0))
    top = float(np.nanmax(mass)) if np.isfinite(mass).any() else 1.0
    overlay = ax.imshow(np.nan_to_num(mass), extent=(0, width, height, 0), cmap="magma", alpha=0.55,
                        vmin=0.0, vmax=max(top, 1e-12))
    ch, cw = height / rows, width / cols
    for r in range(rows):
        for c in range(cols):
            if counts[r, c] > 0:
                ax.add_patch(Rectangle((c * cw, r * ch), cw, ch, fill=False, edgecolor="#35e0ff", linewidth=2))
                ax.text((c + 0.5) * cw, (r + 0.5) * ch, str(int(counts[r, c])), color="white", ha="center",
                        va="center", fontsize=8)
    ax.set_title(f"{rows}×{cols} patches: attention received\n(outlined: dominant column of n heads)", fontsize=10)
    ax.set_xticks([])
    ax.set_yticks([])
    fig.colorbar(overlay, ax=ax, fraction=0.046, label="mean column mass")
    fig.tight_layout()
    return fig
