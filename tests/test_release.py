"""The version is written once per release: pyproject.toml, ``sinklab.__version__`` and CHANGELOG.md agree."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_version_matches_pyproject_and_changelog():
    import sinklab

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert sinklab.__version__ == version
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    releases = re.findall(r"^## \[([^\]]+)\](?: - (\d{4}-\d{2}-\d{2}))?", changelog, re.M)
    assert releases and releases[0][0] == "Unreleased", "Keep a Changelog: [Unreleased] on top"
    assert releases[1][0] == version, f"the newest release in CHANGELOG.md is {releases[1][0]}, the package {version}"
    assert all(date for name, date in releases[1:]), "every release heading carries its date: ## [x.y.z] - YYYY-MM-DD"
    assert len({name for name, _ in releases}) == len(releases), "a release appears twice"
