"""The attention function registered while a stream is open.

Every query attends over the keys the layer handed over (buffer, or buffer ⧺ chunk), masked by
metadata: a query sees its row's anchored tokens (sinks, pinned) up to itself and the ``W`` most recent
free tokens up to itself. Window keys sit at their true distance already; anchored keys are scored at
their slot distance ``D_ij`` by rotating each one by ``a_ij = v_i − D_ij − o_j`` for each query (exact for
every query of a chunk). Sinks and window share one softmax.

The maths is :func:`sinklab.attention.attend` (fused path unless the model softcaps its logits). A chunk
(prefill) hands it the keys some query sees (an empty buffer's slots drop out), in the kernel's own causal
mode when that is the whole pattern; anchored keys that some query sees at a distance other than the one
they were rotated at enter as extra columns carrying their re-rotated scores (:class:`~sinklab.attention.Columns`)
and are masked among the plain keys. A decode step's anchored slots were re-rotated in place: plain keys.
"""

from __future__ import annotations

import contextvars
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention import Columns, attend, rotated_key_scores, soft_cap
from ..errors import UnsupportedModelError
from ..rope import rotate
from ..variants import variant_column_logits, variant_gate, variant_has_columns
from .scored import scored_attention

__all__ = ["stream_attention", "stream_mask", "active_stream", "ACTIVE_STREAM", "ATTN_NAME", "TRACED_STREAM"]

ATTN_NAME = "sinklab_stream"
ACTIVE_STREAM: contextvars.ContextVar = contextvars.ContextVar("sinklab_stream", default=None)
# The stream of the forward being compiled: torch.compile cannot read a ContextVar, so the eager pre-hook
# also leaves the active stream here (a plain global read by the traced attention; guarded by type only).
TRACED_STREAM: list = [None]


def active_stream():
    """The stream of the running forward (the ContextVar eagerly, :data:`TRACED_STREAM` under compile)."""
    if torch.compiler.is_compiling():
        return TRACED_STREAM[0]
    return ACTIVE_STREAM.get()


def stream_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask: Tensor | None = None,
                **kwargs) -> Tensor | None:
    """The "mask" transformers builds for the stream attention: which new columns are real, ``[B, 1, 1, C]``.

    The attention masks by cache metadata and ignores it; it is there so that the padding of a left-padded
    batch reaches the stream even where ``generate()`` turns the 2-D mask into a prepared one (compileable
    caches get their masks built outside the forward). ``None`` when there is no padding mask.
    """
    if attention_mask is None or attention_mask.dim() != 2:
        return None
    return attention_mask[:, -q_length:].bool()[:, None, None, :]


