"""No measurement in the package's code text: comments and docstrings carry definitions, never results of runs.

Timings, speed-ups, memory readings and dated results belong in ``docs/`` and ``benchmarks/results/`` (where they
can be re-measured and dated); a number written next to the code goes stale silently. The rule: a comment or a
docstring (module, class or function) under ``src/sinklab`` may not hold a number followed by a unit of time
(``ms``, ``s``, ``min`` …), of throughput (``tokens/s``, ``it/s``), of memory (``MB``, ``GiB`` …), a speed-up
(``19×``, ``1.3x``, written without a space: ``a × b`` is a product) or a percentage — except the few definitions
listed in :data:`ALLOWED` (a default, a threshold), each with its reason.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "sinklab"

#: A number (``59``, ``47.2``, ``1,024``; a range ``4–10``) followed by a unit a measurement is quoted in.
MEASUREMENT = re.compile(
    r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?(?:\s*[-–]\s*\d+(?:,\d{3})*(?:\.\d+)?)?"
    r"(?:\s*(?:(?:CPU|wall)[- ])?(?:ms|µs|us|ns|s|secs?|seconds?|mins?|minutes?|hours?|h|%|GB|GiB|MB|MiB|kB|KB|KiB|TB"
    r"|tok/s|tokens?/s|tokens? per second|it/s|steps?/s)(?![\w/])|[×x](?![\w\d]|\s*\d))"
)

#: (file relative to src/sinklab, phrase): a number with a unit that is a definition, not a measurement.
ALLOWED = {
    ("evaluation/retention.py", "The 95 %"): "the Wilson interval's definition (its default z is the 95 % quantile)",
    ("attention.py", "= 77 %"): "a closed-form worked example (e³ / (e³ + 6)), computed, not measured",
    ("capture/loss.py", "16 MB in float32"): "the chunk's size, computed from its entry count",
    ("diagnose.py", "90 %/0.5"): "the relaxed sink rule's definition (share of queries / weight)",
    ("distributed.py", "default 300 s"): "the collective timeout's default",
    ("gguf.py", "4 MiB chunks"): "the read size of the hash loop",
    ("recommend.py", "(5 %)"): "the rule's default threshold (rare_share)",
    ("recommend.py", "(25 %)"): "the rule's default threshold (common_share)",
    ("recommend.py", "≥ 60 %"): "the confidence rule's written thresholds",
    ("recommend.py", "≥ 30 %"): "the confidence rule's written thresholds",
    ("recommend.py", "≥ 40 %"): "the confidence rule's written thresholds",
    ("recommend.py", "≥ 25 %"): "the confidence rule's written thresholds",
}

def code_text(path: Path) -> list[tuple[int, str]]:
    """``(line, text)`` of every comment and every module/class/function docstring line of ``path``."""
    source = path.read_text(encoding="utf-8")
    lines = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and isinstance(doc.value.value, str):
                lines += [(doc.lineno + i, text) for i, text in enumerate(doc.value.value.splitlines())]
    return sorted(lines)


def measurements(path: Path) -> list[str]:
    """``file:line: text`` for each comment or docstring line of ``path`` that quotes a measurement."""
    rel = path.relative_to(SRC).as_posix()
    allowed = [phrase for (file, phrase) in ALLOWED if file == rel]
    hits = []
    for line, text in code_text(path):
        for phrase in allowed:
            text = text.replace(phrase, "")
        if MEASUREMENT.search(text):
            hits.append(f"src/sinklab/{rel}:{line}: {text.strip()}")
    return hits


FILES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.relative_to(SRC).as_posix())
def test_no_measurement_in_comments_or_docstrings(path):
    hits = measurements(path)
    assert not hits, ("a measurement in code text (move it to docs/ or benchmarks/results/; a definition goes into "
                      "ALLOWED of tests/test_code_text.py with its reason):\n" + "\n".join(hits))


def test_every_allowed_phrase_is_still_in_its_file():
    """An allow-list entry whose phrase is gone would silently allow it elsewhere in that file."""
    stale = [(file, phrase) for (file, phrase) in ALLOWED
             if not any(phrase in text for _, text in code_text(SRC / file))]
    assert not stale, f"ALLOWED entries no longer in their file's comments/docstrings: {stale}"


@pytest.mark.parametrize("text", [
    "# SmolLM2 59.0 → 47.2–51.5 ms per token", "took 2.75 ms in float16", "# ≈ 7 CPU s for 16 × 64 positions",
    "diagnose ≈ 19× a scan", "4–10× over the whole model's attention", "(1.3x at 1,024 queries)",
    "# 120 tokens/s on one core", "RSS 1,816 MB", "cuts the share from 46.7 % to 4.8 %", "in 382 s",
])
def test_the_rule_catches_measurements(text):
    assert MEASUREMENT.search(text), text


@pytest.mark.parametrize("text", [
    "# (B, nh, T, hs)", "a 6 × 6 grid = 36 patches", "262,144 × 640 logits", "16 × 256 tokens by default",
    "Sink_k^ε at position 0", "float16 and bfloat16", "|a| ≥ 1000 × median |a|", "top-1", "the 32 newest",
    "4 bits: 2 → 1", "x0 and x1",
])
def test_the_rule_lets_definitions_through(text):
    assert not MEASUREMENT.search(text), text
