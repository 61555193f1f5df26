"""Architectures whose features sinklab cannot reproduce: refused up front (sinklab._compat.check_capture /
check_stream) with what the model does and what would lift the refusal — never a traceback of another type, never
silently wrong numbers. What sinklab does handle is checked against the model's own forward.

Tiny random configs in code (hidden 64, 2–4 layers, 4 heads, vocabulary 128, a few experts), a character-level
tokenizer built here: no download.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from transformers import AutoConfig, AutoModelForCausalLM

import sinklab
from sinklab.capture import AttentionCapture
from sinklab.errors import UnsupportedModelError
from sinklab.stream import SinkCache

V = 128
TEXT = ["the quick brown fox jumps over the lazy dog, and then it runs away again. " * 2]
_COMMON = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
_INKLING = dict(head_dim=16, swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=16,
                sliding_window_size=8, d_rel=4, rel_extent=16, moe_intermediate_size=32, n_routed_experts=4,
                num_experts_per_tok=2)
FAMILIES = {
    "deepseek_v4": dict(head_dim=16, q_lora_rank=32, moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=2, n_shared_experts=1, sliding_window=8, o_groups=2, o_lora_rank=16,
                        index_n_heads=2, index_head_dim=16, index_topk=4, hc_mult=2, num_key_value_heads=1),
    "hy_v4": dict(head_dim=16, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4,
                  num_experts_per_tok=2, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
                  v_head_dim=16, index_topk=4, index_head_dim=16, index_n_heads=2, hc_mult=2),
    "inkling_text": dict(_INKLING, intermediate_size=64, n_shared_experts=1),
    "inkling2_text": dict(_INKLING, unpadded_vocab_size=V, n_layers_per_attn_res_block=1),
    "inkling2_loop_text": dict(_INKLING, unpadded_vocab_size=V, n_layers_per_attn_res_block=1, num_hidden_layers=4,
                               loop_layer_index_start=1, loop_layer_index_end=3, loop_num_passes=2, loop_gate_rank=4),
}

# What each family does that sinklab cannot reproduce, as the refusal names it (None: sinklab handles it).
SCAN_REFUSAL = {
    "deepseek_v4": r"residual streams per token \(hyper-connections.*compressed summaries of blocks of past tokens",
    "hy_v4": r"residual streams per token \(hyper-connections.*learned indexer pick each query's top-4 keys",
    "inkling_text": None,
    "inkling2_text": r"attention over depth.*sink logit from its hidden state",
    "inkling2_loop_text": r"runs layers 1–3 2 times per token.*attention over depth.*sink logit from its hidden",
}
STREAM_REFUSAL = {
    "deepseek_v4": r"compressed summaries of blocks of past tokens.*lifting it needs a stream policy",
    "hy_v4": r"learned indexer pick each query's top-4 keys.*lifting it needs both",
    "inkling_text": r"relative-position bias.*recomputed at slot distances.*short causal convolutions.*no convolution",
    "inkling2_text": r"attention over depth.*sink logit from its hidden state.*relative-position bias.*convolutions",
    "inkling2_loop_text": r"2 times per token.*per-pass layers.*attention over depth.*relative-position bias",
}


def build(model_type: str):
    config = AutoConfig.for_model(model_type, **{**_COMMON, **FAMILIES[model_type]})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.fixture(scope="module")
def tokenizer():
    """Characters as tokens (vocabulary 128, no files)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>"] + [chr(i) for i in range(32, 32 + V - 4)])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return tf.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>")


def _ids():
    ids = torch.randint(4, V, (2, 12), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0
    return ids, mask


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_scan_runs_or_refuses_cleanly(model_type, tokenizer):
    model = build(model_type)
    refusal = SCAN_REFUSAL[model_type]
    if refusal is not None:
        with pytest.raises(UnsupportedModelError, match=refusal) as err:
            sinklab.scan(model, tokenizer, TEXT, seq_len=32, samples=2)
        assert f"({model_type}) cannot be captured" in str(err.value) and "lifting it needs" in str(err.value)
        return
    result = sinklab.scan(model, tokenizer, TEXT, seq_len=32, samples=2)
    assert result.column_mass.shape == (2, 2, 4, 32)
    # The capture's attention (relative-position bias included) reproduces the model's own forward.
    _capture_reproduces_the_forward(model)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_stream_refuses_cleanly(model_type):
    model = build(model_type)
    with pytest.raises(UnsupportedModelError, match=STREAM_REFUSAL[model_type]) as err:
        SinkCache(model, num_sinks=4, window=64)
    assert f"({model_type}) cannot be streamed with a SinkCache" in str(err.value)
    assert "lifting it needs" in str(err.value)
    ids, _ = _ids()
    with torch.no_grad():  # nothing of sinklab stayed on the model: its own generate still runs
        model.generate(ids[:1], max_new_tokens=2, do_sample=False, pad_token_id=0)


def _doge():
    config = tf.DogeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = tf.DogeForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # a trained Doge's dynamic-mask gate (0 at init makes the bias constant)
            layer.self_attn.A.fill_(1.0)
    return model


def _capture_reproduces_the_forward(model, padded_row: bool = True) -> None:
    """Under the capture the model's logits equal its own forward (row 1's real tokens too, when asked)."""
    ids, mask = _ids()
    with torch.no_grad():
        own = model(input_ids=ids, attention_mask=mask).logits
        with AttentionCapture(model) as cap:
            cap.run(full_model=True, input_ids=ids, attention_mask=mask)
            captured = cap.last_output.logits
    torch.testing.assert_close(captured[0], own[0], rtol=1e-5, atol=1e-5)
    if padded_row:
        torch.testing.assert_close(captured[1, :8], own[1, :8], rtol=1e-5, atol=1e-5)


def test_doge_dynamic_mask_captured_but_not_streamed():
    """Doge adds a learned, value-dependent bias to its scores through the attention mask. The capture applies the
    mask it is handed (matches the model's own forward); the stream masks by cache metadata and would drop the bias
    (0.0015 off on a plain forward, a crash under generate()), so SinkCache refuses it."""
    model = _doge()
    _capture_reproduces_the_forward(model, padded_row=False)
    with pytest.raises(UnsupportedModelError, match=r"\(doge\) cannot be streamed.*dynamic mask attention.*never reads "
                                                    r"the attention mask.*lifting it needs"):
        SinkCache(model, num_sinks=4, window=64)
