"""The test suite's hand-written tiny models, from the one tiny-model factory :mod:`sinklab.testing.tiny`.

``build(name)`` is :func:`sinklab.testing.tiny.named_model`; the tables and helpers are re-exported so that test
modules keep importing them from here.
"""

from __future__ import annotations

from sinklab.testing.tiny import CAUSAL, EAGER_ONLY, TEXT_MODELS, V, VISION_MODELS, inputs_for, tiny_vit
from sinklab.testing.tiny import named_model as build

__all__ = ["CAUSAL", "EAGER_ONLY", "TEXT_MODELS", "V", "VISION_MODELS", "build", "inputs_for", "tiny_vit"]
