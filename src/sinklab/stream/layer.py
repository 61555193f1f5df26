"""``SinkWindowLayer``: a transformers cache *layer* holding sinks, pinned spans and a ring-buffer window, preallocated
``[B, Hkv, S + P + W, dh]``; a decoded token is written into its slot and the buffer itself handed to attention, a
chunk is attended over ``buffer ⧺ chunk`` and then written (docs/stream.md, "How it works").
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers.cache_utils import CacheLayerMixin

from ..errors import InputError
from ..rope import RopeSpec, pair_partner, rotate, rotate_pairs
from .state import ChunkPlan, DecodePlan, StepPlan, StreamBudget, StreamState, UniformStepPlan, buffers_that_fit
from .views import DecodeView

__all__ = ["SinkWindowLayer", "StreamLayerBase"]


class StreamLayerBase(CacheLayerMixin):
    """What every cache layer of a stream shares: the stream's column count, no maximum length, and the row and
    crop operations that belong to the whole stream (called on the :class:`~sinklab.stream.SinkCache`)."""

    is_croppable = True  # until the stream evicts (SinkCache.crop says why not after)
    is_sliding = False
    state: StreamBudget  # shared by every layer of the stream (set by the subclass)
    # the buffers, allocated by lazy_initialization before any read (None until then, as in CacheLayerMixin)
    keys: Tensor
    values: Tensor
    row_buffers: tuple[str, ...] = ()  # the per-row tensors (first dimension B), by attribute name
    saved_buffers: tuple[str, ...] = ()  # what state_dict holds

    def select_rows(self, index: Tensor) -> None:
        """Row ``i`` becomes old row ``index[i]`` (the stream state is re-indexed by the cache, once)."""
        if self.is_initialized:
            index = index.to(self.keys.device)
            for name in self.row_buffers:
                setattr(self, name, getattr(self, name).index_select(0, index))
            self._replaced()

    def state_dict(self) -> dict[str, Tensor]:
        """The buffers (empty before the first forward); :meth:`load_state_dict` puts them back."""
        return {name: getattr(self, name) for name in self.saved_buffers} if self.is_initialized else {}

    def load_state_dict(self, saved: dict[str, Tensor]) -> None:
        if saved:
            for name in self.saved_buffers:
                setattr(self, name, saved[name])
            self.device, self.dtype = self.keys.device, self.keys.dtype
            self.is_initialized = True
            self._replaced()

    def _replaced(self) -> None:
        """Called after the buffers were replaced (rows selected, a stream loaded)."""

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.state.columns

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the mask transformers builds for the next forward: a mask of the model's own
        (``generate()`` prepares the first forward's) then ends with the new tokens on its diagonal, where
        ``SinkCache.plan_forward`` reads which are real; a fixed size inside a compiled forward."""
        q = query_length if isinstance(query_length, int) else 1
        if torch.compiler.is_compiling():
            return self.state.capacity + q, 0
        past = min(self.state.columns, self.state.capacity)
        return past + q, self.state.columns - past

    def get_max_length(self) -> int:
        return -1  # the stream is unbounded; the memory is bounded by S + P + W

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:  # pragma: no cover - streams are started afresh instead
        raise NotImplementedError("a SinkCache cannot be reset; create a new SinkCache")

    def _per_stream(self, name: str):
        raise InputError(f"{name} changes state that all layers of a stream share: call it on the SinkCache "
                         f"(cache.{name}(...)), not on one of its layers")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._per_stream("reorder_cache")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._per_stream("batch_repeat_interleave")

    def batch_select_indices(self, indices: Tensor) -> None:
        self._per_stream("batch_select_indices")

    def crop(self, tokens_to_remove: int) -> None:
        self._per_stream("crop")


