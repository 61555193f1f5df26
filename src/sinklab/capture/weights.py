"""Weight statistics of each attention layer: the W_O factor for output-space norms and the QK spectrum.

Both depend only on the weights, so they are computed once per layer, head layout and device and shared by
every capture of the model — scan, diagnose, circuit and the monitor's probes (:data:`SHARED`). Each entry
is keyed by the block's weight fingerprint (:mod:`sinklab.fingerprint`): a weight changed in place (an
optimizer step between monitor probes), a swapped parameter or a variant applied makes it recomputed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .. import _compat, metrics
from ..fingerprint import ModelCache

__all__ = ["LayerWeights", "WeightStatistics", "SHARED"]


@dataclass
class LayerWeights:
    """Per-layer weight statistics."""

    r: Tensor  # (H, dh, dh) triangular factor of W_O^h: ||W_O^h v|| = ||R_h v||
    output_space: bool  # W_O found (else r is the identity: head-space norms)
    qk: Tensor  # (H, dh) singular values of Wq_h^T Wk_h (NaN if the layout is unknown)


class WeightStatistics:
    """:class:`LayerWeights` per block, head layout and device, computed on first use and while the block's
    weights are unchanged served from the cache (see the module docstring)."""

    def __init__(self) -> None:
        self._cache = ModelCache()

    def get(self, index: int, layer: nn.Module, attn: nn.Module, h: int, hkv: int, dh: int,
            device: torch.device) -> LayerWeights:
        """The statistics of block ``layer`` (number ``index``; attention module ``attn``: ``h`` heads, ``hkv``
        KV heads, width ``dh``) with ``r`` on ``device``."""
        key = (index, id(attn), h, hkv, dh, str(device))
        return self._cache.get(layer, key, layer.parameters(), lambda: _layer_weights(layer, attn, h, hkv, dh, device))


def _layer_weights(layer: nn.Module, attn: nn.Module, h: int, hkv: int, dh: int, device: torch.device) -> LayerWeights:
    weights = _compat.head_weights(layer, attn, h, hkv, dh)
    if weights.wo is not None:
        r = torch.linalg.qr(weights.wo, mode="r").R  # (H, dh, dh): ||W_O^h v|| = ||R_h v||
    else:
        r = torch.eye(dh, dtype=torch.float64).expand(h, dh, dh)
    if weights.wq is not None and weights.wk is not None:
        qk = metrics.qk_spectrum(weights.wq, weights.wk)  # (H, dh)
    else:
        qk = torch.full((h, dh), math.nan, dtype=torch.float64)
    return LayerWeights(r=r.float().to(device), output_space=weights.wo is not None, qk=qk.float())


#: The statistics every capture uses unless it is given its own.
SHARED = WeightStatistics()
