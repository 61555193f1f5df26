"""sinklab — find, explain, use and fix attention sinks in transformer models.

Main entry points::

    import sinklab, sinklab.report
    loaded = sinklab.load_model("builtin:minilm")
    result = sinklab.scan(loaded.model, loaded.tokenizer, ["some text", ...], seq_len=64)
    result.sink_rate(0)          # Gu et al.'s Sink_1^0.3 in percent, at this seq_len
    sinklab.report.save(result, "out/")   # scan.json, PNG figures, report.html
"""

from __future__ import annotations

from ._version import __version__  # noqa: E402

from . import metrics  # noqa: E402
from .capture import AttentionCapture, CaptureBatch, CaptureConfig  # noqa: E402
from .capture import ValueEdit  # noqa: E402
from .diagnose import Diagnosis, SinkRecord, diagnose, diagnose_inputs  # noqa: E402
from .errors import InputError, ModelWeightsError, SinklabError, UnsupportedModelError  # noqa: E402
from .models import BUILTIN_MODELS, LoadedModel, load_model  # noqa: E402
from .registry import REGISTRY, MetricRow  # noqa: E402
from .scan import ScanResult, scan, scan_inputs  # noqa: E402
from .stream import SinkCache, StreamSession, stream_generate  # noqa: E402
from .checkpoint import load, save  # noqa: E402
from .variants import VariantConfig, apply_variant  # noqa: E402
from .attention import softmax_with_sink  # noqa: E402
from .monitor import SinkMonitor  # noqa: E402
from .circuit import CircuitResult  # noqa: E402
from .circuit import circuit  # noqa: E402

__all__ = [
    "__version__",
    "metrics",
    "AttentionCapture",
    "CaptureBatch",
    "CaptureConfig",
    "SinklabError",
    "InputError",
    "ModelWeightsError",
    "UnsupportedModelError",
    "BUILTIN_MODELS",
    "LoadedModel",
    "load_model",
    "REGISTRY",
    "MetricRow",
    "ScanResult",
    "scan",
    "scan_inputs",
    "ValueEdit",
    "Diagnosis",
    "SinkRecord",
    "diagnose",
    "diagnose_inputs",
    "SinkCache",
    "StreamSession",
    "stream_generate",
    "VariantConfig",
    "apply_variant",
    "load",
    "save",
    "softmax_with_sink",
    "SinkMonitor",
    "CircuitResult",
    "circuit",
]
