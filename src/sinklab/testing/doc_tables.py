"""The docs' lists of names, generated from the tables they describe.

A docs page marks a generated part with ``<!-- gen:NAME -->`` … ``<!-- /gen -->`` (inline or over several lines);
:data:`BLOCKS` says which table renders each ``NAME``. ``make docs`` (``python -m sinklab.testing.doc_tables``)
rewrites every marked part from the tables; ``tests/test_names_from_tables.py`` fails when a page differs from what
the tables render, so a row added to :data:`sinklab.stream.policy.POLICIES`, :data:`sinklab.registry.REGISTRY`,
:data:`sinklab.variants.VARIANTS` or :data:`sinklab.vit.experiment.VARIANT_SPECS` reaches the docs without editing
them by hand.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from collections.abc import Callable
from pathlib import Path

from sinklab.registry import REGISTRY
from sinklab.stream.policy import POLICIES, RetentionPolicy, get_policy, policy_names
from sinklab.variants import VARIANTS
from sinklab.vit.experiment import VARIANT_SPECS

__all__ = ["BLOCKS", "DOCS", "render_page", "stale_pages", "main"]

DOCS = Path(__file__).resolve().parents[3] / "docs"
MARK = re.compile(r"<!-- gen:([\w-]+) -->(.*?)<!-- /gen -->", re.DOTALL)


def first_paragraph(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring on one line, roles such as ``:data:`` dropped."""
    text = inspect.getdoc(obj) or ""
    para = " ".join(text.split("\n\n")[0].split())
    return re.sub(r"``([^`]+)``", r"`\1`", re.sub(r":\w+:`~?([^`]+)`", r"`\1`", para))


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def _policy_settings(cls: type[RetentionPolicy]) -> str:
    if not dataclasses.is_dataclass(cls):
        return "—"
    fields = [f for f in dataclasses.fields(cls) if f.init and f.default is not dataclasses.MISSING]
    return ", ".join(f"`{f.name}={_literal(f.default)}`" for f in fields) or "—"


def _policy_needs(cls: type[RetentionPolicy]) -> str:
    if not cls.scored:
        return "nothing: a ring buffer, the compiled decode step"
    return ("the attention weights of its observation window" if cls.needs_weights
            else "no attention weights (runs beside the fused kernel)")


def policies_table() -> str:
    rows = ["| policy | keeps, per key-value head (besides the sinks and pinned spans) | settings | needs |",
            "|---|---|---|---|"]
    for name, cls in POLICIES.items():
        default = " (default)" if cls is type(get_policy(None)) else ""
        rows.append(f"| `{name}`{default} | {cell(first_paragraph(cls))} | {_policy_settings(cls)} | "
                    f"{_policy_needs(cls)} |")
    rows.append("| `auto` | per-head budgets from a scan of the model (`RetentionPlan`), optionally fitted on a calibration "
                "text (below); SnapKV scores inside each budget; a prompt compressed before its question with "
                "reconstruction scores (`compressed_prompt`, below) | `plan=` | a scan or a saved plan |")
    return "\n" + "\n".join(rows) + "\n"


def policy_list() -> str:
    return "`--policy " + " | ".join(policy_names()) + "`"


def scored_list() -> str:
    return ", ".join(f'`policy="{n}"`' for n, cls in POLICIES.items() if cls.scored)


def metrics_table() -> str:
    rows = ["| name | meaning |", "|---|---|"]
    rows += [f"| `{r.name}` | {cell(r.description)} |" for r in REGISTRY]
    return "\n" + "\n".join(rows) + "\n"


def variants_table() -> str:
    rows = ["| name | flag | what it does |", "|---|---|---|"]
    for v in VARIANTS:
        flags = ", ".join(f"`{k}={_literal(val)}`" for k, val in v.fields.items())
        rows.append(f"| `{v.name}` | {flags} | {cell(first_paragraph(type(v)))} |")
    return "\n" + "\n".join(rows) + "\n"


def _literal(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def vit_variant_list() -> str:
    return ", ".join(f"`{n}`" for n in VARIANT_SPECS)


#: NAME → what renders the part of a page marked ``<!-- gen:NAME -->``.
BLOCKS: dict[str, Callable[[], str]] = {
    "policies": policies_table, "policy-list": policy_list, "scored-policies": scored_list,
    "metrics": metrics_table, "variants": variants_table, "vit-variants": vit_variant_list,
}


def render_page(text: str) -> str:
    """``text`` with every marked part rendered from its table (an unknown ``NAME`` raises ``KeyError``)."""
    return MARK.sub(lambda m: f"<!-- gen:{m.group(1)} -->{BLOCKS[m.group(1)]()}<!-- /gen -->", text)


def stale_pages(docs: Path = DOCS) -> dict[str, str]:
    """Page name → its regenerated text, for each page whose marked parts differ from what the tables render."""
    out = {}
    for page in sorted(docs.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        new = render_page(text)
        if new != text:
            out[page.name] = new
    return out


def marked_blocks(docs: Path = DOCS) -> list[tuple[str, str]]:
    """Every (page, NAME) marked in ``docs``."""
    return [(page.name, m.group(1)) for page in sorted(docs.glob("*.md"))
            for m in MARK.finditer(page.read_text(encoding="utf-8"))]


def main(argv: list[str] | None = None) -> int:
    """Rewrite the stale pages (``--check``: only list them; exit 1 if any)."""
    argv = sys.argv[1:] if argv is None else argv
    stale = stale_pages()
    for name, text in stale.items():
        if "--check" not in argv:
            (DOCS / name).write_text(text, encoding="utf-8")
        print(f"docs/{name}: {'stale' if '--check' in argv else 'regenerated'}")
    return 1 if stale and "--check" in argv else 0


if __name__ == "__main__":
    raise SystemExit(main())
