"""The attention function registered while a stream is open.

Scores are computed against every key the layer handed over (buffer, or buffer ⧺ chunk) and masked
by metadata: a query sees its row's anchored tokens (sinks, pinned) up to itself and the ``W`` most
recent free tokens up to itself. Window keys sit at their true distance already; anchored keys are
scored at their slot distance ``D_ij`` by rotating each one by ``a_ij = v_i − D_ij − o_j`` for each
query (exact for every query of a chunk). Sinks and window share one softmax (equivalent to merging
two partial softmaxes by log-sum-exp).
"""

from __future__ import annotations

import contextvars
import math

import torch
from torch import Tensor, nn

from ..attention import softmax_with_columns
from ..errors import UnsupportedModelError
from ..rope import rotate
from ..variants import variant_columns, variant_gate

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
_PAIR_BUDGET = 1 << 15  # (query, anchored key) pairs rotated at once


def _anchored_scores(q: Tensor, keys: Tensor, view, idx: Tensor, window: int, rope, scale: float) -> Tensor:
    """Scores of queries ``q`` ``[B, Hkv, rep, C, dh]`` against anchored key slots ``idx`` at slot distance."""
    b, hkv, rep, c, dh = q.shape
    k = keys[:, :, idx].double()  # (B, Hkv, nA, dh)
    k_a, k_f, k_o = view.k_a[:, idx], view.k_f[:, idx], view.k_o[:, idx]  # (B, nA)
    out = []
    step = max(1, _PAIR_BUDGET // max(1, idx.numel()))
    for c0 in range(0, c, step):
        c1 = min(c, c0 + step)
        q_a, q_f, q_v = view.q_a[:, c0:c1, None], view.q_f[:, c0:c1, None], view.q_v[:, c0:c1, None]
        dist = q_a - k_a[:, None] + torch.clamp(q_f - k_f[:, None], max=window)  # (B, C', nA)
        shift = q_v - dist - k_o[:, None]  # rotate key j by this for query i
        kr = rotate(k[:, :, None], rope, shift[:, None])  # (B, Hkv, C', nA, dh)
        out.append(torch.einsum("bgrcd,bgcjd->bgrcj", q[:, :, :, c0:c1].double(), kr) * scale)
    return torch.cat(out, dim=3).float()


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
    rope = state.rope
    view = state.view
    b, h, c, dh = query.shape
    hkv = key.shape[1]
    rep = h // hkv
    scale = dh**-0.5 if scaling is None else float(scaling)
    softcap, sinks = kwargs.get("softcap"), kwargs.get("s_aux")
    learned, slot = variant_columns(module, h)  # a sinklab variant's sink logit / kv-bias slot (sinklab.variants)
    if learned is not None:
        sinks = learned
    gate = variant_gate(module, h)  # (B, C, H, dv | 1) or None
    if view.from_buffer and softcap is None and sinks is None and slot is None:
        # Decode: anchored slots were re-rotated in place, every visible slot is a plain key → fused SDPA.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=view.visible[:, None, None, :], scale=scale, enable_gqa=rep > 1)
        out = out.transpose(1, 2)
        return (out * gate.to(out.dtype) if gate is not None else out).contiguous(), None
    q = query.float().view(b, hkv, rep, c, dh)
    scores = torch.matmul(q * scale, key.float()[:, :, None].transpose(-1, -2))  # (B, Hkv, rep, C, K)
    if not view.from_buffer and view.anchor_idx.numel():
        scores[..., view.anchor_idx] = _anchored_scores(q, key, view, view.anchor_idx, state.window, rope, scale)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    visible = view.visible if view.visible.dim() == 3 else view.visible[:, None, :]  # (B, C, K)
    scores = scores.masked_fill(~visible[:, None, None], -math.inf)
    extra = []  # learned columns (not tokens, always visible), dropped after the softmax
    if sinks is not None:  # learned sink logits (gpt-oss, sink-logit, softmax₁): value 0
        extra.append(sinks.float().view(1, hkv, rep, 1, 1).expand(b, hkv, rep, c, 1))
    if slot is not None:  # kv-bias: a learned key (no RoPE) with a learned value
        # The slot's key has no position, so its score depends on where the query is rotated: at the query's
        # own cache-slot position (positions by cache slot), not at the stream's internal virtual position.
        q_slot = query
        if rope is not None:
            q_slot = rotate(query, rope, view.slot_shift[:, None, :])
        slot_k = slot[0].float().view(1, hkv, rep, dh, 1)
        slot_logit = torch.matmul(q_slot.float().view(b, hkv, rep, c, dh) * scale, slot_k)  # (B, Hkv, rep, C, 1)
        extra.append(torch.tanh(slot_logit / softcap) * softcap if softcap is not None else slot_logit)
    if extra:
        probs, learned_p = softmax_with_columns(scores, torch.cat(extra, dim=-1))
    else:
        probs = torch.softmax(scores, dim=-1)
    real = visible.any(-1)[:, None, None, :, None]  # padding queries see nothing
    probs = probs.masked_fill(~real, 0.0)
    out = torch.matmul(probs, value.float()[:, :, None])  # (B, Hkv, rep, C, dv)
    if slot is not None:
        slot_p = learned_p[..., -1:].masked_fill(~real, 0.0)
        out = out + slot_p * slot[1].float().view(1, hkv, rep, 1, -1)
    out = out.reshape(b, h, c, -1).transpose(1, 2)
    if gate is not None:
        out = out * gate
    return out.contiguous().to(query.dtype), None
