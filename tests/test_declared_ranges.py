"""The dependency ranges pyproject.toml declares are the ranges that were tested (``make test-compat``).

The results of ``benchmarks/compat.py`` live in ``benchmarks/results/compat.json``, one row per (transformers, torch)
run. Declaring a floor that never ran, or keeping a release inside the range whose run failed, fails here;
``docs/compatibility.md`` quotes the ranges as declared.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
TESTED = ("transformers", "torch")  # the dependencies benchmarks/compat.py varies


def _declared() -> dict[str, str]:
    """``{package: specifier}`` of pyproject.toml's ``dependencies``."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {m.group(1).lower(): m.group(2).strip() for d in deps if (m := re.match(r"([A-Za-z0-9_.-]+)\s*(.*)", d))}


def _rows() -> list[dict]:
    return json.loads((ROOT / "benchmarks" / "results" / "compat.json").read_text())


def _floor(spec: str) -> Version:
    floors = [Version(s.version) for s in SpecifierSet(spec) if s.operator == ">="]
    assert len(floors) == 1, f"{spec!r}: one >= floor expected"
    return floors[0]


def _passed(row: dict) -> bool:
    return row["passed"] > 0 and row["failed"] == 0 and row["errors"] == 0


@pytest.mark.parametrize("package", TESTED)
def test_the_declared_floor_passed_the_whole_suite(package):
    spec = _declared()[package]
    assert "<" in spec, f"{package}{spec}: an upper bound is part of what was tested"
    floor = _floor(spec)
    runs = [r for r in _rows() if Version(r[package]) == floor and r["tests"] == ["(whole suite)"]]
    assert any(_passed(r) for r in runs), (f"{package}{spec}: no passing whole-suite run of {floor} in "
                                           "benchmarks/results/compat.json (make test-compat)")


def test_every_tested_release_inside_the_ranges_passed():
    declared = _declared()
    inside = [r for r in _rows() if all(Version(r[p]) in SpecifierSet(declared[p]) for p in TESTED)]
    assert inside
    failed = [(r["transformers"], r["torch"], r["summary"]) for r in inside if not _passed(r)]
    assert not failed, f"releases inside the declared ranges whose run failed: {failed}"


def test_the_compatibility_page_quotes_the_declared_ranges():
    text = (ROOT / "docs" / "compatibility.md").read_text(encoding="utf-8")
    declared = _declared()
    for package in TESTED:
        assert f"`{package}{declared[package]}`" in text, f"docs/compatibility.md does not quote {package}'s range"
