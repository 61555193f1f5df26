"""Weight statistics of each attention layer: the W_O factor for output-space norms and the QK spectrum.

Both depend only on the weights, so they are computed once per layer and device and can be shared by
several captures of the same model (``AttentionCapture(model, weights=stats)``), e.g. the many passes
of :func:`sinklab.diagnose`. A :class:`WeightStatistics` is valid while the weights do not change; each
capture makes its own unless one is passed in, so a capture inside a training loop stays correct.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import _compat, metrics

__all__ = ["LayerWeights", "WeightStatistics"]


@dataclass
class LayerWeights:
    """Per-layer weight statistics."""

    r: Tensor  # (H, dh, dh) triangular factor of W_O^h: ||W_O^h v|| = ||R_h v||
    output_space: bool  # W_O found (else r is the identity: head-space norms)
    qk: Tensor  # (H, dh) singular values of Wq_h^T Wk_h (NaN if the layout is unknown)


class WeightStatistics:
    """Lazily computed :class:`LayerWeights` per ``(layer index, device)``."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, str], LayerWeights] = {}

    def get(self, index: int, layer: nn.Module, attn: nn.Module, h: int, hkv: int, dh: int,
            device: torch.device) -> LayerWeights:
        """The statistics of block ``layer`` (attention module ``attn``: ``h`` heads, ``hkv`` KV heads, width ``dh``)."""
        key = (index, str(device))
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        weights = _compat.head_weights(layer, attn, h, hkv, dh)
        if weights.wo is not None:
            r = torch.linalg.qr(weights.wo, mode="r").R  # (H, dh, dh): ||W_O^h v|| = ||R_h v||
        else:
            r = torch.eye(dh, dtype=torch.float64).expand(h, dh, dh)
        if weights.wq is not None and weights.wk is not None:
            qk = metrics.qk_spectrum(weights.wq, weights.wk)  # (H, dh)
        else:
            qk = torch.full((h, dh), math.nan, dtype=torch.float64)
        info = LayerWeights(r=r.float().to(device), output_space=weights.wo is not None, qk=qk.float())
        self._cache[key] = info
        return info
