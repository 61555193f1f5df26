"""The sink positions of a prompt: from a scan of its attention, or measured during the prefill itself."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import _compat
from ..capture import AttentionCapture, CaptureConfig
from .layer import DynamicQuantizedSinkLayer
from .plan import SINK_EPS, SINK_SHARE, Protection, sink_positions

__all__ = ["detect_sinks", "prefill_detecting_sinks"]


@torch.no_grad()
def detect_sinks(model: nn.Module, input_ids: Tensor, eps: float = SINK_EPS, share: float = SINK_SHARE,
                 limit: int = 8) -> list[int]:
    """Positions of ``input_ids`` ``[T]`` or ``[1, T]`` that receive more than ``eps`` of the attention in at least
    ``share`` of the layer×head pairs (see :func:`~sinklab.kvquant.plan.sink_positions`).

    The prompt is run once through :class:`~sinklab.capture.AttentionCapture` (column statistics only), so
    sinks beyond position 0 — delimiters, a later ``<bos>`` — are found as well.
    """
    ids = input_ids.reshape(1, -1)
    with AttentionCapture(model, CaptureConfig(candidates=(), map_len=0)) as cap:
        batch = cap.run(input_ids=ids.to(next(model.parameters()).device))
    return sink_positions(batch.column_mass[0], batch.column_queries[0], eps=eps, share=share, limit=limit)


@torch.no_grad()
def prefill_detecting_sinks(model: nn.Module, input_ids: Tensor, cache, eps: float = SINK_EPS,
                            share: float = SINK_SHARE, limit: int = 8) -> tuple[Tensor, list[int]]:
    """Prefill ``cache`` (a :func:`~sinklab.kvquant.quantized_sink_cache`) with ``input_ids`` ``[1, T]`` while
    measuring which positions are sinks, then protect them: no separate scan of the prompt.

    Every layer holds the prompt unpacked during the forward (:meth:`DynamicQuantizedSinkLayer.defer_packing`);
    the forward runs under sinklab's capture, whose column statistics give the sinks (the same rule as
    :func:`detect_sinks`); each layer then keeps them exact in addition to its own protection and packs the
    rest. Returns the logits ``[1, T, V]`` and the sink positions.
    """
    layers = [layer for layer in cache.layers if isinstance(layer, DynamicQuantizedSinkLayer)]
    if not layers or len(layers) != len(cache.layers) or any(layer.seen for layer in layers):
        raise ValueError("prefill_detecting_sinks needs an empty cache of DynamicQuantizedSinkLayer "
                         "(sinklab.kvquant.quantized_sink_cache)")
    ids = input_ids.reshape(1, -1).to(_compat.input_device(model))
    for layer in layers:
        layer.defer_packing()
    with AttentionCapture(model, CaptureConfig(candidates=(), map_len=0)) as cap:
        batch = cap.run(full_model=True, input_ids=ids, use_cache=True, **{_compat.cache_kwarg_name(model): cache})
        logits = cap.last_output.logits
    sinks = sink_positions(batch.column_mass[0], batch.column_queries[0], eps=eps, share=share, limit=limit)
    for layer in layers:
        p = layer.protect
        layer.protect_and_pack(Protection(p.first, p.spans, tuple(p.positions) + tuple(sinks)))
    return logits, sinks
