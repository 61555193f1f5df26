"""The attention function registered while a stream is open.

It finds the stream state of the calling layer, reads what transformers handed it once into a
:class:`~sinklab.stream.views.StreamCall`, and runs the attention of that state's view for this forward
(:mod:`sinklab.stream.views`: a decode step, a prefill chunk, or a score-based policy's candidates).
"""

from __future__ import annotations

import contextvars

import torch
from torch import Tensor, nn

from ..errors import UnsupportedModelError
from .views import StreamCall

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
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    call = StreamCall(module, stream, scale, kwargs.get("softcap"), kwargs.get("s_aux"))
    out = state.view.attend(call, query, key, value)  # (B, H, C, dv)
    return out.transpose(1, 2).contiguous().to(query.dtype), None
