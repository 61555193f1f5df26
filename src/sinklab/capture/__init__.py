"""Model plumbing: record per-layer, per-head attention statistics without holding L×H×T×T.

One module per responsibility:

* :mod:`~sinklab.capture.core` — :class:`AttentionCapture`: attention-function registration, block
  hooks, the forward pass and collection into a :class:`CaptureBatch`;
* :mod:`~sinklab.capture.reduce` — chunked attention and the per-chunk column/query reductions;
* :mod:`~sinklab.capture.heads` — value norms, update spectrum and common mode per head;
* :mod:`~sinklab.capture.weights` — W_O factor and QK spectra, once per layer;
* :mod:`~sinklab.capture.hidden` — block-output statistics;
* :mod:`~sinklab.capture.types` — :class:`CaptureConfig`, :class:`CaptureBatch`, :class:`ValueEdit`,
  :class:`StackedEdits`.
"""

from __future__ import annotations

from .core import AttentionCapture
from .types import EDIT_MODES, CaptureBatch, CaptureConfig, StackedEdits, ValueEdit
from .weights import LayerWeights, WeightStatistics

__all__ = ["AttentionCapture", "CaptureBatch", "CaptureConfig", "ValueEdit", "StackedEdits", "EDIT_MODES",
           "WeightStatistics", "LayerWeights"]
