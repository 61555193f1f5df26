"""Block-output statistics: per-token hidden-state norm, largest |activation| and its dimension, median |a|.

Index 0 is the input of block 0 (the embeddings), index ``l + 1`` the output of block ``l``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import metrics
from ..errors import ModelWeightsError

__all__ = ["check_finite", "hidden_statistics", "HIDDEN_FIELDS"]

HIDDEN_FIELDS = ("hidden_norm", "hidden_max_abs", "hidden_max_dim", "hidden_median_abs")


def check_finite(x: Tensor, mask: Tensor, index: int) -> None:
    """Raise :class:`~sinklab.errors.ModelWeightsError` naming the block when a real token's state is not finite."""
    if not bool(torch.isfinite(x[mask]).all()):
        where = "the embeddings (input of block 0)" if index == 0 else f"the output of block {index - 1}"
        raise ModelWeightsError(f"non-finite activations (NaN/inf) in {where}; check the model's weights "
                                "and inputs (a float16 model may overflow: try --dtype float32)")


def hidden_statistics(hidden: Tensor, mask: Tensor, index: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Statistics of hidden states ``[B, T, d]`` over the real tokens ``mask`` ``[B, T]`` (CPU tensors).

    Returns ``(norm [B, T], max_abs [B, T], max_dim [B, T] long, median_abs [B])``, NaN (or −1 for the
    dimension) at padding. Raises :class:`~sinklab.errors.ModelWeightsError` naming the block when a
    real token's hidden state is not finite.
    """
    x = hidden.detach().float()
    check_finite(x, mask, index)
    norm = x.norm(dim=-1)
    max_abs, dim = x.abs().max(dim=-1)
    median = metrics.activation_median(x, mask)
    nan = torch.full((), math.nan, device=x.device)
    return (
        torch.where(mask, norm, nan).cpu(),
        torch.where(mask, max_abs, nan).cpu(),
        torch.where(mask, dim, -1).cpu(),
        median.cpu(),
    )
