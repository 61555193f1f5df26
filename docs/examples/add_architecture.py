"""How to add an architecture: ask the matrix what already holds before teaching sinklab anything.

``python benchmarks/architectures.py --types TYPE`` builds a tiny random model of a type transformers registers and
runs scan, stream (nothing evicted, through the model's own ``generate()``), stream past eviction (against a plain
forward over the kept tokens), diagnose and circuit on it. The cells live in ``sinklab.testing.conformance`` and the
tiny models in ``sinklab.testing.tiny``; this example runs two cells on one type and prints how each layer rotates
its keys as ``_compat.layer_rotations`` measured it (``python docs/examples/add_architecture.py [TYPE]``). A cell
that is ``refused`` says what would lift the refusal; ``wrong`` or ``crash`` is what to fix — in
``sinklab._compat`` (see ARCHITECTURE.md), then add the type (and any configuration worth its own row) to the
matrix's tests.
"""

import sys

import sinklab
from sinklab import _compat
from sinklab.testing import conformance

model_type = sys.argv[1] if len(sys.argv) > 1 else "olmo2"
built = conformance.configuration(model_type).build()
cells = conformance.run_cells(built, cells=("scan", "stream"))
for name, cell in cells.items():
    print(f"{model_type} {name}: {cell.text()}")
    assert cell.status in conformance.STATUSES
try:
    rotations = _compat.layer_rotations(built.model)
except sinklab.UnsupportedModelError as err:  # a position scheme the stream cannot reproduce: the reason says which
    print(f"{model_type}: key rotations refused: {err}")
    raise SystemExit(0) from None
print("layer 0 rotates its keys:", rotations[0])
if model_type == "olmo2":  # a Llama-layout model: every cell holds, every layer rotates
    assert all(cell.status == "ok" for cell in cells.values()), cells
    assert all(r.kind == "attention" and r.cache_rope is not None for r in rotations)
