"""The layer contract (pyproject ``[tool.importlinter]``): tensor functions → capture → analyses → report → cli."""

from __future__ import annotations

from pathlib import Path

from importlinter.cli import lint_imports

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_layers_only_import_downwards(capsys):
    # In-process (no subprocess start-up); the import graph is small, no cache is written.
    code = lint_imports(config_filename=str(PYPROJECT), no_cache=True, no_logo=True)
    out = capsys.readouterr().out
    assert code == 0, out
    assert "1 kept, 0 broken" in out or "0 broken" in out
