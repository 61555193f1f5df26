"""``DynamicQuantizedSinkLayer``: a transformers cache layer that stores keys/values packed, sinks exact.

Storage per layer (``[B, Hkv, ·, d]`` tensors), in position order:

* the **residual**: the most recent tokens, unquantized, between ``R`` and ``R + G − 1`` of them (KIVI);
* **quantized blocks**: whenever ``R + G`` tokens are waiting, the oldest ``G`` are packed — keys per channel
  over the block of ``G`` tokens (one scale and zero point per channel and block), values per token over
  groups of ``G_v`` channels (one per token and group); at 2 bits each group's range is its least-squares one
  (``clip``), at other widths its min/max;
* **protected** tokens (:class:`~sinklab.kvquant.plan.Protection`: first ``S``, pinned spans, detected sinks)
  are never quantized: when their block is packed, an exact copy is kept and their slot in the block is a
  *hole* — its key is replaced, before the block's ranges are taken, by the smallest key of the block's other
  tokens in each channel, so an outlier sink key does not stretch the range of the block it sits in. Holes
  keep the blocks aligned on positions: protecting ``P`` tokens costs exactly ``P`` exact tokens more than
  protecting none, at every length; a layer of the model's own sliding-window attention releases the copies of
  protected tokens no later query can see (``window``);
* residual and protected tokens are stored in **16 bits** (``exact_dtype``): the model's dtype when it is
  16-bit, otherwise float16 (a float32 model's keys/values are rounded once to float16 — its effect on KL is
  the ``16-bit`` row of :func:`~sinklab.kvquant.evaluate.kv_quant`); ``exact_dtype=torch.float32`` keeps them
  bit-exact in a float32 model at twice the bytes. A value beyond float16's range raises (use bfloat16).

``update`` returns everything stored, dequantized, in position order, followed by the new chunk in full
precision: a chunk attends to itself exactly and to the past as stored (what transformers'
``QuantizedLayer`` does). Attention reads dequantized tensors: each forward unpacks the whole cache once
per layer (``O(T·d)`` per layer and step; no fused kernel).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch import nn
from transformers.cache_utils import Cache, DynamicLayer

from .. import _compat
from ..errors import InputError, UnsupportedModelError, check_int, is_int
from .codec import BITS, QuantizedTensor, dequantize, quantize
from .plan import Protection

__all__ = ["CLIP_BITS", "DynamicQuantizedSinkLayer", "quantized_sink_cache", "dense_bytes_per_token", "kv_shape"]

#: Bit widths at which the dense cache searches least-squares ranges by default (``clip=None``).
CLIP_BITS = (2,)


def _cat(a: Tensor | None, b: Tensor, dim: int = -2) -> Tensor:
    return b if a is None else torch.cat([a, b], dim=dim)


class DynamicQuantizedSinkLayer(DynamicLayer):
    """One layer of a growing KV cache with packed ``bits``-bit storage and full-precision sinks.

    Parameters
    ----------
    bits:
        2, 3, 4 or 8.
    group_size:
        ``G``: tokens per key block (per-channel scales) and channels per value group (per-token scales;
        capped at the head width).
    residual:
        ``R``: the most recent unprotected tokens always kept in full precision.
    protect:
        Stream positions kept unquantized (default: none).
    value_group:
        Channels per value scale and zero point (default: ``group_size``); capped at the head width.
    exact_dtype:
        Storage of the protected and residual tokens: ``None`` — the model's dtype if it is 16-bit, else
        float16.
    window:
        The layer's own sliding attention window (keys a query sees, itself included; Gemma 3's local layers),
        ``None`` for full attention. A protected token that no later query can see any more (position
        ``≤ seen − window``) is not worth its exact copy: it stays a hole in its block (so the block's other tokens
        quantize as before) but its exact copy is not kept, or is released once it has left the window; the
        model's own sliding-window mask hides the hole, so the layer's output is the same as with the copy.
    clip:
        Search each key block's and value group's range for the least squared error instead of taking its
        min/max (:func:`~sinklab.kvquant.codec.quantize`). Clipping cuts the error of ordinary tokens but would
        clip an outlier sink sitting in the group: it pays when the sinks are protected. ``None`` (default):
        at 2 bits only (:data:`CLIP_BITS`), where it was measured to pay; at 4 bits min/max ranges did better
        (docs/kv-quant.md).
    """

    is_croppable = False

    def __init__(self, bits: int = 4, group_size: int = 64, residual: int = 32, protect: Protection | None = None,
                 exact_dtype: torch.dtype | None = None, value_group: int | None = None,
                 window: int | None = None, clip: bool | None = None) -> None:
        super().__init__()
        if not is_int(bits) or bits not in BITS:
            raise InputError(f"kv bits must be one of {BITS}, got {bits!r}")
        check_int("group_size", group_size, 1)
        check_int("residual", residual, 0)
        if value_group is not None:
            check_int("value_group", value_group, 1)
        if window is not None:
            check_int("a sliding window", window, 1, " (tokens it holds)")
        self.window, self.clip = window, bits in CLIP_BITS if clip is None else bool(clip)
        self.bits, self.group_size, self.residual = bits, group_size, residual
        self.protect = protect or Protection()
        self.exact_dtype = exact_dtype
        self.value_group_size = value_group or group_size
        self.deferred = False  # hold tokens unpacked until protect_and_pack (see defer_packing)
        self.seen = 0  # tokens (columns) stored so far
        self._empty()

    def _empty(self) -> None:
        self.qk: QuantizedTensor | None = None  # packed keys (B, Hkv, N, ·) of positions 0 … N − 1, N a multiple of G
        self.qv: QuantizedTensor | None = None
        # exact copies of the protected tokens inside the packed blocks
        self.pk: Tensor | None = None
        self.pv: Tensor | None = None
        self.p_pos: Tensor | None = None
        # the residual: positions N … seen − 1, 16-bit
        self.rk: Tensor | None = None
        self.rv: Tensor | None = None

    # ------------------------------------------------------------------ transformers' layer contract
    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        if self.exact_dtype is None:
            self.exact_dtype = self.dtype if self.dtype.itemsize == 2 else torch.float16
        dh = value_states.shape[-1]
        self.value_group = min(self.value_group_size, dh)
        if dh % self.value_group:
            raise InputError(f"head width {dh} is not a multiple of the value group {self.value_group}")
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store ``[B, Hkv, C, d]`` new keys/values; return the stored past (dequantized) ⧺ the new chunk."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self._gather(key_states, value_states)
        self._store(key_states, value_states)
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def reset(self) -> None:
        self.seen = 0
        self._empty()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``i`` continues row ``beam_idx[i]`` (packed blocks, exact copies and residual)."""
        self._select_rows(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """``num_return_sequences``: each row becomes ``repeats`` identical rows."""
        if self.rk is not None:
            self._select_rows(torch.arange(self.rk.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep only the rows ``indices`` (in that order)."""
        self._select_rows(torch.as_tensor(indices).long())

    def _select_rows(self, index: Tensor) -> None:
        def pick(t: Tensor | None) -> Tensor | None:
            return None if t is None else t.index_select(0, index.to(t.device))

        self.pk, self.pv, self.rk, self.rv = (pick(t) for t in (self.pk, self.pv, self.rk, self.rv))
        self.qk, self.qv = (None if q is None else QuantizedTensor(
            pick(q.packed), pick(q.scale), pick(q.zero), q.bits, q.group_size, q.dim, (index.numel(), *q.shape[1:]),  # type: ignore[arg-type]
            q.dtype) for q in (self.qk, self.qv))

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a quantized sink cache cannot be cropped")

    # ------------------------------------------------------------------ storage
    def _exact(self, x: Tensor) -> Tensor:
        """``x`` in the 16-bit storage dtype; a finite value that would overflow it raises."""
        y = x.to(self.exact_dtype)
        if y.dtype != x.dtype and bool(torch.isinf(y).any()) and bool(torch.isfinite(x).all()):
            raise InputError(f"a key/value of magnitude {float(x.abs().max()):.3g} overflows {self.exact_dtype} "
                             "storage; use exact_dtype=torch.bfloat16 (or torch.float32)")
        return y

    def _store(self, k: Tensor, v: Tensor) -> None:
        self.rk, self.rv = _cat(self.rk, self._exact(k)), _cat(self.rv, self._exact(v))  # (B, Hkv, ·, d) 16-bit
        self.seen += k.shape[-2]
        if not self.deferred:
            self._settle()

    @property
    def packed_tokens(self) -> int:
        """``N``: positions ``0 … N − 1`` are in packed blocks (holes included)."""
        return 0 if self.qk is None else self.qk.shape[-2]

    def _settle(self) -> None:
        """Pack the residual's oldest whole blocks of ``G`` beyond ``R``; protected tokens become exact holes."""
        start = self.packed_tokens
        n = (self.seen - start - self.residual) // self.group_size * self.group_size
        if n <= 0:
            return
        pos = torch.arange(start, start + n, device=self.rk.device)  # type: ignore[union-attr]  # (the residual holds them)
        keep = self.protect.mask(pos)  # (n,) protected positions among those packed now
        k, v = self.rk[:, :, :n], self.rv[:, :, :n]  # type: ignore[index]
        if bool(keep.any()):
            self.pk, self.pv = _cat(self.pk, k[:, :, keep]), _cat(self.pv, v[:, :, keep])
            self.p_pos = _cat(self.p_pos, pos[keep], 0)
            k = _fill_holes(k, keep, self.group_size)
        if self.window is not None:  # a sliding-window layer: what no later query sees needs no exact copy
            self._release_unseen()
        qk = quantize(k, self.bits, self.group_size, dim=-2, clip=self.clip)  # per channel over G tokens
        qv = quantize(v, self.bits, self.value_group, dim=-1, clip=self.clip)  # per token
        self.qk, self.qv = self._append(self.qk, qk), self._append(self.qv, qv)
        self.rk, self.rv = self.rk[:, :, n:], self.rv[:, :, n:]  # type: ignore[index]

    def _release_unseen(self) -> None:
        """Drop the exact copies of protected tokens that have left the layer's sliding window."""
        if self.p_pos is None:
            return
        stay = self.p_pos > self.seen - self.window  # type: ignore[operator]  # (a sliding-window layer)
        if bool(stay.all()):
            return
        self.pk, self.pv, self.p_pos = self.pk[:, :, stay], self.pv[:, :, stay], self.p_pos[stay]  # type: ignore[index]
        if not self.p_pos.numel():
            self.pk = self.pv = self.p_pos = None

    def defer_packing(self) -> None:
        """Hold every token stored from now on unpacked, until :meth:`protect_and_pack` (sinks measured during
        the prefill: the protection is only known once the prefill's attention has been seen)."""
        self.deferred = True

    def protect_and_pack(self, protect: Protection) -> None:
        """Adopt ``protect`` (for held and future tokens) and pack what is held, as if it had been known from the start."""
        self.protect, self.deferred = protect, False
        if self.rk is not None:
            self._settle()

    @staticmethod
    def _append(old: QuantizedTensor | None, new: QuantizedTensor) -> QuantizedTensor:
        if old is None:
            return new
        shape = list(old.shape)
        shape[-2] += new.shape[-2]
        return QuantizedTensor(torch.cat([old.packed, new.packed], -2), torch.cat([old.scale, new.scale], -2),
                               torch.cat([old.zero, new.zero], -2), old.bits, old.group_size, old.dim,
                               tuple(shape), old.dtype)

    def materialize(self) -> tuple[Tensor | None, Tensor | None]:
        """Everything stored, in position order: keys and values ``[B, Hkv, seen, d]`` (``None`` when empty)."""
        if not self.seen:
            return None, None
        return self._gather()

    def _gather(self, new_k: Tensor | None = None, new_v: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """What attention sees: the stored tokens in position order, then ``new_k``/``new_v`` ``[B, Hkv, C, d]``.

        One buffer each, written once: the packed blocks are dequantized straight into it (their holes then take
        the exact copies), the residual and the new tokens copied after them — no concatenation of the whole
        cache. With nothing stored yet, the new tokens themselves."""
        n_packed = self.packed_tokens
        n_res = 0 if self.rk is None else self.rk.shape[-2]
        if not n_packed and not n_res:
            assert new_k is not None and new_v is not None  # (materialize returns early on an empty layer)
            return new_k, new_v
        k_like, v_like = (self.qk, self.qv) if n_packed else (self.rk, self.rv)  # whichever part is held: its shape
        b, h, _, dk = k_like.shape  # type: ignore[union-attr]
        dv = v_like.shape[-1]  # type: ignore[union-attr]
        total = n_packed + n_res + (0 if new_k is None else new_k.shape[-2])
        keys = torch.empty(b, h, total, dk, dtype=self.dtype, device=self.device)
        values = torch.empty(b, h, total, dv, dtype=self.dtype, device=self.device)
        if n_packed:
            if self.dtype == torch.float32:  # float32 arithmetic straight into the buffer
                dequantize(self.qk, out=keys[:, :, :n_packed])  # type: ignore[arg-type]
                dequantize(self.qv, out=values[:, :, :n_packed])  # type: ignore[arg-type]
            else:  # a 16-bit model: computed in float32, rounded once
                keys[:, :, :n_packed] = dequantize(self.qk, self.dtype)  # type: ignore[arg-type]
                values[:, :, :n_packed] = dequantize(self.qv, self.dtype)  # type: ignore[arg-type]
        if n_packed and self.p_pos is not None:  # the holes: their exact copies
            keys[:, :, self.p_pos] = self.pk.to(self.dtype)  # type: ignore[union-attr]  # (kept with p_pos)
            values[:, :, self.p_pos] = self.pv.to(self.dtype)  # type: ignore[union-attr]
        if n_res:
            keys[:, :, n_packed:n_packed + n_res] = self.rk  # type: ignore[assignment]  # (n_res > 0: a tensor)
            values[:, :, n_packed:n_packed + n_res] = self.rv  # type: ignore[assignment]
        if new_k is not None and new_v is not None:
            keys[:, :, n_packed + n_res:] = new_k
            values[:, :, n_packed + n_res:] = new_v
        return keys, values

    # ------------------------------------------------------------------ accounting
    def nbytes(self) -> int:
        """Bytes held: packed codes, scales, zero points, protected and residual tokens (position ids excluded)."""
        total = sum(q.nbytes for q in (self.qk, self.qv) if q is not None)
        total += sum(t.numel() * t.element_size() for t in (self.pk, self.pv, self.rk, self.rv) if t is not None)
        return total

    def counts(self) -> dict[str, int]:
        """Tokens in each part: ``quantized`` (packed slots, holes included), ``protected`` (exact copies of
        packed protected tokens), ``residual`` (unquantized recent tokens)."""
        return {"quantized": self.packed_tokens, "protected": 0 if self.p_pos is None else self.p_pos.numel(),
                "residual": 0 if self.rk is None else self.rk.shape[-2]}


def _fill_holes(keys: Tensor, holes: Tensor, group: int) -> Tensor:
    """``keys`` ``[B, Hkv, n, d]`` with each hole (``holes`` ``[n]``) replaced by the smallest key of the other
    tokens of its block of ``group`` in each channel (0 in a block of holes only): inside the block's range."""
    blocks = keys.unflatten(-2, (-1, group))  # (B, Hkv, n/G, G, d)
    h = holes.view(-1, group, 1)  # (n/G, G, 1)
    lo = torch.where(h, torch.inf, blocks.float()).amin(-2, keepdim=True)  # (B, Hkv, n/G, 1, d)
    lo = torch.where(torch.isinf(lo), 0.0, lo).to(keys.dtype)
    return torch.where(h, lo, blocks).flatten(-3, -2)


def quantized_sink_cache(model: nn.Module, bits: int = 4, protect: Protection | None = None, *, group_size: int = 64,
                         residual: int = 32, exact_dtype: torch.dtype | None = None,
                         value_group: int | None = None, clip: bool | None = None) -> Cache:
    """A transformers ``Cache`` of :class:`DynamicQuantizedSinkLayer`, one per decoder layer of ``model``.

    A layer of the model's own sliding-window attention (``layer_types``/``sliding_window`` in the config: Gemma 3's
    local layers, Mistral) gets its window: it keeps a protected token exact only while a later query can see it.

    >>> cache = quantized_sink_cache(model, bits=4, protect=Protection(first=4))   # doctest: +SKIP
    >>> model(input_ids=ids, past_key_values=cache)                               # doctest: +SKIP
    """
    from ..checks import check_model

    check_model(model, "quantized_sink_cache")
    if protect is not None and not isinstance(protect, Protection):
        raise InputError(f"protect is a sinklab.kvquant.Protection (or None), got {protect!r}")
    n = len(_compat.find_layers(model))
    try:
        windows = _compat.layer_sliding_windows(model)
    except UnsupportedModelError:  # other attention types (chunked, linear): no window is assumed
        windows = []
    windows = windows if len(windows) == n else [None] * n
    return Cache(layers=[DynamicQuantizedSinkLayer(bits, group_size, residual, protect, exact_dtype, value_group, w,
                                                   clip) for w in windows])


def kv_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(layers, kv_heads, head_dim)`` of ``model``'s KV cache."""
    cfg: Any = _compat.config_get(model.config, "text_config", default=None) or model.config
    heads = _compat.config_get(cfg, "num_attention_heads")
    kv = _compat.config_get(cfg, "num_key_value_heads", default=heads) or heads
    dh = _compat.config_get(cfg, "head_dim", default=None) or cfg.hidden_size // heads
    return len(_compat.find_layers(model)), kv, dh


def dense_bytes_per_token(model: nn.Module, bytes_per_element: int = 2) -> int:
    """Bytes one token takes in an unquantized KV cache of ``bytes_per_element`` (2: a 16-bit cache)."""
    layers, kv, dh = kv_shape(model)
    return 2 * layers * kv * dh * bytes_per_element
