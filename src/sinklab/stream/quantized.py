"""``QuantizedSinkWindowLayer``: a stream layer whose window is stored packed; sinks and pinned spans stay exact.

``SinkCache(model, kv_bits=4)`` builds these: the ring of ``W`` window tokens is one packed tensor
``[B, Hkv, W, dk + dv]`` (:mod:`sinklab.kvquant.codec`, groups per token), dequantized each forward into a buffer the
stream's layers share; the parent layer updates it and what it wrote is packed (a decode step's columns set aside and
packed together by the next forward). docs/kv-quant.md ("Streaming form").
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from ..kvquant.codec import QuantizedTensor, dequantize, packed_width, quantize
from ..rope import rotate
from .layer import SinkWindowLayer
from .state import ChunkPlan, DecodePlan, StepPlan, StreamState, UniformStepPlan

__all__ = ["QuantizedSinkWindowLayer"]


class PackShared:
    """What the quantized layers of one stream share (kept apart from the stream's position state): the one
    dequantization buffer, keyed by shape, and the decoded columns set aside in a uniform decode step (packed
    before any ring is read)."""

    def __init__(self) -> None:
        self.scratch: dict = {}
        self.pending: list = []
        self.pending_plan: StepPlan | None = None


class QuantizedSinkWindowLayer(SinkWindowLayer):
    """A :class:`SinkWindowLayer` with a ``bits``-bit packed ring (groups of ``group_size`` channels per token; both
    checked by the :class:`~sinklab.stream.config.StreamConfig`)."""

    is_compileable = False

    def __init__(self, state: StreamState, rope, bits: int, group_size: int, *,
                 rotates_values: bool = False, shared: PackShared | None = None) -> None:
        super().__init__(state, rope, rotates_values=rotates_values)
        self.bits, self.group_size = bits, group_size
        self.shared = shared if shared is not None else PackShared()
        self._parts: tuple | None = None  # (ring, its key and value views)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, hkv, _, dh = key_states.shape
        dv = value_states.shape[-1]
        self.group = min(self.group_size, dh, dv)
        if dh % self.group or dv % self.group:
            raise InputError(f"head widths {dh}/{dv} are not multiples of the kv group size {self.group}")
        if packed_width(dh, self.bits) * 8 != dh * self.bits:
            raise InputError(f"a head width of {dh} does not pack into whole words at {self.bits} bits")
        self.dh = dh
        n, cap = self.state.anchor_capacity, self.state.capacity
        self.device, self.dtype = key_states.device, key_states.dtype
        self._bind_buffer(b, hkv, dh, dv)
        self.anchor_keys = torch.zeros(b, hkv, n, dh, dtype=key_states.dtype, device=key_states.device)
        self.anchor_values = torch.zeros(b, hkv, n, dv, dtype=value_states.dtype, device=value_states.device)
        ring = torch.zeros(b, hkv, cap - n, dh + dv, dtype=key_states.dtype, device=key_states.device)
        self.ring = quantize(ring, self.bits, self.group, dim=-1)  # (B, Hkv, W, dk + dv) packed
        self.is_initialized = True

    def _bind_buffer(self, b: int, hkv: int, dh: int, dv: int) -> None:
        """Point ``keys``/``values`` at the two halves of the stream's shared ``[B, Hkv, S + P + W, dk + dv]``
        buffer (made once)."""
        shared = self.shared.scratch
        key = (b, hkv, self.state.capacity, dh, dv, self.dtype, self.device)
        if key not in shared:  # one tensor, a token's key then its value: the ring's layout (one dequantization)
            shared[key] = torch.zeros(b, hkv, self.state.capacity, dh + dv, dtype=self.dtype, device=self.device)
        self.kv = shared[key]
        self.keys, self.values = self.kv[..., :dh], self.kv[..., dh:]

    def _ring_parts(self) -> tuple[QuantizedTensor, QuantizedTensor]:
        """The packed ring's key and value columns as two quantized views ``[B, Hkv, W, d]`` (no copy; made
        once per ring tensor — every write to the ring is in place)."""
        if self._parts is not None and self._parts[0] is self.ring:
            return self._parts[1]
        r, width, groups = self.ring, packed_width(self.dh, self.bits), self.dh // self.group
        b, hkv, w, total = r.shape
        parts = tuple(QuantizedTensor(r.packed[..., cut], r.scale[..., gcut], r.zero[..., gcut], r.bits,
                                      r.group_size, r.dim, (b, hkv, w, d), r.dtype)
                      for cut, gcut, d in ((slice(None, width), slice(None, groups), self.dh),
                                           (slice(width, None), slice(groups, None), total - self.dh)))
        self._parts = (r, parts)
        return parts  # type: ignore[return-value]

    def store(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """Dequantize the ring into the shared buffer, let the parent update it, pack what it wrote."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.shared.pending_plan is not self.state.plan:  # the first layer of this forward
            self._flush()
        n = self.state.anchor_capacity
        dequantize(self.ring, out=self.kv[:, :, n:])  # keys and values together (groups never straddle them)
        if n:
            self.values[:, :, :n] = self.anchor_values
        out = super().store(key_states, value_states)
        plan = self.state.plan
        if isinstance(plan, UniformStepPlan):  # the host already knows: every row a real window token in one slot
            self._set_aside(plan)
        elif isinstance(plan, DecodePlan):
            self._pack_step(plan, key_states[:, :, 0], value_states[:, :, 0])
        elif isinstance(plan, ChunkPlan):
            self._pack_chunk(plan)
        return out

    def _set_aside(self, plan: UniformStepPlan) -> None:
        """The usual decode step — every row a window token in one slot, no read-back — sets the new column aside
        (``shared.pending``); the next ring read or forward packs every layer's pending columns at once."""
        self.shared.pending.append((self, self.kv.index_select(2, plan.slot), plan.ring_slot))  # (B, Hkv, 1, D)
        self.shared.pending_plan = plan

    def _pack_step(self, plan: DecodePlan, k: Tensor, v: Tensor) -> None:
        """One decoded column ``[B, Hkv, d]``, rows that may differ: each row's slot (padding and anchored rows keep
        the ring as it was; an anchored row writes its value instead). Whether any row is padding or anchored is
        read once per forward (the plan keeps it for every layer)."""
        n = self.state.anchor_capacity
        rows, at, keep = plan.rows, plan.ring_slot, plan.ring_keep
        new = quantize(torch.cat([k, v], -1), self.bits, self.group, dim=-1)  # (B, Hkv, dk + dv) per token
        for stored, x in ((self.ring.packed, new.packed), (self.ring.scale, new.scale), (self.ring.zero, new.zero)):
            stored[rows, :, at] = x if keep is None else torch.where(keep, stored[rows, :, at], x)
        if plan.any_anchored:
            slot = plan.slot.clamp(max=n - 1)
            anchored = plan.anchored[:, None, None]
            self.anchor_values[rows, :, slot] = torch.where(anchored, v, self.anchor_values[rows, :, slot])

    def _flush(self) -> None:
        """Pack the columns the layers of this stream left pending in their last uniform decode step: one
        quantization for all of them (the same codes as one per layer: groups are per token), then three
        ``index_copy_`` writes into each layer's ring. Runs before anything reads a ring."""
        pending = self.shared.pending
        if not pending:
            return
        self.shared.pending, self.shared.pending_plan = [], None
        by_shape: dict = {}
        for layer, column, at in pending:
            by_shape.setdefault((column.shape, layer.bits, layer.group), []).append((layer, column, at))
        for (_, bits, group), items in by_shape.items():
            new = quantize(torch.stack([column for _, column, _ in items]), bits, group, dim=-1)  # (L, B, Hkv, 1, D)
            for i, (layer, _, at) in enumerate(items):
                for stored, x in ((layer.ring.packed, new.packed), (layer.ring.scale, new.scale),
                                  (layer.ring.zero, new.zero)):
                    stored.index_copy_(2, at, x[i])

    def _pack_chunk(self, plan: ChunkPlan) -> None:
        """A chunk: the buffer slots ``(rows, slots)`` it wrote, anchored ones as values, ring ones packed."""
        n = self.state.anchor_capacity
        rows, slots = plan.rows, plan.slots
        anchored = slots < n
        if bool(anchored.any()):
            r, s = rows[anchored], slots[anchored]
            self.anchor_values[r, :, s] = self.values[r, :, s]
        ring = ~anchored
        if bool(ring.any()):
            r, s = rows[ring], slots[ring]
            kv = torch.cat([self.keys[r, :, s], self.values[r, :, s]], -1)  # (N, Hkv, dk + dv)
            new = quantize(kv, self.bits, self.group, dim=-1)
            for stored, x in ((self.ring.packed, new.packed), (self.ring.scale, new.scale), (self.ring.zero, new.zero)):
                stored[r, :, s - n] = x

    def rotate_ring(self, ring: slice, delta: Tensor) -> None:
        """Re-base: dequantize the ring's keys, rotate them by ``delta`` ``[B]`` positions, pack them again."""
        if self.is_initialized and self.rope is not None:
            self._flush()
            shift = delta.to(self.device)[:, None, None]  # (B, 1, 1) broadcast over heads and slots
            keys = rotate(dequantize(self._ring_parts()[0]), self.rope, shift)  # (B, Hkv, W, dk)
            new = quantize(keys, self.bits, self.group, dim=-1)
            width, groups = packed_width(self.dh, self.bits), self.dh // self.group
            self.ring.packed[..., :width] = new.packed
            self.ring.scale[..., :groups] = new.scale
            self.ring.zero[..., :groups] = new.zero

    def select_rows(self, index: Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` (beams, ``num_return_sequences``): packed ring and anchors."""
        if self.is_initialized:
            self._flush()
            index = index.to(self.device)
            self.anchor_keys, self.anchor_values = (t.index_select(0, index) for t in (self.anchor_keys,
                                                                                     self.anchor_values))
            r = self.ring
            self.ring = QuantizedTensor(r.packed.index_select(0, index), r.scale.index_select(0, index),
                                        r.zero.index_select(0, index), r.bits, r.group_size, r.dim,
                                        (index.numel(), *r.shape[1:]), r.dtype)
            self._bind_buffer(index.numel(), r.shape[1], self.dh, self.anchor_values.shape[-1])

    def nbytes(self) -> int:
        """Bytes this layer holds: packed ring (codes, scales, zero points) + exact anchored keys and values."""
        exact = sum(t.numel() * t.element_size() for t in (self.anchor_keys, self.anchor_values))
        return self.ring.nbytes + exact

    def dequantized_ring(self) -> tuple[Tensor, Tensor]:
        """The window as stored: keys (rotated at their virtual positions) and values ``[B, Hkv, W, d]``."""
        self._flush()
        ring_k, ring_v = self._ring_parts()
        return dequantize(ring_k), dequantize(ring_v)

    # ------------------------------------------------------------------ construction and persistence
    @classmethod
    def for_stream(cls, state: StreamState, spec) -> QuantizedSinkWindowLayer:
        """The layer :func:`sinklab.stream.cache.build_layers` makes for ``spec`` (its stream's layers share one
        :class:`PackShared`)."""
        config = spec.config
        return cls(state, state.rope, config.kv_bits, config.kv_group_size,
                   rotates_values=spec.rotation.rotated == "values",
                   shared=spec.shared.setdefault(id(state), PackShared()))

    def state_dict(self) -> dict:
        """The packed ring, the exact anchors and the key head width (empty before the first forward)."""
        if not self.is_initialized:
            return {}
        self._flush()
        return {"ring_packed": self.ring.packed, "ring_scale": self.ring.scale, "ring_zero": self.ring.zero,
                "anchor_keys": self.anchor_keys, "anchor_values": self.anchor_values, "head_dim": self.dh}

    def load_state_dict(self, saved: dict) -> None:
        """Inverse of :meth:`state_dict`."""
        if not saved:
            return
        packed, scale, dh = saved["ring_packed"], saved["ring_scale"], int(saved["head_dim"])
        self.anchor_keys, self.anchor_values = saved["anchor_keys"], saved["anchor_values"]
        self.device, self.dtype, self.dh = packed.device, self.anchor_keys.dtype, dh
        b, hkv, w, _ = scale.shape
        self.group = min(self.group_size, dh, self.anchor_values.shape[-1])
        width = scale.shape[-1] * self.group
        self.ring = QuantizedTensor(packed, scale, saved["ring_zero"], self.bits, self.group, 3, (b, hkv, w, width),
                                    self.dtype)
        self._bind_buffer(b, hkv, dh, width - dh)
        self.is_initialized = True