def stream_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """Attention over a stream's kept tokens with positions by cache slot. Output ``[B, C, H, dv]``."""
    stream = active_stream()
    if stream is None:
        raise RuntimeError("sinklab's stream attention ran outside a forward with a SinkCache; restore the model's "
                           "attention implementation or pass the SinkCache to the model")
    layer_idx = getattr(module, "layer_idx", None)
    if len(stream.states) == 1:
        state = stream.state
    elif layer_idx is None:
        raise UnsupportedModelError(f"{type(module).__name__} has no layer_idx; per-layer stream budgets need it")
    else:
        state = stream.layer_states[layer_idx]
    if layer_idx is not None and kwargs.get("sliding_window") != stream.layer_windows[layer_idx]:
        raise UnsupportedModelError(
            f"layer {layer_idx} attends over a window of {kwargs.get('sliding_window')} tokens but its config says "
            f"{stream.layer_windows[layer_idx]}; sinklab cannot tell this layer's own attention span")
    b, h, c, dh = query.shape
    scale = dh**-0.5 if scaling is None else float(scaling)
    softcap = kwargs.get("softcap")
    if state.scored:  # a score-based retention policy (sinklab.stream.scored)
        layer = stream.layers[layer_idx if layer_idx is not None else 0]
        return scored_attention(module, query, key, value, state, layer, scale, softcap, kwargs.get("s_aux")), None
    rope = state.attn_rope  # how the key this function receives turns (its rotary part may sit elsewhere)
    view = state.view
    hkv = key.shape[1]
    rep = h // hkv
    gate = variant_gate(module, h)  # (B, C, H, dv | 1) or None
    if view.from_buffer:
        # Decode: anchored slots were re-rotated in place, every visible slot is a plain key.
        # (B, 1, 1, K); eagerly none at all once every slot is visible (a compiled graph keeps one form)
        visible = None if not torch.compiler.is_compiling() and view.all_visible else view.visible[:, None, None, :]
        if softcap is None and kwargs.get("s_aux") is None and not variant_has_columns(module):
            out = attend(query, key, value, visible, scale=scale, gate=gate, fast=True)  # in the model's dtype
            return out.transpose(1, 2).contiguous(), None
        q = query.float()
        out = attend(q, key.float(), value.float(), visible, scale=scale, softcap=softcap, gate=gate,
                     columns=_learned_columns(module, q, kwargs.get("s_aux"), view, rope, scale, softcap))
        return out.transpose(1, 2).contiguous().to(query.dtype), None
    # A chunk (prefill): keys are the buffer ⧺ the chunk, (B, C, K) visibility from the cache's metadata.
    q, k, v = query.float(), key.float(), value.float()
    layout = view.chunk_layout or chunk_layout(view, state.window, rope is not None)
    columns = _learned_columns(module, q, kwargs.get("s_aux"), view, rope, scale, softcap)
    if layout.anchor_shift is not None:  # some query sees an anchored key elsewhere: scored at its slot distance
        idx = view.anchor_idx
        scores = rotated_key_scores(q.view(b, hkv, rep, c, dh), key, idx, layout.anchor_shift, rope, scale)
        columns.append(Columns(soft_cap(scores.view(b, h, c, -1), softcap), v[:, :, idx], layout.anchor_visible))
    if layout.keep is not None:
        k, v = k[:, :, layout.keep], v[:, :, layout.keep]
    causal = layout.causal and not columns
    out = attend(q, k, v, None if causal else layout.visible[:, None], causal=causal, scale=scale, columns=columns,
                 softcap=softcap, gate=gate)
    return out.transpose(1, 2).contiguous().to(query.dtype), None


@dataclass
class ChunkLayout:
    """What the queries of one prefill chunk attend over, the same in every layer that shares a stream state."""

    visible: Tensor  # (B, C, K') the sequence keys each query sees (moved anchored keys and unseen slots out)
    keep: Tensor | None  # the K' key positions kept (None: all)
    anchor_shift: Tensor | None  # (B, C, nA) rotation of each anchored key to its slot distance; None: none moves
    anchor_visible: Tensor | None  # (B, 1, C, nA) which query sees which anchored key (with anchor_shift)
    causal: bool  # the kept keys are one fresh causal block (the fused kernel's own causal mode applies)


def chunk_layout(view, window: int, rotary: bool) -> ChunkLayout:
    """Work out (once per chunk, stored on ``view``) the keys a chunk attends over. This is where the chunk path
    reads tensors back to the host — a few booleans per chunk, not per layer."""
    visible = view.visible if view.visible.dim() == 3 else view.visible[:, None, :]
    idx = view.anchor_idx
    shift = anchor_visible = None
    if idx.numel() and rotary:
        moved = _anchor_shift(view, idx, window)  # (B, C, nA)
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
    view.chunk_layout = ChunkLayout(visible, keep, shift, anchor_visible, causal)
    return view.chunk_layout


def _learned_columns(module: nn.Module, q: Tensor, s_aux: Tensor | None, view, rope, scale: float,
                     softcap: float | None) -> list[Columns]:
    """A sinklab variant's columns (:data:`sinklab.variants.VARIANTS`), or the model's own learned sinks (``s_aux``).

    A kv-bias slot's key has no position, so its score depends on where the query is rotated: at the query's
    own cache-slot position (positions by cache slot), not at the stream's internal virtual position.
    """
    def slot_query() -> Tensor:
        return rotate(q, rope, view.slot_shift[:, None, :]) if rope is not None else q

    return variant_column_logits(module, q, scale, slot_query=slot_query, softcap=softcap, model_sink=s_aux)


def _anchor_shift(view, idx: Tensor, window: int) -> Tensor:
    """``[B, C, nA]``: the rotation taking anchored key ``idx[j]`` to its slot distance from query ``i``."""
    dist = view.q_a[:, :, None] - view.k_a[:, None, idx] + torch.clamp(view.q_f[:, :, None] - view.k_f[:, None, idx],
                                                                       max=window)
    return view.q_v[:, :, None] - dist - view.k_o[:, None, idx]
