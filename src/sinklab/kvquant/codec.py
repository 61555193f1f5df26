"""Packed integer storage and asymmetric group quantization: pure tensor functions, no model.

Codes of ``b`` bits are packed along the last dimension, ``k = 8 / gcd(b, 8)`` codes into ``k·b/8`` bytes
(8 bits: 1 → 1, 4 bits: 2 → 1, 2 bits: 4 → 1, 3 bits: 8 → 3), little-endian within each word. Any last
dimension works (it is padded to a multiple of ``k`` with zero codes, and the padding is cut off again).

Quantization is asymmetric (min/max) over groups of ``group_size`` consecutive entries along one
dimension: ``scale = (max − min) / (2^b − 1)``, ``zero = min``, ``code = round((x − zero) / scale)``,
``x̂ = code · scale + zero``. Scales and zero points are stored in float16 (2 bytes each, counted in
:meth:`QuantizedTensor.nbytes`), and codes are computed from the *stored* (rounded) scale and zero, so
``x̂`` is exactly what the codes and the stored metadata say. A constant group stores scale 0 and
decodes exactly to its (float16) value.

``clip=True`` searches each group's range instead of taking min/max: the range is shrunk about its midpoint by
each ratio of :data:`CLIP_RATIOS` and the one whose codes (with the stored, rounded metadata) give the
smallest squared error over the group is kept — min/max is the first candidate and wins ties, so no group
is quantized worse than min/max. At 2 bits (four levels) it cuts a Gaussian group's squared error by about a
quarter, at the price of clipping whatever is far from the rest of its group: only worth it when the outliers
that matter (a sink's key and value) are kept out of the groups, as a protected cache does.

KIVI (Liu et al., 2024, arXiv:2402.02750) groups keys **per channel** over blocks of tokens (``dim=-2``:
outlier channels get their own range) and values **per token** (``dim=-1``).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import InputError, check_int, is_int

__all__ = ["BITS", "CLIP_RATIOS", "QuantizedTensor", "pack_bits", "unpack_bits", "packed_width", "quantize",
           "dequantize"]

#: Bit widths with a packed layout.
BITS = (2, 3, 4, 8)

META_DTYPE = torch.float16

#: Shrink factors of a group's (max − min) range tried by ``quantize(..., clip=True)``; 1.0 (min/max) first.
CLIP_RATIOS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5)


@functools.lru_cache(maxsize=64)
def _shifts(n: int, step: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[0, step, 2·step, …]`` (``n`` entries), built once per device (decode packs one token per layer and step)."""
    return torch.arange(n, dtype=dtype, device=device) * step


def _codes_per_word(bits: int) -> int:
    if not is_int(bits) or bits not in BITS:
        raise InputError(f"bits must be one of {BITS}, got {bits!r}")
    return 8 // math.gcd(bits, 8)


