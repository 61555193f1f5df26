"""The float64 StreamingLLM reference of the stream tests: :mod:`sinklab.testing.reference` (one copy, shared with
the architecture matrix), re-exported so that test modules keep importing it from here."""

from __future__ import annotations

from sinklab.testing.reference import Reference, assert_beams_equal_default

__all__ = ["Reference", "assert_beams_equal_default"]
