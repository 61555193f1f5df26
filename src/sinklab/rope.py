"""Pure rotary-position-embedding (RoPE) algebra used by streaming: rotate vectors by a position delta.

RoPE rotates each pair of dimensions ``f`` of a query/key by the angle ``position · ω_f``. Attention
scores depend only on position differences, so a key stored rotated at position ``o`` can be scored as
if it sat at position ``o + Δ`` by rotating it (or, equivalently, the query by ``−Δ``). ``rotate``
applies a pure rotation (no attention-scaling factor: YaRN/longrope's ``mscale`` is applied once, by
the model, when the key is first rotated).

Layouts: ``half`` (Llama/NeoX ``rotate_half``: pair ``(d, d + r/2)``) and ``interleaved`` (GPT-J, Cohere, GLM:
pair ``(2f, 2f + 1)``); only the ``rot_dim`` dimensions from ``offset`` on rotate (partial rotary: the first
``r``; latent attention's decoupled rotary key: the last ``r``). A negative frequency turns the other way
(nanochat's convention). Which layout a model uses is measured, not assumed: :mod:`sinklab._compat.rotary`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["RopeSpec", "rotate", "rotate_with", "angles", "pair_factors", "pair_partner", "rotate_pairs"]


@dataclass(frozen=True)
class RopeSpec:
    """How a model rotates its queries/keys: frequencies ``inv_freq`` ``[r/2]``, layout and rotated width."""

    inv_freq: Tensor  # (r/2,) float64; negative entries rotate the other way
    interleaved: bool = False
    attention_scaling: float = 1.0  # applied by the model at insertion; never re-applied here
    offset: int = 0  # first rotated dimension (the rotated ones are [offset, offset + r))

    @property
    def rot_dim(self) -> int:
        return 2 * self.inv_freq.shape[0]


def angles(spec: RopeSpec, delta: Tensor) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` of ``delta[..., None] · ω`` in float64: each ``[..., r/2]``."""
    theta = delta.double()[..., None] * spec.inv_freq.to(delta.device)
    return theta.cos(), theta.sin()


def rotate_with(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False, offset: int = 0) -> Tensor:
    """Rotate ``x`` ``[..., dh]`` with precomputed ``cos``/``sin`` ``[..., r/2]`` (broadcast), in their dtype."""
    return rotate_pairs(x, *pair_factors(cos, sin, interleaved), interleaved, offset=offset)


def pair_factors(cos: Tensor, sin: Tensor, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """The rotation by ``cos``/``sin`` ``[..., r/2]`` as two per-dimension factors ``c``, ``s`` ``[..., r]``:
    rotated ``= x·c + pair_partner(x)·s`` over the ``r`` rotated dimensions (:func:`rotate_pairs`). Worked out
    once, one rotation costs two fused ops on each tensor it is applied to."""
    if interleaved:
        return (torch.stack([cos, cos], dim=-1).flatten(-2), torch.stack([-sin, sin], dim=-1).flatten(-2))
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)


def pair_partner(x: Tensor, interleaved: bool = False) -> Tensor:
    """Each rotated dimension's partner: ``(x₂, x₁)`` for the half layout, pairs swapped for the interleaved one."""
    if interleaved:
        return torch.stack([x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    half = x.shape[-1] // 2
    return torch.cat([x[..., half:], x[..., :half]], dim=-1)


def rotate_pairs(x: Tensor, c: Tensor, s: Tensor, interleaved: bool = False,
                 partner: Tensor | None = None, offset: int = 0) -> Tensor:
    """Rotate ``x`` ``[..., dh]`` by the factors of :func:`pair_factors` (``[..., r]``, broadcast): its dimensions
    ``[offset, offset + r)`` become ``x·c + pair_partner(x)·s`` (computed in ``c``'s dtype), the others pass
    through; result in ``x``'s dtype. ``partner``: ``pair_partner`` of those ``r`` dimensions when the caller keeps
    it (``x`` unchanged between rotations)."""
    r = c.shape[-1]
    xr = x[..., offset : offset + r].to(c.dtype)
    out = torch.addcmul(xr * c, pair_partner(xr, interleaved) if partner is None else partner, s).to(x.dtype)
    if r == x.shape[-1]:
        return out
    shape = out.shape[:-1]  # pass-through dims, broadcast like the factors
    parts = [x[..., :offset].expand(*shape, offset)] if offset else []
    parts.append(out)
    if offset + r < x.shape[-1]:
        parts.append(x[..., offset + r :].expand(*shape, x.shape[-1] - offset - r))
    return torch.cat(parts, dim=-1)


def rotate(x: Tensor, spec: RopeSpec, delta: Tensor) -> Tensor:
    """Rotate ``x`` ``[..., dh]`` by position ``delta`` (broadcast against ``x.shape[:-1]``).

    Angles and products in float64, result in ``x``'s dtype. ``rotate(rotate(x, d), −d) == x``.
    """
    cos, sin = angles(spec, delta)  # (..., r/2)
    return rotate_with(x, cos, sin, spec.interleaved, spec.offset)
