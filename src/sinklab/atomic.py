"""The one atomic writer: a failed run leaves nothing half-written.

:func:`atomic_dir` yields a temporary folder beside the output folder; its files move into place only when
the block succeeds. :func:`atomic_file` does the same for one file (written to a temporary sibling, then
renamed over the target). Every report, CLI output folder and checkpoint file sinklab writes goes through
one of them; a lone JSON or text file goes through :func:`write_json` / :func:`write_text`, built on
:func:`atomic_file`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

__all__ = ["atomic_dir", "atomic_file", "write_json", "write_text"]


def _public(path: Path, mode: int) -> None:
    """Give a temporary file (0600) or folder (0700) the mode a plain one gets under the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(mode & ~umask)


@contextmanager
def atomic_dir(out: Path | str, *, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary folder beside ``out``; its entries move into ``out`` only when the block succeeds.

    Entries already in ``out`` under the same names are replaced, others are kept; ``replace=True`` replaces
    the whole folder instead (a checkpoint: never a mix of two). On an error or Ctrl-C the temporary folder
    is removed and ``out`` is untouched (not even created).
    """
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        yield tmp
        _public(tmp, 0o777)
        if replace:
            if out.exists():
                shutil.rmtree(out)
            os.replace(tmp, out)
            return
        out.mkdir(exist_ok=True)
        for item in tmp.iterdir():
            target = out / item.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            os.replace(item, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def atomic_file(path: Path | str) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; it replaces ``path`` only when the block succeeds."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".sinklab-", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        _public(Path(tmp), 0o666)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: Path | str, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` atomically: a crash leaves the previous file or none. Returns the path."""
    path = Path(path)
    with atomic_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return path


def write_json(path: Path | str, obj: object, *, indent: int | None = 1) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically (values JSON cannot hold are written with ``str``).

    The object is serialised before anything is written, so an unserialisable value leaves the previous file.
    """
    return write_text(path, json.dumps(obj, indent=indent, default=str))
