"""The CLI's two consoles: results on stdout, progress, warnings and errors on stderr."""

from __future__ import annotations

from rich.console import Console

__all__ = ["console", "err"]

console = Console(stderr=False)
err = Console(stderr=True)