def packed_width(n: int, bits: int) -> int:
    """Bytes that ``n`` codes of ``bits`` bits take when packed (the last dimension of :func:`pack_bits`)."""
    k = _codes_per_word(bits)
    return -(-n // k) * k * bits // 8


def _spread(b: Tensor, bits: int) -> Tensor:
    """Bytes ``[..., m]`` each holding ``8 / bits`` codes → one code per byte ``[..., m · 8 / bits]`` (uint8).

    One halving step per level: a byte ``x = lo + 2^h · hi`` (``h`` = 4, then 2) becomes the 16-bit word
    ``x + (256 − 2^h) · (x >> h) = lo + 256 · hi``, whose two bytes, little-endian, are ``lo`` then ``hi`` —
    in code order. Three vectorised integer passes per level instead of one masked shift per code."""
    h = 4
    while h >= bits:
        x = b.to(torch.int16, memory_format=torch.contiguous_format)
        b = torch.add(x, x >> h, alpha=256 - (1 << h)).view(torch.uint8)  # (..., 2m)
        h //= 2
    return b


def _gather(c: Tensor, bits: int) -> Tensor:
    """Inverse of :func:`_spread`: one code per byte ``[..., n]`` (``n`` a multiple of ``8 / bits``) → packed bytes."""
    h = bits
    while h <= 4:
        w = c.contiguous().view(torch.int16)  # lo + 256 · hi per pair of bytes, little-endian (< 2^12: no overflow)
        c = torch.add(w, w >> 8, alpha=(1 << h) - 256).to(torch.uint8)  # lo + 2^h · hi
        h *= 2
    return c


_LITTLE_ENDIAN = sys.byteorder == "little"  # the byte-level paths read pairs of bytes as int16 words


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack integer codes ``[..., n]`` in ``[0, 2^bits)`` into bytes ``[..., packed_width(n, bits)]`` (uint8)."""
    k = _codes_per_word(bits)
    n = codes.shape[-1]
    pad = (-n) % k
    if bits in (2, 4, 8) and _LITTLE_ENDIAN:
        c = codes.to(torch.uint8)
        if pad:
            c = torch.nn.functional.pad(c, (0, pad))
        return c if bits == 8 else _gather(c, bits)
    c = codes.to(torch.int32)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    words = c.unflatten(-1, (-1, k))  # (..., n/k, k) one word of k·bits bits per row
    word = (words << _shifts(k, bits, torch.int32, codes.device)).sum(-1)  # (..., n/k) at most 24 bits
    nbytes = k * bits // 8
    if nbytes == 1:
        return word.to(torch.uint8)
    out = (word[..., None] >> _shifts(nbytes, 8, torch.int32, codes.device)) & 0xFF  # (..., n/k, nbytes)
    return out.flatten(-2).to(torch.uint8)


def unpack_bits(packed: Tensor, bits: int, n: int) -> Tensor:
    """Inverse of :func:`pack_bits`: bytes ``[..., m]`` → codes ``[..., n]`` (uint8)."""
    k = _codes_per_word(bits)
    nbytes = k * bits // 8
    if bits == 8:
        return packed[..., :n]
    if nbytes == 1:  # 2 and 4 bits
        if _LITTLE_ENDIAN:
            return _spread(packed, bits)[..., :n]
        codes = (packed[..., None] >> _shifts(k, bits, torch.uint8, packed.device)) & ((1 << bits) - 1)  # (..., m, k)
        return codes.flatten(-2)[..., :n]
    b = packed.to(torch.int32).unflatten(-1, (-1, nbytes))  # (..., words, nbytes)
    word = (b << _shifts(nbytes, 8, torch.int32, packed.device)).sum(-1)  # (..., words)
    codes = (word[..., None] >> _shifts(k, bits, torch.int32, packed.device)) & ((1 << bits) - 1)  # (..., words, k)
    return codes.flatten(-2)[..., :n].to(torch.uint8)


@dataclass
class QuantizedTensor:
    """A tensor stored as packed codes plus one float16 scale and zero point per group.

    ``packed`` is ``shape`` with the last dimension packed (uint8); ``scale`` and ``zero`` are ``shape``
    with dimension ``dim`` divided by ``group_size``.
    """

    packed: Tensor
    scale: Tensor
    zero: Tensor
    bits: int
    group_size: int
    dim: int  # non-negative
    shape: tuple[int, ...]
    dtype: torch.dtype  # what dequantize returns

    @property
    def nbytes(self) -> int:
        """Bytes actually held: packed codes + scales + zero points."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))


def _check_groups(shape: tuple[int, ...], dim: int, group_size: int) -> int:
    if not -len(shape) <= dim < len(shape):
        raise InputError(f"dimension {dim} does not exist in a {len(shape)}-D tensor")
    d = dim % len(shape)
    check_int("group_size", group_size, 1)
    if shape[d] % group_size:
        raise InputError(f"dimension {dim} of size {shape[d]} is not a multiple of group_size {group_size}")
    return d


def _metadata(lo: Tensor, hi: Tensor, levels: int) -> tuple[Tensor, Tensor]:
    """The stored (float16) ``scale`` and ``zero`` of groups ranging over ``[lo, hi]``."""
    return (hi - lo).div_(levels).to(META_DTYPE), lo.to(META_DTYPE)


def _codes(xg: Tensor, scale: Tensor, zero: Tensor, levels: int) -> Tensor:
    """Float codes ``round((x − zero) / scale)`` in ``[0, levels]`` from stored metadata (scale 0: code 0)."""
    safe = torch.where(scale == 0, 1.0, scale.float())
    return (xg - zero.float()).div_(safe).round_().clamp_(0, levels)


def _clipped_range(xg: Tensor, d: int, levels: int) -> tuple[Tensor, Tensor]:
    """Per group (axis ``d`` of ``xg``): the ``(lo, hi)`` among the :data:`CLIP_RATIOS` shrinks of its min/max
    range whose codes reconstruct the group with the least squared error (ties: the first, min/max)."""
    lo, hi = torch.aminmax(xg, dim=d, keepdim=True)
    ratios = torch.tensor(CLIP_RATIOS, dtype=xg.dtype, device=xg.device).view(-1, *([1] * xg.ndim))
    half = (hi - lo) / 2
    los, his = lo + (1 - ratios) * half, hi - (1 - ratios) * half  # (A, ...) candidates; ratio 1: lo, hi exactly
    scale, zero = _metadata(los, his, levels)
    err = _codes(xg, scale, zero, levels).mul_(scale.float()).add_(zero.float()).sub_(xg).square_()
    best = err.sum(d + 1, keepdim=True).argmin(0, keepdim=True)  # (1, ..., 1, ...): per group
    return los.take_along_dim(best, 0)[0], his.take_along_dim(best, 0)[0]


def quantize(x: Tensor, bits: int, group_size: int, dim: int = -1, clip: bool = False) -> QuantizedTensor:
    """Asymmetric ``bits``-bit quantization of ``x`` over groups of ``group_size`` entries along ``dim``.

    Parameters
    ----------
    x:
        Any shape; ``x.shape[dim]`` must be a multiple of ``group_size``.
    bits:
        One of :data:`BITS`.
    group_size:
        Consecutive entries along ``dim`` that share a scale and a zero point.
    dim:
        ``-1`` groups within each row (per token for ``[B, H, T, d]`` values); ``-2`` groups over
        consecutive rows of one column (per channel over blocks of tokens for keys).
    clip:
        Search each group's range for the least squared error (:data:`CLIP_RATIOS`) instead of min/max.
    """
    _codes_per_word(bits)
    d = _check_groups(tuple(x.shape), dim, group_size)
    levels = (1 << bits) - 1
    xg = x.float().unflatten(d, (-1, group_size))  # group axis at d + 1
    lo, hi = _clipped_range(xg, d + 1, levels) if clip else torch.aminmax(xg, dim=d + 1, keepdim=True)
    scale, zero = _metadata(lo, hi, levels)
    codes = _codes(xg, scale, zero, levels).to(torch.uint8).flatten(d, d + 1)  # a constant group: every code 0
    return QuantizedTensor(pack_bits(codes, bits), scale.squeeze(d + 1), zero.squeeze(d + 1), bits, group_size, d,
                           tuple(x.shape), x.dtype)


def dequantize(q: QuantizedTensor, dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """``x̂ = code · scale + zero`` with the shape of the quantized tensor (``dtype``: default the original).

    ``out`` (``q.shape``, any strides with a unit last stride) receives the result in place — a stream layer
    dequantizes straight into its attention buffer. Three passes over the result (codes in, × scale, + zero),
    each a plain vectorised kernel; the codes come one per byte from :func:`unpack_bits`.
    """
    codes = unpack_bits(q.packed, q.bits, q.shape[-1]).unflatten(q.dim, (-1, q.group_size))  # (..., groups, G, ...)
    scale, zero = q.scale.unsqueeze(q.dim + 1), q.zero.unsqueeze(q.dim + 1)
    if out is None or out.dtype == torch.float32:  # float32 metadata: no mixed-dtype (slow) kernels
        scale, zero = scale.float(), zero.float()
    if out is None:
        grouped = codes.float()
        grouped.mul_(scale).add_(zero)
        return grouped.flatten(q.dim, q.dim + 1).to(dtype or q.dtype)
    grouped = out.unflatten(q.dim, (-1, q.group_size))
    grouped.copy_(codes)
    grouped.mul_(scale).add_(zero)
    return out
