"""How to add an architecture: ask the matrix what already holds before teaching sinklab anything.

``python benchmarks/architectures.py --types TYPE`` builds a tiny random model of a type transformers registers and
runs scan, stream (nothing evicted, through the model's own ``generate()``), stream past eviction (against a plain
forward over the kept tokens) and diagnose on it. The same cells are functions; this example runs them on one type
and prints how each layer rotates its keys as ``_compat.layer_rotations`` measured it
(``python docs/examples/add_architecture.py [TYPE]``). A cell that is ``refused`` says what would lift the refusal;
``wrong`` or ``crash`` is what to fix — in ``sinklab._compat`` (see ARCHITECTURE.md), then add the model to
``tests/tiny_models.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import architectures as matrix  # noqa: E402

from sinklab import _compat  # noqa: E402

model_type = sys.argv[1] if len(sys.argv) > 1 else "olmo2"
built = matrix.build(model_type)
cells = {"scan": matrix.cell_scan(built, matrix.tiny_tokenizer()), "stream": matrix.cell_stream(built)}
for name, cell in cells.items():
    print(f"{model_type} {name}: {cell.text()}")
    assert cell.status in matrix.STATUSES
rotations = _compat.layer_rotations(built.model)
print("layer 0 rotates its keys:", rotations[0])
if model_type == "olmo2":  # a Llama-layout model: every cell holds, every layer rotates
    assert all(cell.status == "ok" for cell in cells.values()), cells
    assert all(r.kind == "attention" and r.cache_rope is not None for r in rotations)
