"""The P0 sink circuit (Peng et al. 2026, arXiv:2603.06591): first-token ablation, amplification, causal check,
and the emergence stage across training checkpoints.

``sinklab.circuit(model, tokenizer, texts)`` → :class:`CircuitResult`; ``circuit_sweep(checkpoints)`` →
:class:`SweepResult`. Pure rules live in :mod:`sinklab.circuit.stage`, hooks in :mod:`sinklab.circuit.hooks`.
"""

from __future__ import annotations

from .analysis import SCHEMA_VERSION, CircuitResult, circuit, circuit_images, circuit_inputs
from .measure import measure_rows
from .hooks import Patch, find_sublayers
from .inputs import CircuitInputs, bb_inputs, id_inputs, text_inputs
from .stage import STAGES, amplification_blocks, amplification_layer, classify_stage, sink_location

__all__ = [
           "SCHEMA_VERSION",
           "STAGES",
           "CircuitInputs",
           "CircuitResult",
           "Patch",
           "amplification_blocks",
           "amplification_layer",
           "bb_inputs",
           "circuit",
           "circuit_images", "circuit_inputs",
           "classify_stage",
           "find_sublayers",
           "id_inputs",
           "measure_rows",
           "sink_location",
           "text_inputs",
]
