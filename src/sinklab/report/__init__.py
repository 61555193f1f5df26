"""Figures and the HTML report; :func:`save` is the one way to write a result.

``sinklab.report.save(result, out)`` writes any sinklab result — a :class:`~sinklab.scan.ScanResult`, a
:class:`~sinklab.diagnose.Diagnosis` (with the recommendation it carries), a
:class:`~sinklab.circuit.CircuitResult`, a :class:`~sinklab.circuit.sweep.SweepResult`, a
:class:`~sinklab.evaluation.stream.StreamEval` or a :class:`~sinklab.kvquant.evaluate.KvQuantResult` — as its JSON file, PNG figures and a self-contained
``report.html`` into the folder ``out``, atomically (:func:`sinklab.atomic.atomic_dir`). Results are data;
the renderers here only render them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..circuit.analysis import CircuitResult
from ..circuit.sweep import SweepResult
from ..diagnose import Diagnosis
from ..errors import InputError
from ..kvquant.evaluate import KvQuantResult
from ..scan import ScanResult
from ..evaluation.stream import StreamEval

__all__ = ["save", "WRITERS"]


def _scan(result, out: Path) -> Path:
    from .html import write_report

    return write_report(result, out)


def _diagnosis(result, out: Path) -> Path:
    from .diagnose_html import write_diagnosis

    return write_diagnosis(result, out)


def _circuit(result, out: Path) -> Path:
    from .circuit_html import write_circuit_report

    return write_circuit_report(result, out)


def _sweep(result, out: Path) -> Path:
    from .circuit_html import write_sweep_report

    return write_sweep_report(result, out)


def _kv_quant(result, out: Path) -> Path:
    from .kvquant import write_kv_quant

    return write_kv_quant(result.to_json(), out)


def _eval_stream(result, out: Path) -> Path:
    from .stream_figures import write_eval_stream

    return write_eval_stream(result.to_json(), out)


#: result class → writer (the renderers import matplotlib: loaded on first use only).
WRITERS: dict[type, Callable[[object, Path], Path]] = {
    ScanResult: _scan,
    Diagnosis: _diagnosis,
    CircuitResult: _circuit,
    SweepResult: _sweep,
    StreamEval: _eval_stream,
    KvQuantResult: _kv_quant,
}


def save(result: object, out: str | Path) -> Path:
    """Write ``result``'s JSON, figures and ``report.html`` into folder ``out`` (atomically); return the report path."""
    writer = next((WRITERS[c] for c in type(result).__mro__ if c in WRITERS), None)
    if writer is None:
        raise InputError(f"sinklab.report.save: no renderer for {type(result).__name__}; "
                         f"it writes {', '.join(c.__name__ for c in WRITERS)}")
    return writer(result, Path(out))