class SinkWindowLayer(StreamLayerBase):
    """One layer's StreamingLLM cache; all layers of a stream share one :class:`StreamState`."""

    is_compileable = True
    state: StreamState
    row_buffers = saved_buffers = ("keys", "values", "anchor_keys")

    def __init__(self, state: StreamState, rope: RopeSpec | None, *, rotates_values: bool = False) -> None:
        super().__init__()
        self.state = state
        self.rope = rope  # None: the layer's keys carry no position (NoPE), nothing is re-rotated
        # Latent attention (DeepSeek V2/V3, MiniCPM3 …) hands its cache the compressed latent as "keys" and the
        # decoupled rotary key as "values": the layer stores them swapped, so ``keys`` is always what rotates.
        self.rotates_values = bool(rotates_values)
        self._partner: tuple | None = None  # (anchor_keys, their partner dimensions): eager decode steps
        state.layers.append(self)

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        b, hkv, _, dh = key_states.shape
        cap = self.state.capacity
        self.device = key_states.device
        self.dtype = key_states.dtype
        with buffers_that_fit(cap):
            self.keys = torch.zeros(b, hkv, cap, dh, dtype=key_states.dtype, device=key_states.device)
            self.values = torch.zeros(b, hkv, cap, value_states.shape[-1], dtype=value_states.dtype,
                                      device=value_states.device)
        # Anchored keys as first rotated; the buffer's anchored slots hold them re-rotated for the current query.
        self.anchor_keys = torch.zeros(b, hkv, self.state.anchor_capacity, dh, dtype=key_states.dtype,
                                       device=key_states.device)
        self.mark_static()
        self.is_initialized = True

    def mark_static(self) -> None:
        """Tell torch.compile the buffers keep their address while written in place (as transformers' StaticCache
        does), so CUDA graphs replay over them; called again whenever the buffers are replaced."""
        if not torch.compiler.is_compiling():
            for t in (self.keys, self.values, self.anchor_keys):
                torch._dynamo.mark_static_address(t)

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        """Store the new keys/values; return what attention should see (the buffer, or buffer ⧺ chunk)."""
        if self.rotates_values:
            values, keys = self.store(value_states, key_states)
            return keys, values
        return self.store(key_states, value_states)

    def store(self, key_states: Tensor, value_states: Tensor) -> tuple[Tensor, Tensor]:
        """:meth:`update` with ``key_states`` the tensor that rotates with position."""
        if self.state.closed:
            raise InputError("this SinkCache was closed; create a new one")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        plan, view = self.state.plan, self.state.view
        assert plan is not None  # planned by the state before any layer runs
        n = self.state.anchor_capacity
        if isinstance(view, DecodeView):  # decode: attention reads the buffer itself
            self._write(key_states, value_states, plan)
            if n and view.anchor_c is not None and view.anchor_s is not None:
                self.keys[:, :, :n] = self._anchors_rotated(view.anchor_c, view.anchor_s)
            return self.keys, self.values
        keys = torch.cat([self.anchor_keys, self.keys[:, :, n:], key_states], dim=-2)
        values = torch.cat([self.values, value_states], dim=-2)
        self._write(key_states, value_states, plan)
        return keys, values

    def _anchors_rotated(self, c: Tensor, s: Tensor) -> Tensor:
        """The anchored keys rotated by the step's factors (:func:`sinklab.rope.rotate_pairs`); eagerly, their partner
        dimensions are kept between steps while the anchored keys do not change."""
        keys, interleaved, offset = self.anchor_keys, self.rope.interleaved, self.rope.offset  # type: ignore[union-attr]
        if torch.compiler.is_compiling():
            return rotate_pairs(keys, c, s, interleaved, offset=offset)
        if self._partner is None or self._partner[0] is not keys:  # dropped by every write to the anchored keys
            rotated = keys[..., offset : offset + c.shape[-1]].to(c.dtype)
            self._partner = (keys, pair_partner(rotated, interleaved))
        return rotate_pairs(keys, c, s, interleaved, partner=self._partner[1], offset=offset)

    def _write(self, key_states: Tensor, value_states: Tensor, plan: StepPlan) -> None:
        if isinstance(plan, UniformStepPlan):  # decode, every row a real free token in the same slot: one copy
            self.keys.index_copy_(2, plan.slot, key_states)
            self.values.index_copy_(2, plan.slot, value_states)
        elif isinstance(plan, DecodePlan):
            self._write_step(key_states[:, :, 0], value_states[:, :, 0], plan)
        else:
            self._write_chunk(key_states, value_states, plan)

    def _write_step(self, k: Tensor, v: Tensor, plan: DecodePlan) -> None:
        """Decode: one column ``[B, Hkv, d]``, each row's own slot (fixed shapes: compiled as one graph)."""
        rows, slot = plan.rows, plan.slot
        keep = ~plan.valid[:, None, None]  # a padding column writes nothing
        self.keys[rows, :, slot] = torch.where(keep, self.keys[rows, :, slot], k)
        self.values[rows, :, slot] = torch.where(keep, self.values[rows, :, slot], v)
        n = self.state.anchor_capacity
        if n:
            at = slot.clamp(max=n - 1)
            anchored = plan.anchored[:, None, None]
            self.anchor_keys[rows, :, at] = torch.where(anchored, k, self.anchor_keys[rows, :, at])
            self._partner = None

    def _write_chunk(self, key_states: Tensor, value_states: Tensor, plan: ChunkPlan) -> None:
        """A chunk: its columns ``(rows, cols)`` into their ``slots``; anchored ones also as first rotated."""
        rows, cols, slots = plan.rows, plan.cols, plan.slots
        if rows.numel():
            self.keys[rows, :, slots] = key_states[rows, :, cols]
            self.values[rows, :, slots] = value_states[rows, :, cols]
            anchored = slots < self.state.anchor_capacity
            if bool(anchored.any()):
                r, c, sl = rows[anchored], cols[anchored], slots[anchored]
                self.anchor_keys[r, :, sl] = key_states[r, :, c]
                self._partner = None

    def _replaced(self) -> None:
        self._partner = None
        self.mark_static()

    def rotate_ring(self, ring: slice, delta: Tensor) -> None:
        """Rotate the ring's keys by ``delta`` ``[B]`` positions (used when the stream re-bases)."""
        if self.is_initialized and self.rope is not None:
            shift = delta.to(self.keys.device)[:, None, None]  # (B, 1, 1) broadcast over heads and slots
            self.keys[:, :, ring] = rotate(self.keys[:, :, ring], self.rope, shift)

    # ------------------------------------------------------------------ construction and persistence
    @classmethod
    def for_stream(cls, state: StreamState, spec) -> SinkWindowLayer:
        """The layer :func:`sinklab.stream.cache.build_layers` makes for ``spec`` (a ``LayerSpec``)."""
        return cls(state, state.rope, rotates_values=spec.rotation.rotated == "values")

