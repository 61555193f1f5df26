"""Test infrastructure that ships with sinklab: what the suite, the architecture matrix and its docs share.

* :mod:`sinklab.testing.tiny` — the one tiny-model factory (any transformers type shrunk by name, and the
  hand-written tiny models of the test suite), with their inputs;
* :mod:`sinklab.testing.conformance` — the architecture matrix's cells, configurations and source fingerprint;
* :mod:`sinklab.testing.reference` — the independent float64 StreamingLLM reference.

Import the submodules; this package re-exports nothing (importing it loads no model code).
"""
