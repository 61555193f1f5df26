"""Every list of names a user reads — a CLI help text, a docs table or sentence — equals the table it comes from.

The tables: :data:`sinklab.stream.policy.POLICIES` (retention policies, plus ``auto``), :data:`sinklab.registry.REGISTRY`
(metric rows), :data:`sinklab.variants.VARIANTS` (attention variants) and
:data:`sinklab.vit.experiment.VARIANT_SPECS` (the ViT experiment's runs). A row added to a table makes the list
that lacks it fail here, naming the page and the names; the CLI's help texts are built from the tables.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from sinklab.cli import app
from sinklab.cli._common import policy_help
from sinklab.registry import REGISTRY
from sinklab.stream.policy import POLICIES, ScoredPolicy, policy_names
from sinklab.variants import VARIANT_NAMES
from sinklab.vit.experiment import VARIANT_SPECS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def table_names(page: str, header: str) -> list[str]:
    """The backticked names in the first cell of each row of the Markdown table of ``page`` whose header row starts
    with ``header`` (``| policy |``), in order."""
    lines = (DOCS / page).read_text(encoding="utf-8").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(header)), None)
    assert start is not None, f"docs/{page}: no table whose header starts with {header!r}"
    names = []
    for line in lines[start + 2:]:  # past the header and its |---| row
        if not line.startswith("|"):
            break
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def line_names(page: str, pattern: str) -> list[str]:
    """The names ``pattern``'s first group captures in ``page`` (one list written in running text), split on ``|``
    or ``,`` and stripped of backticks and quotes."""
    text = (DOCS / page).read_text(encoding="utf-8")
    match = re.search(pattern, text, re.DOTALL)
    assert match, f"docs/{page}: the list {pattern!r} is gone"
    return [n.strip(" `\"\n") for n in re.split(r"[|,]", match.group(1)) if n.strip(" `\"\n")]


SCORED = [name for name, cls in POLICIES.items() if issubclass(cls, ScoredPolicy)]


@pytest.mark.parametrize("page,names,want", [
    ("retention.md", lambda: table_names("retention.md", "| policy |"), policy_names),
    ("index.md", lambda: line_names("index.md", r"\(`--policy ([^`]+)`\)"), policy_names),
    ("stream.md", lambda: line_names("stream.md", r"per key-value head \((`policy=[^)]*)\)"), lambda: SCORED),
    ("metrics.md", lambda: table_names("metrics.md", "| name | meaning |"), lambda: [r.name for r in REGISTRY]),
    ("variants.md", lambda: table_names("variants.md", "| name | flag |"), lambda: list(VARIANT_NAMES)),
    ("vit.md", lambda: line_names("vit.md", r"\*\*Variants\*\*: ([^.]+)\."), lambda: list(VARIANT_SPECS)),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_docs_list_equals_its_table(page, names, want):
    got = [n.removeprefix("policy=").strip("\"") for n in names()]
    assert got == want(), f"docs/{page} lists {got}, the table has {want()}"


def _option_help(command: str, option: str) -> str:
    click_app = typer.main.get_command(app)
    param = next(p for p in click_app.commands[command].params if option in p.opts)  # type: ignore[attr-defined]
    return param.help or ""


@pytest.mark.parametrize("command,option,names", [
    ("stream", "--policy", policy_names),
    ("chat", "--policy", policy_names),
    ("train", "--variant", lambda: list(VARIANT_NAMES)),
    ("vit-experiment", "--variants", lambda: list(VARIANT_SPECS)),
])
def test_a_help_text_names_every_row_of_its_table(command, option, names):
    text = _option_help(command, option)
    words = set(re.findall(r"[\w+-]+", text))
    missing = [n for n in names() if n not in words]
    assert not missing, f"`sinklab {command} {option}` help lacks {missing}: {text!r}"


def test_the_policy_help_follows_the_table(monkeypatch):
    """A row added to POLICIES appears in the help without editing it."""
    monkeypatch.setitem(POLICIES, "newpolicy", POLICIES[SCORED[0]])
    assert "newpolicy" in re.findall(r"[\w+-]+", policy_help())
