"""Shared pieces of the command line: the Typer app, consoles, error handling, loading, progress."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import SinklabError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Find, explain, use and fix attention sinks.")
console = Console(stderr=False)
err = Console(stderr=True)


@app.callback()
def _main() -> None:
    """sinklab: attention-sink scanning for Hugging Face transformers models."""


@contextmanager
def _user_errors():
    """Turn sinklab's input errors into one red line and exit code 2 (no traceback, no partial output)."""
    try:
        yield
    except SinklabError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(code=2) from None


def _load(model: str, **kwargs):
    from ..models import load_model

    with console.status(f"loading {model} …"):
        return load_model(model, **kwargs)


def _read_texts(text: str | None, file: Path | None) -> list[str] | None:
    if text is not None and file is not None:
        raise SinklabError("give either --text or --file, not both")
    if text is not None:
        return [text]
    if file is not None:
        if not file.is_file():
            raise SinklabError(f"--file {file}: no such file")
        return [file.read_text(encoding="utf-8")]
    return None


def _progress(total: int) -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err, transient=True)
