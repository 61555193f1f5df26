"""ARCHITECTURE.md's "How to add …" worked examples run as written (docs/examples/*.py; each checks itself against
an independent computation and removes what it registered)."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("*.py"))


def _how_to_section() -> str:
    text = (ROOT / "ARCHITECTURE.md").read_text(encoding="utf-8")
    return text[text.index("## How to add"):text.index("\n## ", text.index("## How to add") + 1)]


def test_every_how_to_names_an_example_that_exists():
    section = _how_to_section()
    bullets = re.findall(r"^\* \*\*(.+?)\*\*(.*?)(?=^\* \*\*|\Z)", section, re.S | re.M)
    assert len(bullets) >= 5, bullets
    named = set()
    for title, body in bullets:
        found = re.findall(r"docs/examples/(\w+\.py)", body)
        assert found, f"ARCHITECTURE.md's how-to {title!r} names no worked example under docs/examples/"
        named.update(found)
    assert named <= {p.name for p in EXAMPLES}, named - {p.name for p in EXAMPLES}
    assert {p.name for p in EXAMPLES} <= named, "an example ARCHITECTURE.md does not name"


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(path, monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.chdir(tmp_path)
    runpy.run_path(str(path), run_name="__main__")
