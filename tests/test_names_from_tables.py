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
from sinklab.testing import doc_tables
from sinklab.variants import VARIANT_NAMES
from sinklab.vit.experiment import VARIANT_SPECS

DOCS = Path(__file__).resolve().parent.parent / "docs"


def test_every_generated_part_of_the_docs_is_current():
    """A row added to a table changes the rendered docs; a page not regenerated (`make docs`) fails here."""
    stale = doc_tables.stale_pages(DOCS)
    assert not stale, f"docs generated from the tables are stale: {sorted(stale)}; run `make docs`"


def test_every_renderer_is_used_and_every_page_list_is_generated():
    used = {name for _, name in doc_tables.marked_blocks(DOCS)}
    assert used == set(doc_tables.BLOCKS), f"renderers without a page: {set(doc_tables.BLOCKS) - used}"
    for page in ("retention.md", "index.md", "stream.md", "metrics.md", "variants.md", "vit.md"):
        assert any(p == page for p, _ in doc_tables.marked_blocks(DOCS)), f"docs/{page} lost its generated list"


SCORED = [name for name, cls in POLICIES.items() if issubclass(cls, ScoredPolicy)]


@pytest.mark.parametrize("name,table,names", [
    ("policies", "policies", policy_names),
    ("policy-list", "policies", policy_names),
    ("scored-policies", "policies", lambda: SCORED),
    ("metrics", "metrics", lambda: [r.name for r in REGISTRY]),
    ("variants", "variants", lambda: list(VARIANT_NAMES)),
    ("vit-variants", "vit", lambda: list(VARIANT_SPECS)),
])
def test_a_rendered_list_names_every_row_in_table_order(name, table, names):
    text = doc_tables.BLOCKS[name]()
    if text.startswith("\n|"):  # a table: the names in each row's first cell
        text = " ".join(line.split("|")[1] for line in text.strip().splitlines()[2:])
    got = [n for n in re.findall(r"[\w+-]+", text) if n in names()]
    assert got == names(), f"{name}: {got} vs {names()}"


def test_a_row_added_to_a_table_reaches_the_rendered_docs(monkeypatch):
    monkeypatch.setitem(POLICIES, "newpolicy", POLICIES[SCORED[0]])
    assert "`newpolicy`" in doc_tables.policies_table()
    assert "newpolicy" in doc_tables.policy_list()
    text = (DOCS / "retention.md").read_text(encoding="utf-8")
    assert doc_tables.render_page(text) != text


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
