"""Pure attention functions with an explicit "nothing to attend to" option.

``softmax_with_sink`` appends one sink logit to every row of scores and drops it after the softmax
(gpt-oss's learned per-head sink; ``sink_logit = 0`` is softmax₁ of "Attention is off by one";
``sink_logit = −inf`` is the plain softmax). The weights over the real tokens then sum to
``1 − sink mass``, so a head can do (almost) nothing without parking attention on a real token.

Worked example: six value vectors, scores all ≈ 0. Without a sink each gets 1/6 and the
output is their mean (norm 0.83 in the example); with a sink logit of 3 the sink takes
``e³ / (e³ + 6) = 77 %`` and the output shrinks by the same factor to 0.19:

>>> import torch
>>> scores = torch.zeros(6)
>>> values = torch.tensor([[0.83, 0.0]]).repeat(6, 1) + torch.tensor([[0.1, 0.2], [-0.1, -0.2], [0.3, 0.0],
...                                                                    [-0.3, 0.0], [0.0, 0.5], [0.0, -0.5]])
>>> round(float((softmax_with_sink(scores, float("-inf")) @ values).norm()), 2)
0.83
>>> w = softmax_with_sink(scores, 3.0)
>>> round(1 - float(w.sum()), 2), round(float((w @ values).norm()), 2)
(0.77, 0.19)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, overload

import torch
from torch import Tensor

from .rope import rotate

__all__ = ["AttendSpec", "Columns", "attend", "soft_cap", "softmax_with_columns", "softmax_with_sink", "sink_mass", "mask_rows",
           "rotated_key_scores"]


def softmax_with_columns(scores: Tensor, extra: Tensor) -> tuple[Tensor, Tensor]:
    """Softmax over ``[scores | extra]`` on the last axis, returned split: ``(weights [..., T], extra [..., E])``.

    ``extra`` ``[..., E]`` holds the logits of learned columns that are not tokens (a sink logit, a kv-bias
    slot's score) with the same leading shape as ``scores``. Masked entries may be ``−inf``.

    >>> w, x = softmax_with_columns(torch.zeros(1, 3), torch.zeros(1, 1))
    >>> [round(v, 2) for v in w[0].tolist()], round(float(x[0, 0]), 2)
    ([0.25, 0.25, 0.25], 0.25)
    """
    top = torch.maximum(scores.amax(dim=-1, keepdim=True), extra.amax(dim=-1, keepdim=True)).detach()
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    e, x = torch.exp(scores - top), torch.exp(extra - top)
    denom = e.sum(dim=-1, keepdim=True) + x.sum(dim=-1, keepdim=True)
    return e / denom, x / denom


def softmax_with_sink(scores: Tensor, sink_logit: Tensor | float) -> Tensor:
    """Softmax over the last axis of ``scores`` ``[..., T]`` with one extra logit ``sink_logit`` (dropped).

    ``sink_logit`` broadcasts against ``scores.shape[:-1]`` (e.g. ``[H, 1]`` for a per-head sink with
    scores ``[B, H, Tq, Tk]``). Returns weights over the ``T`` real entries; each row sums to
    ``1 − e^s / (e^s + Σ e^z)``. Masked entries may be ``−inf``; a row with every real entry masked
    gives all zeros (everything goes to the sink) unless the sink is ``−inf`` too (NaN, as softmax).
    """
    sink = torch.as_tensor(sink_logit, dtype=scores.dtype, device=scores.device)
    return softmax_with_columns(scores, sink.expand(scores.shape[:-1]).unsqueeze(-1))[0]


def sink_mass(weights: Tensor) -> Tensor:
    """``1 − Σ_j w_j``: the share each row gave to the sink."""
    return 1.0 - weights.sum(dim=-1)


def mask_rows(
    mask: Tensor | None, is_causal: bool, c0: int, c1: int, tq: int, tk: int, device: torch.device | str
) -> tuple[Tensor, Tensor | None]:
    """What query rows ``c0:c1`` may attend to, from whatever mask transformers handed the attention function.

    ``mask`` is boolean ``[B|1, 1, Tq, Tk]`` (True = attend), additive float (``finfo.min`` = blocked), or
    ``None`` (causal with the last query aligned to the last key, or full when ``is_causal`` is False).
    Returns the boolean ``[B|1, 1, C, Tk]`` visibility and, for float masks, the additive part (else None).
    """
    if mask is None:
        rows = torch.arange(c0, c1, device=device)[:, None] + (tk - tq)
        cols = torch.arange(tk, device=device)[None, :]
        allowed = (cols <= rows) if is_causal and tq > 1 else torch.ones(c1 - c0, tk, dtype=torch.bool, device=device)
        return allowed[None, None], None
    part = mask[..., c0:c1, :tk]
    if part.dtype == torch.bool:
        return part, None
    floor = torch.finfo(part.dtype).min / 2
    allowed = part > floor
    return allowed, part.float().masked_fill(~allowed, 0.0)


# ----------------------------------------------------------------------------- one attention
@dataclass(frozen=True)
class Columns:
    """Key columns that are not among the ``key``/``value`` tensors handed to :func:`attend`, by their logits.

    ``logits`` ``[B|1, H|1, C|1, E]``: the final score of each column for each query (already scaled and, where
    the caller wants it, softcapped — :func:`attend` does not touch them). ``values`` ``[B|1, G, E, dv]`` with
    ``G`` 1, the key/value heads, the query heads or any divisor of them (head ``h`` reads ``h // (H/G)``); ``None`` is value 0 (a sink). ``visible``
    ``[B|1, 1, C|1, E]`` (True = seen); ``None``: seen by every row that sees anything of the sequence.

    Learned columns (a sink logit, a kv-bias slot) have ``visible=None``; the stream's anchored keys, scored at
    their slot distance per query, come with their values and visibility.
    """

    logits: Tensor
    values: Tensor | None = None
    visible: Tensor | None = None

    @classmethod
    def sink(cls, logit: Tensor, like: Tensor) -> Columns:
        """A learned sink: one column of logit ``logit`` ``[H]`` per head for every query, value 0."""
        return cls(logit.to(like.dtype).to(like.device).view(1, -1, 1, 1))

    @classmethod
    def slot(cls, query: Tensor, key: Tensor, value: Tensor, scale: float, softcap: float | None = None) -> Columns:
        """A learned key/value slot (kv-bias): ``key`` ``[H, dh]``, ``value`` ``[G, dv]`` (G = 1, Hkv or H).

        Its logit for each query of ``query`` ``[B, H, C, dh]`` is ``soft_cap(q·key·scale)``; it has no position.
        """
        logit = torch.matmul(query * scale, key.to(query)[None, :, :, None])  # (B, H, C, 1)
        return cls(soft_cap(logit, softcap), value.to(query)[None, :, None])


def soft_cap(scores: Tensor, cap: float | None) -> Tensor:
    """``cap · tanh(scores / cap)`` (Gemma 2's attention-logit softcap); ``scores`` unchanged when ``cap`` is None."""
    return scores if cap is None else torch.tanh(scores / cap) * cap


def _by_group(x: Tensor, hkv: int, rep: int) -> Tensor:
    """``[B|1, 1|H|Hkv, …]`` → ``[B|1, Hkv|1, rep|1, …]``: query head ``h`` is group ``h // rep``, member ``h % rep``."""
    g = x.shape[1]
    if g == 1:
        return x[:, :, None]
    if g == hkv * rep:
        return x.view(x.shape[0], hkv, rep, *x.shape[2:])
    if g == hkv:
        return x[:, :, None]
    raise ValueError(f"head axis of size {g} fits neither {hkv} key/value heads nor {hkv * rep} query heads")


def _causal(c: int, k: int, device: torch.device) -> Tensor:
    """``[1, 1, C, K]``: query ``i`` (the last ``C`` positions of ``K``) sees keys up to its own position."""
    return mask_rows(None, True, 0, c, c, k, device)[0]


@dataclass(frozen=True)
class AttendSpec:
    """How one :func:`attend` call runs: everything but the tensors it attends over.

    ``causal``: with no ``visible``, each query sees the keys up to its own position (the ``C`` queries are the
    last ``C`` of the ``K`` positions). ``scale``: ``None`` is ``dh^-½``. ``bias`` ``[B|1, 1|H, C, K]`` is added to
    the scores after the softcap (an additive mask, a position bias). ``columns`` (:class:`Columns`) add keys by
    their logits. ``softcap``: Gemma 2's logit cap (manual path only). ``gate`` ``[B, C, H, dv|1]`` multiplies each
    head's output. ``dropout`` on the weights. ``fast``: the fused path (``None``: fused unless there is a softcap
    or the weights are asked for). ``mask_from`` (manual path, a speed hint): every row sees the keys left of it,
    only columns from it are masked.
    """

    causal: bool = False
    scale: float | None = None
    bias: Tensor | None = None
    columns: Sequence[Columns] = ()
    softcap: float | None = None
    gate: Tensor | None = None
    dropout: float = 0.0
    fast: bool | None = None
    mask_from: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", tuple(self.columns))
        if self.fast and self.softcap is not None:
            raise ValueError("scaled_dot_product_attention has no softcap; use the manual path (fast=False)")

    def fused(self, weights: bool) -> bool:
        """Whether the call runs the fused path (the weights come only from the manual one)."""
        if weights and self.fast:
            raise ValueError("the attention weights come from the manual path; pass fast=False (or leave fast unset)")
        return self.fast if self.fast is not None else self.softcap is None and not weights


@overload
def attend(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None = ..., spec: AttendSpec | None = ..., *,
           weights: Literal[False] = ..., **options: Any) -> Tensor: ...


@overload
def attend(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None = ..., spec: AttendSpec | None = ..., *,
           weights: Literal[True], **options: Any) -> tuple[Tensor, Tensor]: ...


@overload
def attend(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None = ..., spec: AttendSpec | None = ..., *,
           weights: bool = ..., **options: Any) -> Tensor | tuple[Tensor, Tensor]: ...


def attend(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None = None, spec: AttendSpec | None = None,
           *, weights: bool = False, **options: Any) -> Tensor | tuple[Tensor, Tensor]:
    """Attention of ``query`` ``[B, H, C, dh]`` over ``key``/``value`` ``[B, Hkv, K, dh|dv]`` → ``[B, H, C, dv]``.

    ``H`` a multiple of ``Hkv`` (grouped-query attention: query head ``h`` reads key/value head ``h // (H/Hkv)``).
    ``visible`` boolean ``[B|1, 1|H, C, K]`` (True = attend); ``None`` sees every key, or with ``causal`` the
    keys up to the query's own position. ``spec`` (:class:`AttendSpec`) says how the call runs; its fields may
    also be given as keywords (``attend(q, k, v, visible, columns=[sink], softcap=30.0)``), which override the
    spec's. ``columns`` add keys by their logits: a sink (value 0), a kv-bias slot, anchored keys scored at
    another distance. One softmax covers the tokens and the columns. A row that sees nothing of the sequence (no
    visible key, no visible anchored column) is padding: its output is 0, learned columns or not.

    Two paths, same maths: ``fast`` (default when there is no ``softcap`` and no ``weights``) is one fused
    :func:`torch.nn.functional.scaled_dot_product_attention` call — columns enter as extra keys: their logits
    ride in extra query dimensions (divided by the scale) against one-hot key dimensions, their values as the
    extra keys' values, so ``q·k·scale`` of column ``e`` is its logit. The manual path reads as the maths:
    ``q·kᵀ·scale`` → softcap → ``+ bias`` → mask → :func:`softmax_with_columns` → ``weights @ values``; with
    ``weights=True`` it also returns the weights over the keys ``[B, H, C, K]`` (rows sum to 1 minus the
    columns' share). Computes in ``query``'s dtype — except the fused path on a CPU, which computes float16,
    and one-query bfloat16, in float32 and rounds the output back (:func:`_upcast_on_cpu`).

    >>> q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    >>> sink = Columns(torch.zeros(1, 2, 1, 1))  # softmax₁: a column of logit 0 and value 0
    >>> fast, manual = (attend(q, k, v, causal=True, columns=[sink], fast=f) for f in (True, False))
    >>> bool(torch.allclose(fast, manual, atol=1e-6))
    True
    """
    spec = AttendSpec(**options) if spec is None else replace(spec, **options) if options else spec
    h, c = query.shape[1], query.shape[2]
    hkv, k_len = key.shape[1], key.shape[2]
    if h % hkv:
        raise ValueError(f"{h} query heads do not split into groups over {hkv} key/value heads")
    fast = spec.fused(weights)
    scale = query.shape[-1] ** -0.5 if spec.scale is None else float(spec.scale)
    if visible is None and spec.causal and not (fast and k_len == c and not spec.columns and spec.bias is None):
        visible = _causal(c, k_len, query.device)
    real = None  # (B|1, 1|H, C, 1): rows that see something of the sequence (others are padding → 0)
    # Fused attention alone already gives 0 on such rows; with ``mask_from`` every row sees a key.
    if visible is not None and (spec.columns or not fast) and not spec.mask_from:
        real = visible.any(-1, keepdim=True)
        for col in spec.columns:
            if col.visible is not None:
                real = real | col.visible.any(-1, keepdim=True)
    out, probs = (_attend_fast if fast else _attend_manual)(query, key, value, visible, spec, scale, real)
    if spec.gate is not None:
        out = out * spec.gate.transpose(1, 2).to(out.dtype)
    if not weights:
        return out
    assert probs is not None  # the manual path's
    return out, probs


def _column_parts(columns: list[Columns], b: int, h: int, hkv: int, c: int, device: torch.device):
    """The columns as one ``[B', H, C, E]`` logit block, their visibility ``[B', 1, C, E]`` and values (or None)."""
    lead = max(col.logits.shape[0] for col in columns)
    logits = torch.cat([col.logits.expand(lead, h, c, col.logits.shape[-1]) for col in columns], dim=-1)
    seen = None
    if any(col.visible is not None for col in columns):
        seen = torch.cat([(col.visible if col.visible is not None else
                           torch.ones(1, 1, 1, col.logits.shape[-1], dtype=torch.bool, device=device)
                           ).expand(b, 1, c, col.logits.shape[-1]) for col in columns], dim=-1)
    values = None
    if any(col.values is not None for col in columns):
        heads = max(col.values.shape[1] for col in columns if col.values is not None)
        vlead = max(col.values.shape[0] for col in columns if col.values is not None)
        dv = next(col.values.shape[-1] for col in columns if col.values is not None)
        parts = []
        for col in columns:
            e = col.logits.shape[-1]
            part = col.values if col.values is not None else logits.new_zeros(1, 1, e, dv)
            parts.append(part.to(logits.dtype).expand(vlead, heads, e, dv))
        values = torch.cat(parts, dim=2)
        if heads not in (1, hkv, h):  # grouped over other key/value heads than these keys' (repeated keys)
            values = values.repeat_interleave(h // heads, dim=1)
    return logits, seen, values


def _attend_manual(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, spec: AttendSpec,
                   scale: float, real: Tensor | None) -> tuple[Tensor, Tensor]:
    """Readable path: scores, softcap, bias, mask, one softmax over keys and columns, weighted values."""
    b, h, c, dh = query.shape
    hkv, k_len = key.shape[1], key.shape[2]
    rep, bias, mask_from, dropout, columns = h // hkv, spec.bias, spec.mask_from, spec.dropout, list(spec.columns)
    q = query.reshape(b, hkv, rep, c, dh)
    scores = torch.matmul(q * scale, key[:, :, None].transpose(-1, -2))  # (B, Hkv, rep, C, K)
    scores = soft_cap(scores, spec.softcap)
    if bias is not None:
        scores = scores + _by_group(bias.to(scores.dtype), hkv, rep)
    if visible is not None:
        seen = _by_group(visible, hkv, rep)
        if mask_from:
            scores[..., mask_from:].masked_fill_(~seen[..., mask_from:], -math.inf)
        else:
            scores = scores.masked_fill(~seen, -math.inf)
    col_p = col_values = None
    if columns:
        logits, col_seen, col_values = _column_parts(columns, b, h, hkv, c, query.device)
        logits = _by_group(logits.to(scores.dtype), hkv, rep)
        if col_seen is not None:
            logits = logits.masked_fill(~col_seen[:, :, None], -math.inf)
        probs, col_p = softmax_with_columns(scores, logits)
    else:
        probs = torch.softmax(scores, dim=-1)
    if real is not None:  # padding rows: nothing visible → 0 (also where the softmax gave NaN)
        row = _by_group(real, hkv, rep)
        probs = probs.masked_fill(~row, 0.0)
        col_p = col_p.masked_fill(~row, 0.0) if col_p is not None else None
    if dropout:
        probs = torch.nn.functional.dropout(probs, dropout)
        col_p = torch.nn.functional.dropout(col_p, dropout) if col_p is not None else None
    out = torch.matmul(probs, value[:, :, None])  # (B, Hkv, rep, C, dv)
    if col_values is not None and col_p is not None:
        out = out + torch.matmul(col_p, _by_group(col_values.to(out.dtype), hkv, rep))
    return out.reshape(b, h, c, -1), probs.reshape(b, h, c, k_len)


def _upcast_on_cpu(query: Tensor) -> bool:
    """Whether :func:`_sdpa` computes in float32 rather than in ``query``'s 16-bit dtype: on a CPU, float16
    always, bfloat16 for at most :data:`_BF16_UPCAST_QUERIES` queries (decode steps).

    torch's fused CPU attention is slow in half precision on a CPU without native 16-bit arithmetic (AVX2); the
    cast to float32 pays in float16 at every length and in bfloat16 for one query (docs/stream.md has the
    measurements). float32 arithmetic is also the more accurate one; the output is rounded back to the 16-bit dtype."""
    if query.device.type != "cpu":
        return False
    return query.dtype == torch.float16 or (query.dtype == torch.bfloat16 and query.shape[-2] <= _BF16_UPCAST_QUERIES)


_BF16_UPCAST_QUERIES = 1


def _sdpa(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, **kwargs) -> Tensor:
    """:func:`torch.nn.functional.scaled_dot_product_attention`, in float32 where the 16-bit kernel is slow
    (:func:`_upcast_on_cpu`); otherwise the same call."""
    f = torch.nn.functional.scaled_dot_product_attention
    if not _upcast_on_cpu(query):
        return f(query, key, value, attn_mask=attn_mask, **kwargs)
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.float()
    return f(query.float(), key.float(), value.float(), attn_mask=attn_mask, **kwargs).to(query.dtype)


def _attend_fast(query: Tensor, key: Tensor, value: Tensor, visible: Tensor | None, spec: AttendSpec,
                 scale: float, real: Tensor | None) -> tuple[Tensor, None]:
    """Fused path: one :func:`_sdpa` call, columns as extra keys (see :func:`attend`)."""
    b, h, c, dh = query.shape
    dv, hkv = value.shape[-1], key.shape[1]
    rep, bias, dropout, columns = h // hkv, spec.bias, spec.dropout, list(spec.columns)
    if not columns:
        mask = visible
        if bias is not None:
            full = visible if visible is not None else torch.ones((), dtype=torch.bool, device=query.device)
            mask = bias.to(query.dtype).masked_fill(~full, -math.inf)
        out = _sdpa(query, key, value, attn_mask=mask, is_causal=spec.causal and mask is None, scale=scale,
                   dropout_p=dropout, enable_gqa=rep > 1)
        return out, None
    logits, col_seen, col_values = _column_parts(columns, b, h, hkv, c, query.device)
    e = logits.shape[-1]
    if col_values is not None and col_values.shape[1] not in (1, hkv):  # per-query-head values: no grouping
        key, value = (x.repeat_interleave(rep, dim=1) for x in (key, value))
        hkv, rep = h, 1
    k_len = key.shape[2]
    width = max(dh + e, dv)  # the fused kernels want queries, keys and values of one width
    dt = query.dtype
    # A −∞ logit (a sink switched off) becomes the lowest finite one: −∞ · 0 would put NaN on every key.
    ride = (logits.to(dt) / scale).clamp_min(torch.finfo(dt).min / 2).expand(b, h, c, e)
    q = torch.cat([query, ride, query.new_zeros(b, h, c, width - dh - e)], -1)
    onehot = torch.cat([key.new_zeros(e, dh), torch.eye(e, dtype=dt, device=key.device),
                        key.new_zeros(e, width - dh - e)], -1)
    k = torch.cat([onehot.expand(b, hkv, e, width), torch.nn.functional.pad(key, (0, width - dh))], dim=2)
    if col_values is None:
        extra_v = value.new_zeros(b, hkv, e, width)
    else:
        extra_v = torch.nn.functional.pad(col_values.to(dt), (0, width - dv)).expand(b, hkv, e, width)
    v = torch.cat([extra_v, torch.nn.functional.pad(value, (0, width - dv))], dim=2)
    seen = visible if visible is not None else torch.ones(1, 1, c, k_len, dtype=torch.bool, device=query.device)
    lead, heads = max(seen.shape[0], 1 if col_seen is None else col_seen.shape[0]), seen.shape[1]
    col_mask = (col_seen if col_seen is not None else torch.ones(1, 1, 1, e, dtype=torch.bool, device=q.device))
    if bias is not None:
        lead, heads = max(lead, bias.shape[0]), max(heads, bias.shape[1])
    mask = torch.cat([col_mask.expand(lead, heads, c, e), seen.expand(lead, heads, c, k_len)], dim=-1)
    if bias is not None:
        scores = torch.cat([bias.new_zeros(lead, heads, c, e), bias.expand(lead, heads, c, k_len)], -1)
        mask = scores.to(dt).masked_fill(~mask, -math.inf)
    out = _sdpa(q, k, v, attn_mask=mask, scale=scale, dropout_p=dropout, enable_gqa=rep > 1)[..., :dv]
    if real is not None:
        out = out.masked_fill(~real, 0.0)
    return out, None


_PAIR_BUDGET = 1 << 15  # (query, anchored key) pairs rotated at once


def rotated_key_scores(q: Tensor, keys: Tensor, idx: Tensor, shift: Tensor, rope, scale: float) -> Tensor:
    """Scores ``q·k·scale`` of queries ``q`` ``[B, Hkv, rep, C, dh]`` against the key slots ``idx`` of ``keys``
    ``[B, Hkv, K, dh]``, each key re-rotated per query by ``shift`` ``[B, C, nA]`` positions (:func:`sinklab.rope.rotate`
    with ``rope``): the stream scores its anchored keys (sinks, pinned spans) at their slot distance this way and
    hands the scores to :func:`attend` as :class:`Columns`. Rotated in float64,
    ``_PAIR_BUDGET`` (query, key) pairs at a time."""
    c = q.shape[3]
    k = keys[:, :, idx].double()  # (B, Hkv, nA, dh)
    out = []
    step = max(1, _PAIR_BUDGET // max(1, idx.numel()))
    for c0 in range(0, c, step):
        c1 = min(c, c0 + step)
        kr = rotate(k[:, :, None], rope, shift[:, None, c0:c1])  # (B, Hkv, C', nA, dh)
        out.append(torch.einsum("bgrcd,bgcjd->bgrcj", q[:, :, :, c0:c1].double(), kr) * scale)
    return torch.cat(out, dim=3).float()
