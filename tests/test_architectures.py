"""A slice of the architecture matrix (``benchmarks/architectures.py``): one tiny model per attention/cache
mechanism through every cell, in-process. Each cell must be ``ok`` or ``refused`` with a reason — never a crash
or a wrong number. The whole matrix (every transformers causal-LM type) is ``python benchmarks/architectures.py``
and ``docs/architectures.md``; this slice does not run it.

Cells that crash or measure wrong numbers today are marked ``xfail(strict=True)`` with what they showed: when the
fix lands the test passes, the strict xfail fails, and the mark is removed.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "architectures.py"
_NAME = "sinklab_bench_architectures"


def _load():
    """The benchmark script as a module (registered, so its dataclasses resolve)."""
    if _NAME in sys.modules:
        return sys.modules[_NAME]
    spec = importlib.util.spec_from_file_location(_NAME, _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
    return module


arch = _load()

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
    return arch.build(name)


@lru_cache(maxsize=1)
def _tokenizer():
    return arch.tiny_tokenizer()


def _cell(name: str, cell: str):
    built = _built(name)
    run = {
        "scan": lambda: arch.cell_scan(built, _tokenizer()),
        "stream": lambda: arch.cell_stream(built),
        "stream_evicted": lambda: arch.cell_stream_evicted(built),
        "diagnose": lambda: arch.cell_diagnose(built, _tokenizer()),
        "circuit": lambda: arch.cell_circuit(built, _tokenizer()),
    }[cell]
    return arch.run_cell(run)


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
    assert list(gemma.layer_types) == ["sliding_attention", "full_attention"] and gemma.sliding_window == arch.OWN_WINDOW
    oss = _built("gpt_oss").model.config
    assert sorted(oss.layer_types) == ["full_attention", "sliding_attention"]
    mla = _built("deepseek_v3").model.config
    assert mla.qk_head_dim == mla.qk_nope_head_dim + mla.qk_rope_head_dim and mla.num_key_value_heads == mla.num_attention_heads
    one = arch.build("gemma3_text", layers=1, window=arch.EVICT_OWN_WINDOW, prefer_full=True).model.config
    assert list(one.layer_types) == ["full_attention"] and one.num_hidden_layers == 1
    assert sum(p.numel() for p in _built("llama").model.parameters()) < arch.MAX_PARAMETERS


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
    monkeypatch.setattr(arch, "MAX_PARAMETERS", 1000)
    with pytest.raises(arch.NotBuilt, match="parameters after shrinking"):
        arch.build("llama")
