"""Synthetic tasks whose sinks are known by construction: the proof that the diagnostics work.

* :mod:`sinklab.synth.nop` — conditional damping: one head learns to park "do nothing" queries on a BOS
  slot whose value is ≈ 0 (adaptive NOP).
* :mod:`sinklab.synth.broadcast` — global broadcast: one layer routes every query to the token with the
  largest projection on a direction and writes its (rotated) content into every position.

Both use :class:`sinklab.synth.model.SynthModel`, a tiny transformers ``PreTrainedModel`` whose attention
dispatches through transformers' attention interface, so the very same scan/diagnose pipeline runs on it.
"""

from .broadcast import BroadcastTask, run_broadcast
from .model import SynthConfig, SynthModel, SynthResult, fit
from .nop import NopTask, run_nop

__all__ = ["SynthConfig", "SynthModel", "SynthResult", "fit", "NopTask", "run_nop", "BroadcastTask", "run_broadcast"]
