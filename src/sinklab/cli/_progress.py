"""One rich progress bar per phase of a long run (scan samples, edited passes), each with its library-given total."""

from __future__ import annotations

import warnings
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from ..scan import ShortSequenceWarning
from ._console import console, err

__all__ = ["PhaseBars", "print_warnings"]


def print_warnings(meta: dict) -> None:
    """The run's warnings (e.g. sequences too short for Sink^ε), one yellow line each on stderr."""
    for note in meta.get("warnings", []):
        err.print(f"[yellow]warning:[/yellow] {note}", highlight=False)


class PhaseBars:
    """Context manager and ``progress(phase, advance, total)`` callback: a bar appears on a phase's first call.

    The total comes from the library (the samples actually cut from the text, the edited passes it plans),
    so it is right even when the text yields fewer samples than ``--samples``.
    """

    def __init__(self, labels: dict[str, str] | None = None) -> None:
        self.labels = labels or {}
        self._bars = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                              console=err, transient=True, disable=console.quiet)  # quiet: not the main rank
        self._tasks: dict[str, TaskID] = {}

    def __enter__(self) -> PhaseBars:
        self._quiet = warnings.catch_warnings()
        self._quiet.__enter__()
        warnings.simplefilter("ignore", ShortSequenceWarning)  # printed once by print_warnings instead
        self._bars.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._bars.__exit__(*exc)
        self._quiet.__exit__(*exc)

    def __call__(self, phase: str, advance: int, total: int) -> None:
        if phase not in self._tasks:
            self._tasks[phase] = self._bars.add_task(self.labels.get(phase, phase), total=total)
        self._bars.update(self._tasks[phase], advance=advance, total=total)
