"""The shipped builtin:tiny-lm: small, safetensors, and the position-0 sink its model card states."""

from __future__ import annotations

import pytest
import torch

import sinklab
from sinklab.models import tiny_lm_path


@pytest.fixture(scope="module")
def tiny_lm():
    return sinklab.load_model("builtin:tiny-lm")


def test_shipped_files_are_small_safetensors():
    files = {p.name: p.stat().st_size for p in tiny_lm_path().iterdir()}
    assert "model.safetensors" in files and not any(n.endswith((".bin", ".pt", ".pkl")) for n in files)
    assert sum(files.values()) < 20e6
    assert "Recipe" in (tiny_lm_path() / "README.md").read_text()


def test_tiny_lm_has_the_measured_layer0_sink(tiny_lm):
    r = sinklab.scan(tiny_lm.model, tiny_lm.tokenizer, seq_len=64, samples=16)
    assert r.meta["tokenizer_added_bos"] is True and r.tokens[0][0] == "<s>"
    rate = r.sink_rate_per_layer(0)
    # Model card (16 pydoc samples, T = 64): 98.4 % of layer-0 heads, 0 % in layers 1–3; mean attention
    # to position 0 in layer 0 ≈ 0.51 (uniform causal attention would give ≈ 0.07).
    assert float(rate[0]) > 80.0 and float(rate[1:].max()) < 10.0
    assert float(r.column_mass[:, 0, :, 0].double().mean()) > 0.4


def _greedy_stream(model, ids: torch.Tensor, window: int, n: int) -> list[int]:
    with sinklab.StreamSession(model, num_sinks=4, window=window) as s:
        logits, tokens = s.feed(ids), []
        for _ in range(n):
            tokens.append(int(logits[0].argmax()))
            logits = s.step(torch.tensor(tokens[-1:]))
        assert s.cache_tokens() == min(4 + window, ids.shape[1] + n)
    return tokens


def test_tiny_lm_streams(tiny_lm):
    """The shipped model's stream: greedy generate() while nothing is evicted, the float64 reference after."""
    from transformers import DynamicCache

    from stream_reference import Reference

    model, tok = tiny_lm.model, tiny_lm.tokenizer
    prompt = "Return the value of"
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    pieces = list(sinklab.stream_generate(model, tok, prompt, num_sinks=4, window=64, max_new_tokens=24,
                                          stop_at_eos=False))
    assert len(pieces) == 24 and len("".join(pieces)) > 24  # byte-level BPE pieces join into words
    with torch.no_grad():
        dense = model.generate(ids, **{sinklab._compat.cache_kwarg_name(model): DynamicCache(config=model.config)},
                               max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
    assert _greedy_stream(model, ids, 64, 24) == dense[ids.shape[1]:].tolist()
    # Past eviction (S = 4, W = 8 over 5 + 40 tokens): each greedy token is the float64 reference's argmax.
    tokens = _greedy_stream(model, ids, 8, 40)
    ref = Reference(model, 4, 8)
    for t in ids[0].tolist():
        logits = ref.step(t)
    for t in tokens:
        assert int(logits.argmax()) == t
        logits = ref.step(t)
    assert ref.kept(0) == 12
    assert torch.isfinite(tiny_lm.model(**tiny_lm.tokenizer("Hello", return_tensors="pt")).logits).all()
