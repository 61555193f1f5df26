"""A slice of the architecture matrix (:mod:`sinklab.testing.conformance`): one tiny model per attention/cache
mechanism through every cell, and every extra configuration (other layer counts, mixed layer kinds), in-process.
Each cell must be ``ok`` or ``refused`` with a reason — never a crash or a wrong number. The whole matrix (every
transformers causal-LM type) is ``make architectures`` (``benchmarks/architectures.py``), written to
``docs/architectures.md``; this slice does not run it, but checks that the committed table was made from the
sources under test (its fingerprint).

Cells that crash or measure wrong numbers today are marked ``xfail(strict=True)`` with what they showed: when the
fix lands the test passes, the strict xfail fails, and the mark is removed.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

from sinklab.testing import conformance as arch
from sinklab.testing import tiny

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")

#: One transformers model type per mechanism the stream and the capture must handle.
MECHANISMS = {
    "llama": "dense RoPE",
    "gpt_neox": "partial rotary",
    "mistral": "its own sliding window",
    "gemma3_text": "one rotary table per layer type (local / global)",
    "gpt_oss": "learned sink logits",
    "cohere": "interleaved rotary",
    "deepseek_v3": "multi-head latent attention (MLA)",
    "exaone4": "global layers without positions (NoPE)",
    "smollm3": "NoPE every fourth layer",
    "qwen3_next": "hybrid linear attention",
    "nemotron_h": "hybrid: Mamba-2, MLP-only and attention blocks, one sublayer each",
    "bloom": "ALiBi",
    "gpt2": "learned absolute positions",
    "bart": "the decoder of an encoder-decoder family (counts its own learned positions)",
    "llama4_text": "chunked attention",
    "gemma3n_text": "AltUp (several stacked copies of the hidden state)",
    "bigbird_pegasus": "a block-sparse attention setting in the config (decoder attends causally)",
}

#: Cells that must be refused with a reason (not merely "ok or refused").
MUST_REFUSE = {
    ("bloom", "stream"): "ALiBi streaming is not implemented yet (update this when it lands)",
    ("bloom", "stream_evicted"): "ALiBi streaming is not implemented yet (update this when it lands)",
    ("gpt2", "stream"): "absolute positions cannot be moved to cache slots",
    ("gpt2", "stream_evicted"): "absolute positions cannot be moved to cache slots",
    ("bart", "stream"): "positions it counts itself cannot be moved to cache slots",
    ("llama4_text", "stream"): "chunked attention is not streamed yet",
    ("gemma3n_text", "circuit"): "AltUp's stacked copies of the hidden state: the circuit splits one residual stream",
}

#: Cells that do not apply, and why.
NOT_APPLICABLE: dict[tuple[str, str], str] = {}

#: Cells that must be ok, checked the way the message says (a hybrid past eviction: against the float64 stream
#: reference, since a one-layer Qwen3-Next would be a lone linear-attention layer and its recurrent state has seen
#: every token).
MUST_PASS = {
    ("qwen3_next", "stream"): "tokens equal",
    ("qwen3_next", "stream_evicted"): "float64 stream reference",
    ("qwen3_next", "scan"): "recurrent/MLP-only, marked as such",
    ("qwen3_next", "circuit"): "",
    ("nemotron_h", "scan"): "3 recurrent/MLP-only, marked as such",
    ("nemotron_h", "circuit"): "",
}

#: Cells that crash or are wrong today: (type, cell) → what they showed. Strict: remove the entry when fixed.
KNOWN_FAILURES: dict[tuple[str, str], str] = {}


@lru_cache(maxsize=None)
def _built(name: str):
    return arch.configuration(name).build()


def _cell(name: str, cell: str):
    return arch.run_cells(_built(name), arch.configuration(name), cells=(cell,))[cell]


def _cases():
    for name in MECHANISMS:
        for cell in arch.CELLS:
            marks = []
            if (name, cell) in KNOWN_FAILURES:
                marks.append(pytest.mark.xfail(strict=True, reason=KNOWN_FAILURES[(name, cell)]))
            yield pytest.param(name, cell, marks=marks, id=f"{name}-{cell}")


@pytest.mark.parametrize("name,cell", list(_cases()))
def test_cell_is_ok_or_refused_with_a_reason(name, cell):
    result = _cell(name, cell)
    where = f"{name} ({MECHANISMS[name]}) {cell}"
    if (name, cell) in NOT_APPLICABLE:
        assert result.status == "n/a" and result.message, f"{where}: {result.text()}"
        return
    if (name, cell) in MUST_PASS:
        assert result.status == "ok" and MUST_PASS[(name, cell)] in result.message, f"{where}: {result.text()}"
    if (name, cell) in MUST_REFUSE:
        assert result.status == "refused", f"{where} should be refused ({MUST_REFUSE[(name, cell)]}): {result.text()}"
    assert result.status in ("ok", "refused"), f"{where}: {result.text()}"
    if result.status == "refused":
        assert len(result.message.strip()) > 20, f"{where}: refused without a reason: {result.text()!r}"


def test_shrunk_configs_keep_the_mechanism():
    """The shrinker keeps what makes each type what it is: one local and one global layer (Gemma 3, gpt-oss),
    the MLA ranks consistent (DeepSeek-V3), a one-layer variant that is a global layer with a widened window."""
    gemma = _built("gemma3_text").model.config
    assert list(gemma.layer_types) == ["sliding_attention", "full_attention"] and gemma.sliding_window == tiny.OWN_WINDOW
    oss = _built("gpt_oss").model.config
    assert sorted(oss.layer_types) == ["full_attention", "sliding_attention"]
    mla = _built("deepseek_v3").model.config
    assert mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim and mla.num_key_value_heads == mla.num_attention_heads
    one = tiny.build("gemma3_text", layers=1, window=arch.EVICT_OWN_WINDOW, prefer_full=True).model.config
    assert list(one.layer_types) == ["full_attention"] and one.num_hidden_layers == 1
    assert sum(p.numel() for p in _built("llama").model.parameters()) < tiny.MAX_PARAMETERS


def test_kept_tokens_is_the_streamingllm_rule():
    """The eviction reference keeps the first 4 tokens and the 8 most recent (the query's own included)."""
    import torch

    tokens = torch.arange(40)[None]
    assert arch.kept_tokens(tokens, 5).tolist() == [list(range(6))]
    assert arch.kept_tokens(tokens, 11).tolist() == [list(range(12))]
    assert arch.kept_tokens(tokens, 30).tolist() == [[0, 1, 2, 3, *range(23, 31)]]


def test_a_type_that_cannot_be_built_says_why(monkeypatch):
    """``not built`` is the model's own failure (here: too big after shrinking), with its reason — distinct from
    sinklab refusing it."""
    monkeypatch.setattr(tiny, "MAX_PARAMETERS", 1000)
    with pytest.raises(tiny.NotBuilt, match="parameters after shrinking"):
        tiny.build("llama")


# ----------------------------------------------------------------------------- other configurations of some types
_INKLING = "inkling_text [4 layers, swa_num_attention_heads=8]"
_HEADS = "different numbers of heads (4 heads in layer(s) [3]; 8 heads in layer(s) [0, 1, 2])"

#: (configuration, cell) → what its message must contain, and the status it must have.
CONFIGURATION_EXPECT = {
    (_INKLING, "scan"): ("refused", _HEADS),
    (_INKLING, "diagnose"): ("refused", _HEADS),
    (_INKLING, "circuit"): ("refused", _HEADS),
    ("ergo [1 layer, evicted on its first layer kind]", "stream_evicted"): ("ok", "float64"),
    **{(name, "stream_evicted"): ("n/a", "the same model, checked there")  # the default row's one-layer variant
       for name in ("llama [1 layer]", "ergo [4 layers]", "gemma3_text [4 layers]", "gpt_oss [3 layers]",
                    "exaone4 [4 layers]")},
    ("qwen3_next [4 layers]", "stream_evicted"): ("ok", "float64 stream reference"),
    ("qwen3_next [4 layers]", "scan"): ("ok", "3 recurrent/MLP-only, marked as such"),
    ("gemma3_text [4 layers]", "stream"): ("ok", "tokens equal"),
}


def test_every_configuration_is_a_distinct_row_of_a_known_type():
    names = [c.name for c in arch.CONFIGURATIONS]
    assert len(set(names)) == len(names) and set(names).isdisjoint(tiny.all_types())
    assert all(arch.configuration(n) is c for n, c in zip(names, arch.CONFIGURATIONS))
    assert all(c.type in tiny.all_types() and c.why for c in arch.CONFIGURATIONS)
    assert {k for k, _ in CONFIGURATION_EXPECT} <= set(names)


@pytest.mark.parametrize("name", [c.name for c in arch.CONFIGURATIONS])
def test_configuration_cells_are_ok_or_refused_with_a_reason(name):
    """Each extra configuration through every cell (one model build for all five)."""
    built = _built(name)
    layers = arch.configuration(name).layers
    assert built.model.config.get_text_config().num_hidden_layers == layers, name
    for cell, result in arch.run_cells(built, arch.configuration(name)).items():
        where = f"{name} {cell}"
        status, phrase = CONFIGURATION_EXPECT.get((name, cell), (None, ""))
        if status is not None:
            assert result.status == status and phrase in result.message, f"{where}: {result.text()}"
        assert result.status in ("ok", "refused") or status == "n/a", f"{where}: {result.text()}"
        if result.status == "refused":
            assert len(result.message.strip()) > 20, f"{where}: refused without a reason: {result.text()!r}"


# ----------------------------------------------------------------------------- the committed table is current
def test_committed_matrix_was_made_from_the_sources_under_test():
    """``docs/architectures.md`` and its JSON record the fingerprint of the sources the cells exercise; a change to
    any of them (a fix, a new refusal) makes the committed table stale until ``make architectures`` reruns it."""
    data = json.loads((ROOT / "benchmarks" / "results" / "architectures.json").read_text(encoding="utf-8"))
    docs = (ROOT / "docs" / "architectures.md").read_text(encoding="utf-8")
    recorded = data["meta"]["source"]["fingerprint"]
    assert f"Source fingerprint: `{recorded}`" in docs, "docs/architectures.md and its JSON are from different runs"
    assert recorded == arch.source_fingerprint(), (
        f"docs/architectures.md was made from other sinklab sources (fingerprint {recorded}, the code under test "
        f"is {arch.source_fingerprint()}): regenerate it with `make architectures`")
    assert [r["type"] for r in data["rows"]] == arch.row_names(), "the table's rows are not the matrix's rows"


def test_fingerprint_covers_what_the_cells_run_and_changes_with_it(monkeypatch):
    """The fingerprint's files are the conformance module's sinklab imports, followed (function-level ones too);
    one changed byte in one of them changes it."""
    src = Path(arch.__file__).resolve().parents[1]
    files = {p.relative_to(src).as_posix() for p in arch.source_files()}
    assert {"testing/conformance.py", "testing/tiny.py", "testing/reference.py", "capture/core.py", "scan.py",
            "stream/attention.py", "stream/cache.py", "diagnose.py", "circuit/analysis.py", "_compat/rotary.py",
            "attention.py"} <= files
    assert not {f for f in files if f.startswith(("cli/", "report/"))} and "__init__.py" not in files
    before = arch.source_fingerprint()
    read = Path.read_bytes
    target = src / "stream" / "attention.py"
    monkeypatch.setattr(Path, "read_bytes", lambda self: read(self) + (b" " if self == target else b""))
    assert arch.source_fingerprint() != before


def test_nothing_imports_benchmarks_and_benchmarks_import_no_tests():
    """The matrix is library code: nothing in ``src/`` or ``tests/`` imports a ``benchmarks/`` script or edits
    ``sys.path``, and no benchmark imports a ``tests/`` module (they share code through ``sinklab.testing``)."""
    import ast

    bench = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    tests = {p.stem for p in (ROOT / "tests").glob("*.py")} | {"tests"}

    def offences(path: Path, forbidden: set[str]) -> list[str]:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found = []
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{path.relative_to(ROOT)}:{node.lineno}: imports {n}" for n in names
                      if n.split(".")[0] in forbidden]
            if (isinstance(node, ast.Attribute) and node.attr in ("insert", "append", "extend")
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "path"
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "sys"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: edits sys.path")
            if isinstance(node, ast.Attribute) and node.attr in ("spec_from_file_location", "run_path") and any(
                    isinstance(c, ast.Constant) and c.value == "benchmarks" for c in ast.walk(tree)):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: loads a file by path beside 'benchmarks'")
        return found

    library = [*sorted((ROOT / "src").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py")),
               *sorted((ROOT / "docs" / "examples").glob("*.py"))]
    bad = [o for p in library for o in offences(p, bench)]
    bad += [o for p in sorted((ROOT / "benchmarks").glob("*.py")) for o in offences(p, tests) if "sys.path" not in o]
    assert not bad, "\n".join(bad)
