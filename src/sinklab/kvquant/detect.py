"""The sink positions of a prompt, from one scan of its attention (sinklab's capture, no cache)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..capture import AttentionCapture, CaptureConfig
from .plan import sink_positions

__all__ = ["detect_sinks"]


@torch.no_grad()
def detect_sinks(model: nn.Module, input_ids: Tensor, eps: float = 0.3, share: float = 0.1, limit: int = 8) -> list[int]:
    """Positions of ``input_ids`` ``[T]`` or ``[1, T]`` that receive more than ``eps`` of the attention in at least
    ``share`` of the layer×head pairs (see :func:`~sinklab.kvquant.plan.sink_positions`).

    The prompt is run once through :class:`~sinklab.capture.AttentionCapture` (column statistics only), so
    sinks beyond position 0 — delimiters, a later ``<bos>`` — are found as well.
    """
    ids = input_ids.reshape(1, -1)
    with AttentionCapture(model, CaptureConfig(candidates=(), map_len=0)) as cap:
        batch = cap.run(input_ids=ids.to(next(model.parameters()).device))
    return sink_positions(batch.column_mass[0], batch.column_queries[0], eps=eps, share=share, limit=limit)
