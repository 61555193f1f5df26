"""Command-line interface (a thin layer over the Python API): one module per command family."""

from __future__ import annotations

from . import chat, circuit, diagnose, eval_stream, kv_quant, scan, stream, train, vit  # noqa: F401  (each module registers its commands on ``app``)
from ._common import app, console, err

__all__ = ["app", "console", "err", "main"]


def main() -> None:  # pragma: no cover - console-script entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()  # typer's app() exits with the command's status itself
