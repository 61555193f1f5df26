"""What the stream attention of one forward reads, and the attention each kind of forward runs.

The stream state works out a *view* once per forward for every layer that shares it. A decode step
(:class:`DecodeView`) attends over the buffer itself, its anchored slots re-rotated in place; a prefill chunk
(:class:`ChunkView`) attends over ``buffer ⧺ chunk``, each anchored key scored at its slot distance from each query
as an extra column (:class:`~sinklab.attention.Columns`), in one softmax with the window. The maths is
:func:`sinklab.attention.attend`; a score-based policy's view is :class:`sinklab.stream.scored.ScoredView`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..attention import AttendSpec, Columns, attend, rotated_key_scores, soft_cap
from ..rope import RopeSpec, rotate
from ..variants import variant_column_logits, variant_gate, variant_has_columns

__all__ = ["ChunkLayout", "ChunkView", "DecodeView", "StreamCall", "View"]


@dataclass
class StreamCall:
    """One call of the stream attention: the attention module, the cache, the scores' scale, the model's logit cap
    and its own learned sink logits (``s_aux``), read once."""

    module: nn.Module
    stream: Any
    scale: float
    softcap: float | None = None
    s_aux: Tensor | None = None

    @property
    def layer(self) -> Any:
        """The cache layer of this attention (the module's ``layer_idx``; the first without one)."""
        index = getattr(self.module, "layer_idx", None)
        return self.stream.layers[index if index is not None else 0]

    @property
    def plain(self) -> bool:
        """No softcap and no column (model sink, variant sink or kv-bias slot): one fused call in the model's dtype."""
        return self.softcap is None and self.s_aux is None and not variant_has_columns(self.module)


class View(Protocol):
    """What every stream view does: attend ``query`` ``[B, H, C, dh]`` over the keys/values its layer handed over,
    ``[B, H, C, dv]`` out (float32, or the model's dtype on the fused decode path)."""

    def attend(self, call: StreamCall, query: Tensor, key: Tensor, value: Tensor) -> Tensor: ...


@dataclass
class _Queries:
    """The queries of one forward: ``q_a``/``q_f``/``q_v`` ``[B, C]`` (anchored and free tokens seen so far, virtual
    position), the stream's window ``W`` and ``rope``, how the key the attention receives turns (None: NoPE)."""

    q_a: Tensor
    q_f: Tensor
    q_v: Tensor
    window: int
    rope: RopeSpec | None
    _slot_shift: Tensor | None = field(default=None, init=False, repr=False)

    @property
    def slot_shift(self) -> Tensor:
        """Rotation taking each query from its virtual position to its own cache-slot position (kept tokens it
        sees − 1), ``[B, C]``. Only a kv-bias slot's score needs it: worked out on first use, once per forward."""
        if self._slot_shift is None:
            self._slot_shift = self.q_a + torch.clamp(self.q_f, max=self.window) - 1 - self.q_v
        return self._slot_shift

    def learned_columns(self, call: StreamCall, q: Tensor) -> list[Columns]:
        """A sinklab variant's columns (:data:`sinklab.variants.VARIANTS`), or the model's own learned sinks; a kv-bias
        slot is scored with the query at its own cache-slot position, not at its virtual one."""
        def slot_query() -> Tensor:
            return rotate(q, self.rope, self.slot_shift[:, None, :]) if self.rope is not None else q

        return variant_column_logits(call.module, q, call.scale, slot_query=slot_query, softcap=call.softcap,
                                     model_sink=call.s_aux)


@dataclass
class DecodeView(_Queries):
    """A decode step: the keys are the buffer itself; ``visible`` ``[B, K]``; ``anchor_c``/``anchor_s`` the anchored
    keys' rotation to their slot distance (:func:`sinklab.rope.rotate_pairs` factors, applied by the layers; None
    without RoPE or anchors); ``all_visible``: known on the host that every slot is visible (no mask needed)."""

    visible: Tensor
    anchor_c: Tensor | None = None
    anchor_s: Tensor | None = None
    all_visible: bool = False

    def attend(self, call: StreamCall, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Every visible slot is a plain key (anchored slots were re-rotated in place)."""
        # (B, 1, 1, K); eagerly none at all once every slot is visible (a compiled graph keeps one form)
        visible = None if not torch.compiler.is_compiling() and self.all_visible else self.visible[:, None, None, :]
        gate = variant_gate(call.module, query.shape[1])  # (B, C, H, dv | 1) or None
        if call.plain:  # in the model's dtype
            return attend(query, key, value, visible, AttendSpec(scale=call.scale, gate=gate, fast=True))
        q = query.float()
        spec = AttendSpec(scale=call.scale, softcap=call.softcap, gate=gate, columns=self.learned_columns(call, q))
        return attend(q, key.float(), value.float(), visible, spec)


@dataclass
class ChunkLayout:
    """What the queries of one prefill chunk attend over, the same in every layer that shares a stream state."""

    visible: Tensor  # (B, C, K') the sequence keys each query sees (moved anchored keys and unseen slots out)
    keep: Tensor | None  # the K' key positions kept (None: all)
    anchor_shift: Tensor | None  # (B, C, nA) rotation of each anchored key to its slot distance; None: none moves
    anchor_visible: Tensor | None  # (B, 1, C, nA) which query sees which anchored key (with anchor_shift)
    causal: bool  # the kept keys are one fresh causal block (the fused kernel's own causal mode applies)


@dataclass
class ChunkView(_Queries):
    """A chunk (prefill): the keys are the buffer ⧺ the chunk; ``visible`` ``[B, C, K]``; ``k_a``/``k_f``/``k_o``
    ``[B, K]`` the keys' own counts and virtual positions (for re-rotating the anchored keys, at ``anchor_idx``, to
    each query's slot distance)."""

    visible: Tensor
    k_a: Tensor
    k_f: Tensor
    k_o: Tensor
    anchor_idx: Tensor
    _layout: ChunkLayout | None = field(default=None, init=False, repr=False)

    def attend(self, call: StreamCall, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """Attention over the keys some query sees, anchored keys that moved as columns at their slot distance."""
        b, h, c, dh = query.shape
        hkv = key.shape[1]
        q, k, v = query.float(), key.float(), value.float()
        layout = self.layout()
        columns = self.learned_columns(call, q)
        if layout.anchor_shift is not None:  # some query sees an anchored key elsewhere: scored at its slot distance
            idx = self.anchor_idx
            scores = rotated_key_scores(q.view(b, hkv, h // hkv, c, dh), key, idx, layout.anchor_shift, self.rope,
                                        call.scale)
            columns.append(Columns(soft_cap(scores.view(b, h, c, -1), call.softcap), v[:, :, idx],
                                   layout.anchor_visible))
        if layout.keep is not None:
            k, v = k[:, :, layout.keep], v[:, :, layout.keep]
        causal = layout.causal and not columns
        spec = AttendSpec(causal=causal, scale=call.scale, columns=columns, softcap=call.softcap,
                          gate=variant_gate(call.module, h))
        return attend(q, k, v, None if causal else layout.visible[:, None], spec)

    def layout(self) -> ChunkLayout:
        """The keys this chunk attends over, worked out by the first layer that asks and shared by the others.
        This is where the chunk path reads tensors back to the host — a few booleans per chunk, not per layer."""
        if self._layout is not None:
            return self._layout
        visible, idx = self.visible, self.anchor_idx
        shift = anchor_visible = None
        if idx.numel() and self.rope is not None:
            moved = self._anchor_shift(idx)  # (B, C, nA)
            if bool(((moved != 0) & visible[:, :, idx]).any()):
                shift, anchor_visible = moved, visible[:, None, :, idx]
                visible = visible.clone()
                visible[:, :, idx] = False
        used = visible.any(1).any(0)  # keys some query sees (an empty buffer's slots drop out)
        keep = None
        if not bool(used.all()):
            keep = used.nonzero()[:, 0]
            visible = visible[..., keep]
        c = visible.shape[1]
        causal = visible.shape[-1] == c and bool(torch.equal(
            visible, torch.ones(c, c, dtype=torch.bool, device=visible.device).tril().expand_as(visible)))
        self._layout = ChunkLayout(visible, keep, shift, anchor_visible, causal)
        return self._layout

    def _anchor_shift(self, idx: Tensor) -> Tensor:
        """``[B, C, nA]``: the rotation taking anchored key ``idx[j]`` to its slot distance from query ``i``."""
        dist = self.q_a[:, :, None] - self.k_a[:, None, idx] + torch.clamp(self.q_f[:, :, None] - self.k_f[:, None, idx],
                                                                           max=self.window)
        return self.q_v[:, :, None] - dist - self.k_o[:, None, idx]
