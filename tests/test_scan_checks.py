"""Scan input checks and correctness on causal LMs: thresholds, seed, short sequences, non-finite
activations, end-of-sequence false sinks (synthetic self-attending heads and the real SmolLM2)."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf
from typer.testing import CliRunner

import sinklab
from sinklab import metrics
from sinklab.cli import app
from sinklab.errors import InputError, ModelWeightsError
from sinklab.models import _minilm_tokenizer, tiny_llama
from sinklab.scan import ShortSequenceWarning


def _self_attending_llama() -> tf.LlamaForCausalLM:
    """q = k with large weights: under RoPE every query attends mostly to itself, so in a causal model the
    last keys (seen by one or two queries) get a large column mass — end-of-sequence false sinks."""
    cfg = tf.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.copy_(layer.self_attn.q_proj.weight)
    return model


def test_end_of_sequence_keys_are_not_dominant_columns():
    ids = torch.randint(2, 97, (2, 48), generator=torch.Generator().manual_seed(0))
    r = sinklab.scan_inputs(_self_attending_llama(), [{"input_ids": ids}], [["t"] * 48] * 2)
    tail = 48 - 8 + 1  # keys seen by fewer than max(8, 48/8) = 8 queries
    # The plain argmax (the old rule) picks the last keys, several with a "sink" mass above 0.3 …
    old_dom = r.column_mass.nan_to_num(-1).argmax(-1)
    old_mass = r.column_mass.nan_to_num(-1).amax(-1)
    assert int(((old_dom >= tail) & (old_mass > 0.3)).sum()) >= 2
    # … the rule keeps them out: no dominant column in the tail, no head with mass > 0.3 (nothing sinks here).
    assert int((r.dominant_columns() >= tail).sum()) == 0
    assert float(r.sink_strength().max()) < 0.3
    d = sinklab.diagnose_inputs(_self_attending_llama(), [{"input_ids": ids}], [["t"] * 48] * 2, edits=False)
    assert not d.found
    # Gu et al.'s Sink_k^ε at a fixed position keeps its definition: position 47's mass still counts there.
    assert r.sink_rate(47) == metrics.sink_rate(r.column_mass, 47)


def test_eligible_columns_rule():
    counts = torch.tensor([[64.0 - j for j in range(64)], [5.0] * 5 + [4, 3, 2, 1] + [0.0] * 55])
    ok = metrics.eligible_columns(counts, torch.tensor([64.0, 9.0]))
    assert ok[0].sum() == 57 and bool(ok[0, 56]) and not bool(ok[0, 57])  # need max(8, 8) = 8 queries
    assert ok[1].tolist()[:9] == [True] * 5 + [False] * 4  # a 5-wide window: the most-seen keys
    assert metrics.min_visible_queries(torch.tensor(200.0)) == 25


def test_smollm2_has_no_end_of_sequence_sinks(smollm2):
    from sinklab.texts import default_texts

    r = sinklab.scan(smollm2.model, smollm2.tokenizer, default_texts(limit=2), seq_len=64, samples=2, batch_size=2)
    old_dom = r.column_mass.nan_to_num(-1).argmax(-1)  # the plain argmax: positions 62–63 in many heads
    assert int((old_dom >= 62).sum()) >= 10
    n = r.token_mask.sum(-1)  # (S,) real tokens
    assert bool((r.dominant_columns() <= (n - 8)[:, None, None]).all())
    assert r.meta["tokenizer_added_bos"] is False and r.tokens[0][0] != "<|im_start|>"


def test_unknown_threshold_keys_are_rejected(minilm):
    with pytest.raises(InputError, match="unknown scan threshold.*'epsilon'"):
        sinklab.scan(minilm.model, minilm.tokenizer, ["hello world"], thresholds={"epsilon": 0.1})


def test_seed_changes_the_windows_reproducibly(minilm):
    text = [" ".join(f"word{i}" for i in range(400)), " ".join(f"token{i}" for i in range(400))]
    kw = dict(seq_len=16, samples=3, batch_size=3)
    a = sinklab.scan(minilm.model, minilm.tokenizer, text, seed=0, **kw)
    b = sinklab.scan(minilm.model, minilm.tokenizer, text, seed=7, **kw)
    c = sinklab.scan(minilm.model, minilm.tokenizer, text, seed=7, **kw)
    assert a.tokens[0][1:3] == ["word", "##0"]  # seed 0: texts in order from their first token
    assert b.tokens != a.tokens and b.tokens == c.tokens
    torch.testing.assert_close(b.column_mass, c.column_mass, equal_nan=True)


def test_short_sequences_warn_with_the_needed_length(minilm, tmp_path):
    model = tiny_llama(num_hidden_layers=2)
    tok = _minilm_tokenizer()
    with pytest.warns(ShortSequenceWarning, match="fewer than 26 tokens.*0.52"):
        r = sinklab.scan(model, tok, ["a b"])  # [CLS] a b [SEP]: 4 causal tokens
    assert "at least 26 tokens" in r.meta["warnings"][0]
    assert metrics.uniform_column_mass(4) == pytest.approx((1 + 1 / 2 + 1 / 3 + 1 / 4) / 4)
    res = CliRunner().invoke(app, ["scan", "builtin:minilm", "--text", "hello world", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0 and "warning" in res.output and "at least 7 tokens" in res.output  # bidirectional


def test_non_finite_activations_name_the_layer():
    model = tiny_llama(num_hidden_layers=3)
    tok = _minilm_tokenizer()

    def blow_up(module, args, output):  # a block whose output overflows (as float16 can)
        hidden = output[0] if isinstance(output, tuple) else output
        hidden[:, 1] = math.inf
        return output

    handle = model.model.layers[1].register_forward_hook(blow_up)
    try:
        with pytest.raises(ModelWeightsError, match="output of block 1"):
            sinklab.scan(model, tok, ["a fairly ordinary sentence with enough words in it for a scan"])
    finally:
        handle.remove()
