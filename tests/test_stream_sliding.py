"""The model's own sliding-window layers (Mistral, gpt-oss, Gemma 2/3) and learned sink logits, streamed.

Before any full-attention layer evicts, the stream equals the model's own forward (float32, 1e-5 relative);
afterwards it equals the independent float64 reference of the per-layer rules (tests/stream_reference.py).
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from stream_reference import Reference

from sinklab.stream import SinkCache, StreamSession

V = 97
_BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
TYPES = ["sliding_attention", "full_attention"]
CONFIGS = {
    "mistral-sw8": (tf.MistralConfig, tf.MistralForCausalLM, dict(_BASE, sliding_window=8), "sdpa"),
    "gpt-oss": (tf.GptOssConfig, tf.GptOssForCausalLM,
                dict(_BASE, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=6,
                     layer_types=TYPES), "eager"),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM,
               dict(_BASE, head_dim=8, sliding_window=6, layer_types=TYPES, query_pre_attn_scalar=8,
                    attn_logit_softcapping=5.0), "eager"),
    "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM,
               dict(_BASE, head_dim=8, sliding_window=6, layer_types=TYPES, query_pre_attn_scalar=8), "eager"),
}


# Only under generate() (test_generate_equals_the_models_own_generate_before_eviction).
GENERATE_ONLY = {
    # a window (12) wider than the prompt (8), crossed while decoding
    "mistral-sw12": (tf.MistralConfig, tf.MistralForCausalLM, dict(_BASE, sliding_window=12), "sdpa"),
    "mistral-sw12-eager": (tf.MistralConfig, tf.MistralForCausalLM, dict(_BASE, sliding_window=12), "eager"),
    "qwen2-layer-types": (tf.Qwen2Config, tf.Qwen2ForCausalLM,
                          dict(_BASE, use_sliding_window=True, sliding_window=6, layer_types=TYPES), "sdpa"),
    "cohere2": (tf.Cohere2Config, tf.Cohere2ForCausalLM, dict(_BASE, sliding_window=6, layer_types=TYPES), "sdpa"),
}


def build(name: str):
    cfg_cls, model_cls, kwargs, attn = {**CONFIGS, **GENERATE_ONLY}[name]
    cfg = cfg_cls(**kwargs)
    cfg._attn_implementation = attn
    torch.manual_seed(4)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # sharper attention so the windows matter; visible learned sinks
        for pname, p in model.named_parameters():
            if "q_proj.weight" in pname or "k_proj.weight" in pname:
                p.mul_(4.0)
            if pname.endswith(".sinks"):
                p.copy_(torch.linspace(-1.0, 2.0, p.numel()))
    return model


def _tokens(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(2, V, (n,), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


@pytest.mark.parametrize("name", list(CONFIGS))
def test_equals_the_models_own_forward_before_eviction(name):
    """Sliding layers drop tokens natively from token 8/6 on; the full layers (S + W = 32) never evict here."""
    model = build(name)
    tokens = _tokens(30)[None]
    with torch.no_grad():
        dense = model(input_ids=tokens).logits[0]
    with StreamSession(model, num_sinks=4, window=28, chunk_size=7) as s:
        chunked = s.feed(tokens[:, :20], all_logits=True)[0]
        decoded = [s.step(tokens[:, i]) [0] for i in range(20, 30)]
    ours = torch.cat([chunked, torch.stack(decoded)])
    assert _rel(ours, dense) < 1e-5, _rel(ours, dense)


CASES = [("mistral-sw8", 2, 6), ("gpt-oss", 2, 6), ("gemma2", 2, 6),  # native sliding layers (w ≤ S + W)
         ("gemma3", 1, 3)]  # w = 6 > S + W = 4: the sliding layers get sinks + window too


@pytest.mark.parametrize("name,num_sinks,window", CASES)
def test_matches_reference_past_eviction(name, num_sinks, window):
    model = build(name)
    ref = Reference(model, num_sinks, window)
    tokens = _tokens(36, seed=5)
    worst = 0.0
    with StreamSession(model, num_sinks=num_sinks, window=window, chunk_size=13) as s:
        first = s.feed(tokens[None, :13], all_logits=True)[0]  # this chunk already overflows every budget
        for i in range(13):
            worst = max(worst, _rel(first[i], ref.step(int(tokens[i]))))
        for i in range(13, 36):
            worst = max(worst, _rel(s.step(tokens[i : i + 1])[0], ref.step(int(tokens[i]))))
        kept = [int(st.s_valid[0].sum()) for st in s.sink.layer_states]
    assert kept == [ref.kept(i) for i in range(2)]
    assert worst < 1e-4, worst


def test_budgets_per_layer_and_sliding_sinks_option():
    model = build("gemma3")
    cache = SinkCache(model, num_sinks=2, window=6)
    assert [(st.num_sinks, st.window) for st in cache.layer_states] == [(0, 6), (2, 6)]
    assert cache.layer_states[0].rope.inv_freq[1] != cache.layer_states[1].rope.inv_freq[1]  # local vs global base
    cache.close()
    cache = SinkCache(model, num_sinks=2, window=6, sliding_sinks=True)
    assert [(st.num_sinks, st.window) for st in cache.layer_states] == [(2, 6), (2, 6)]
    assert len(cache.states) == 2  # same budget, different RoPE bases: still two groups
    cache.close()
    ref = Reference(model, 2, 6, sliding_sinks=True)
    tokens = _tokens(20, seed=8)
    with StreamSession(model, num_sinks=2, window=6, sliding_sinks=True) as s:
        for i in range(20):
            assert _rel(s.step(tokens[i : i + 1])[0], ref.step(int(tokens[i]))) < 1e-4


def test_learned_sink_logits_flow_through_the_stream():
    """gpt-oss: the stream uses the per-head ``sinks`` logits (zeroing them changes the logits the same way)."""
    model = build("gpt-oss")
    tokens = _tokens(20, seed=9)[None]
    with StreamSession(model, num_sinks=2, window=30) as s:
        with_sinks = s.feed(tokens, all_logits=True)[0]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink logit of −∞ is ordinary softmax
        dense_no_sinks = model(input_ids=tokens).logits[0]
    with StreamSession(model, num_sinks=2, window=30) as s:
        without = s.feed(tokens, all_logits=True)[0]
    assert _rel(without, dense_no_sinks) < 1e-5
    assert _rel(with_sinks, without) > 1e-2


# ----------------------------------------------------------------------------- generate(), the SinkCache switched on
# by generate()'s own first forward (no `with` block): that forward gets a 4-D mask prepared by the model's own mask
# function (a compileable cache gets its masks built before the forward), sliding-window or eager-additive.
GENERATE = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0,
                eos_token_id=None)


@pytest.mark.parametrize("padded", [False, True], ids=["one-row", "left-padded"])
@pytest.mark.parametrize("name", [*CONFIGS, *GENERATE_ONLY])
def test_generate_equals_the_models_own_generate_before_eviction(name, padded):
    """A fresh SinkCache handed to generate() without a `with` block (nothing evicted: S + W = 68) generates what
    the model's own cache generates. Its first forward's mask was built by the model's own (sliding-window) mask
    function; read as the stream's own, every prompt token came out as padding (0.1–0.5 off on the first step)."""
    model = build(name)
    ids = _tokens(16, seed=11).view(2, 8)
    mask = torch.ones_like(ids)
    if padded:
        ids[1, :3], mask[1, :3] = 0, 0
    else:
        ids, mask = ids[:1], mask[:1]
    with torch.no_grad():
        own = model.generate(ids, attention_mask=mask, **GENERATE)
        cache = SinkCache(model, num_sinks=4, window=64)
        ours = model.generate(ids, attention_mask=mask, cache=cache, **GENERATE)
        cache.close()
        forward = model(input_ids=ids, attention_mask=mask).logits[:, -1]
    assert torch.equal(ours.sequences, own.sequences)
    first = float((ours.logits[0] - own.logits[0]).abs().max())
    assert first <= 1e-5, first
    assert float((ours.logits[0] - forward).abs().max()) <= 1e-5
    assert max(float((a - b).abs().max()) for a, b in zip(ours.logits, own.logits)) <= 1e-4


def test_generate_matches_reference_past_eviction():
    """generate() through a SinkCache that evicts from the prompt on (S + W = 2 + 6 < 8 + 12 tokens; the model's
    own window is 8): every step's logits equal the float64 StreamingLLM reference fed the same tokens."""
    model = build("mistral-sw8")
    prompt = _tokens(8, seed=12)
    with torch.no_grad():
        cache = SinkCache(model, num_sinks=2, window=6)
        out = model.generate(prompt[None], cache=cache, **dict(GENERATE, max_new_tokens=12))
        cache.close()
    ref = Reference(model, 2, 6)
    for t in prompt[:-1].tolist():
        ref.step(t)
    fed = [int(prompt[-1])] + out.sequences[0, len(prompt):-1].tolist()
    worst = max(_rel(logits[0], ref.step(t)) for logits, t in zip(out.logits, fed))
    assert worst < 1e-4, worst
