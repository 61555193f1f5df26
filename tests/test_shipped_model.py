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


def test_tiny_lm_streams(tiny_lm):
    pieces = list(sinklab.stream_generate(tiny_lm.model, tiny_lm.tokenizer, "Return the value of", num_sinks=4,
                                          window=16, max_new_tokens=24, stop_at_eos=False))
    text = "".join(pieces)
    assert len(pieces) == 24 and len(text) > 24  # byte-level BPE pieces join into words
    assert torch.isfinite(tiny_lm.model(**tiny_lm.tokenizer("Hello", return_tensors="pt")).logits).all()
