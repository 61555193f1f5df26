"""``QuantizedSinkWindowLayer``: a stream layer whose window is stored packed; sinks and pinned spans stay exact.

``SinkCache(model, kv_bits=4)`` builds these instead of :class:`~sinklab.stream.layer.SinkWindowLayer`.
What is stored per layer:

* anchored tokens (sinks, pinned spans): keys as first rotated and values, in the model's dtype, never
  quantized — bit-exact through eviction and re-basing;
* the ring of ``W`` window tokens: packed codes with a float16 scale and zero point per token and group of
  ``G`` channels, for keys and values alike (:mod:`sinklab.kvquant.codec`). Keys are quantized **per token**
  here, not per channel over blocks as in the dense cache (KIVI): the ring overwrites one slot at a time in
  each row, so a per-channel block would mix evicted and live tokens.

At each forward the layer unpacks its ring into one full-precision buffer shared by every layer of the
stream (layers run one after the other), hands it to the parent layer's update, and packs the slots that
update wrote. So the window costs ``bits`` per element plus metadata per layer, plus one ``[B, Hkv, S + P + W, d]``
buffer for the whole model; each forward pays one unpack of ``W`` tokens per layer. A re-base rotates the
ring's keys: they are unpacked, rotated and packed again (the anchored keys are not touched).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from ..kvquant.codec import BITS, dequantize, quantize
from ..rope import rotate
from .layer import SinkWindowLayer
from .state import StreamState

__all__ = ["QuantizedSinkWindowLayer"]


class QuantizedSinkWindowLayer(SinkWindowLayer):
    """A :class:`SinkWindowLayer` with a ``bits``-bit packed ring (groups of ``group_size`` channels per token)."""

    is_compileable = False

    def __init__(self, state: StreamState, rope, bits: int = 4, group_size: int = 16) -> None:
        if bits not in BITS:
            raise InputError(f"kv_bits must be one of {BITS} (or None for full precision), got {bits!r}")
        if group_size < 1:
            raise InputError(f"kv_group_size must be ≥ 1, got {group_size}")
        super().__init__(state, rope)
        self.bits, self.group_size = bits, group_size

    def select_rows(self, index: Tensor) -> None:
        raise InputError("beams, num_return_sequences and row selection are not supported with kv_bits (the packed "
                         "ring is not re-indexed); use SinkCache(..., kv_bits=None) for them")

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, hkv, _, dh = key_states.shape
        dv = value_states.shape[-1]
        self.group = min(self.group_size, dh, dv)
        if dh % self.group or dv % self.group:
            raise InputError(f"head widths {dh}/{dv} are not multiples of the kv group size {self.group}")
        n, cap = self.state.anchor_capacity, self.state.capacity
        self.device, self.dtype = key_states.device, key_states.dtype
        shared = self.state.__dict__.setdefault("kv_scratch", {})
        key = (b, hkv, cap, dh, dv, key_states.dtype, key_states.device)
        if key not in shared:
            shared[key] = (torch.zeros(b, hkv, cap, dh, dtype=key_states.dtype, device=key_states.device),
                           torch.zeros(b, hkv, cap, dv, dtype=value_states.dtype, device=value_states.device))
        self.keys, self.values = shared[key]
        self.anchor_keys = torch.zeros(b, hkv, n, dh, dtype=key_states.dtype, device=key_states.device)
        self.anchor_values = torch.zeros(b, hkv, n, dv, dtype=value_states.dtype, device=value_states.device)
        w = cap - n
        self.ring_k = quantize(torch.zeros(b, hkv, w, dh, dtype=key_states.dtype), self.bits, self.group, dim=-1)
        self.ring_v = quantize(torch.zeros(b, hkv, w, dv, dtype=value_states.dtype), self.bits, self.group, dim=-1)
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Unpack the ring into the shared buffer, let the parent update it, pack the slots it wrote."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = self.state.anchor_capacity
        self.keys[:, :, n:] = dequantize(self.ring_k)
        self.values[:, :, n:] = dequantize(self.ring_v)
        if n:
            self.values[:, :, :n] = self.anchor_values
        out = super().update(key_states, value_states, *args, **kwargs)
        slot = self.state.plan.get("slot")
        if isinstance(slot, int):  # one token, the same slot in every row: plain slicing, no index tensors
            if slot < n:
                self.anchor_values[:, :, slot] = value_states[:, :, 0]
            else:
                self._pack(slice(None), slot - n, key_states[:, :, 0], value_states[:, :, 0])
            return out
        rows, slots = self._written(self.state.plan, key_states.shape[0])
        anchored = slots < n
        if bool(anchored.any()):
            r, s = rows[anchored], slots[anchored]
            self.anchor_values[r, :, s] = self.values[r, :, s]
        ring = ~anchored
        if bool(ring.any()):
            r, s = rows[ring], slots[ring]
            self._pack(r, s - n, self.keys[r, :, s], self.values[r, :, s])  # (N, Hkv, d) each
        return out

    @staticmethod
    def _written(plan: dict, batch: int) -> tuple[Tensor, Tensor]:
        """``(rows, slots)`` ``[N]`` of the buffer slots this forward wrote (every plan layout of the stream)."""
        if "cols" in plan:
            return plan["rows"], plan["slots"]
        slot = plan["slot"]
        if isinstance(slot, int):
            rows = torch.arange(batch)
            return rows, torch.full_like(rows, slot)
        rows = plan.get("rows", torch.arange(batch, device=slot.device))
        valid = plan.get("valid")
        return (rows, slot) if valid is None else (rows[valid], slot[valid])

    def _pack(self, rows: Tensor | slice, ring_slots: Tensor | int, k: Tensor, v: Tensor) -> None:
        for q, x in ((self.ring_k, k), (self.ring_v, v)):
            new = quantize(x, self.bits, self.group, dim=-1)  # per token: (N, Hkv, ·)
            q.packed[rows, :, ring_slots] = new.packed
            q.scale[rows, :, ring_slots] = new.scale
            q.zero[rows, :, ring_slots] = new.zero

    def rotate_ring(self, ring: slice, delta: Tensor) -> None:
        """Re-base: unpack the ring's keys, rotate them by ``delta`` ``[B]`` positions, pack them again."""
        if self.is_initialized:
            shift = delta.to(self.device)[:, None, None]  # (B, 1, 1) broadcast over heads and slots
            self.ring_k = quantize(rotate(dequantize(self.ring_k), self.rope, shift), self.bits, self.group, dim=-1)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("beam search is not supported by SinkCache(kv_bits=...); use kv_bits=None")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("num_return_sequences > 1 is not supported by SinkCache(kv_bits=...)")

    def batch_select_indices(self, indices: Tensor) -> None:
        raise NotImplementedError("selecting batch rows is not supported by SinkCache(kv_bits=...)")

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("a SinkCache(kv_bits=...) cannot be cropped")

    def nbytes(self) -> int:
        """Bytes this layer holds: packed ring (codes, scales, zero points) + exact anchored keys and values."""
        exact = sum(t.numel() * t.element_size() for t in (self.anchor_keys, self.anchor_values))
        return self.ring_k.nbytes + self.ring_v.nbytes + exact

    def dequantized_ring(self) -> tuple[Tensor, Tensor]:
        """The window as stored: keys (rotated at their virtual positions) and values ``[B, Hkv, W, d]``."""
        return dequantize(self.ring_k), dequantize(self.ring_v)
