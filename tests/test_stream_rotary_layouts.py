"""Streaming architectures whose positions are not Llama's: each family against an independent reference.

With one layer, a kept key depends only on its token and its position, so a stream that keeps the first ``S``
tokens and the ``W`` most recent must give exactly the logits of a plain forward of the model — its own
attention, no cache, no sinklab — over those kept tokens at positions ``0 … n−1``. That reference shares no code
with sinklab; it holds for every rotary layout, for latent attention and for layers without positions. Each
case is a family the stream once got wrong (interleaved pairs, partial or reversed rotation, the decoupled
rotary key of latent attention, NoPE layers) or a control (Llama). Float64, so any layout error shows far
above rounding.
"""

from __future__ import annotations

import pytest
import torch
import transformers as tf

import sinklab
from sinklab import SinkCache
from sinklab._compat import layer_rotations

V = 101
_BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, initializer_range=0.2,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, head_dim=8,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1)

#: name → (config class, overrides, what the probe must find: (rotated tensor, interleaved, offset, reversed))
CASES = {
    "llama (control)": ("LlamaConfig", {}, ("keys", False, 0, False)),
    "cohere (interleaved)": ("CohereConfig", {}, ("keys", True, 0, False)),
    "glm (partial, interleaved)": ("GlmConfig", {}, ("keys", True, 0, False)),
    "helium (interleaved)": ("HeliumConfig", {}, ("keys", True, 0, False)),
    "ernie4_5 (interleaved)": ("Ernie4_5Config", {}, ("keys", True, 0, False)),
    "nanochat (reversed)": ("NanoChatConfig", {}, ("keys", False, 0, True)),
    "deepseek_v3 (latent attention)": ("DeepseekV3Config", _MLA, ("values", False, 0, False)),
    "deepseek_v2 (latent attention, complex rotary)": ("DeepseekV2Config", _MLA, ("values", True, 0, False)),
    "minicpm3 (latent attention)": ("MiniCPM3Config", _MLA, ("values", False, 0, False)),
    "exaone4 (NoPE global layer)": ("Exaone4Config", dict(layer_types=["full_attention"]), None),
    "smollm3 (NoPE layer)": ("SmolLM3Config", dict(no_rope_layers=[0]), None),
}


def _build(name: str) -> torch.nn.Module:
    cfg_name, over, _ = CASES[name]
    config = getattr(tf, cfg_name)(**{**_BASE, **over})
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config).eval().double()


@torch.no_grad()
def _plain_logits(model, kept: list[int]) -> torch.Tensor:
    """The model's own forward over ``kept`` at positions 0 … n−1: the last token's logits."""
    ids = torch.tensor([kept])
    return model(input_ids=ids, position_ids=torch.arange(len(kept))[None], use_cache=False).logits[0, -1]


@pytest.mark.parametrize("name", list(CASES))
def test_rotation_is_measured(name):
    """The probe finds the layout each family is known to use (or none on a NoPE layer)."""
    rotation = layer_rotations(_build(name))[0]
    want = CASES[name][2]
    if want is None:
        assert rotation.cache_rope is None and rotation.attn_rope is None
        return
    rotated, interleaved, offset, reversed_ = want
    assert rotation.rotated == rotated
    assert rotation.cache_rope.interleaved == interleaved and rotation.cache_rope.offset == offset
    assert bool((rotation.cache_rope.inv_freq < 0).all()) == reversed_
    if rotated == "values":  # latent attention: the attention's key is [nope | rotary]
        assert rotation.attn_rope.offset == _MLA["qk_nope_head_dim"]


@pytest.mark.parametrize("name", list(CASES))
def test_stream_past_eviction_equals_a_plain_forward_over_the_kept_tokens(name):
    model = _build(name)
    sinks, window = 4, 8
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(3, V, (44,), generator=g).tolist()
    prompt = 30
    cache = SinkCache(model, num_sinks=sinks, window=window)
    worst = 0.0
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens[:prompt]]), cache=cache, use_cache=True)
        got = [out.logits[0, -1]]
        for t in range(prompt, len(tokens)):
            got.append(model(input_ids=torch.tensor([[tokens[t]]]), cache=cache, use_cache=True).logits[0, -1])
    cache.close()
    for i, logits in enumerate(got):
        n = prompt + i  # tokens seen so far
        kept = tokens[:sinks] + tokens[max(sinks, n - window) : n]
        want = _plain_logits(model, kept)
        worst = max(worst, float((logits - want).abs().max() / want.abs().max()))
    assert worst < 1e-6, f"{name}: stream differs from the plain forward over the kept tokens by {worst:.3g}"


def _scale_by_position(model, projection: str) -> list:
    """Hooks that scale one projection's output by ``1 + 10⁻³·position``: a position dependence that no rotation
    reproduces (the probe puts one token per row, each row at its own position)."""
    seen = {}

    def positions(module, args, kwargs):
        seen["p"] = kwargs["position_ids"].to(torch.float64)

    def scale(module, args, output):
        return output * (1.0 + 1e-3 * seen["p"][:, :, None])

    attn = model.model.layers[0].self_attn
    return [model.model.register_forward_pre_hook(positions, with_kwargs=True),
            getattr(attn, projection).register_forward_hook(scale)]


@pytest.mark.parametrize("projection, message", [
    ("k_proj", "change with position in a way no rotary layout reproduces"),
    ("q_proj", "the query its attention receives does not turn with position"),
])
def test_a_position_dependence_that_is_not_a_rotation_is_refused(projection, message):
    """Keys (or only queries) that move with position other than by a rotation: refused, the error measured."""
    model = _build("llama (control)")
    hooks = _scale_by_position(model, projection)
    try:
        with pytest.raises(sinklab.UnsupportedModelError, match=message):
            SinkCache(model)
    finally:
        for h in hooks:
            h.remove()


def test_a_model_that_ignores_position_ids_is_refused():
    """Keys that depend on position but not on the ``position_ids`` given (here: a pre-hook throws them away, so the
    model counts positions itself) would look position-free to a one-token probe; the probe checks and refuses."""
    model = _build("llama (control)")

    def drop(module, args, kwargs):
        kwargs.pop("position_ids", None)
        return args, kwargs

    handle = model.model.register_forward_pre_hook(drop, with_kwargs=True)
    try:
        with pytest.raises(sinklab.UnsupportedModelError, match="not on the position_ids it is given"):
            SinkCache(model)
    finally:
        handle.remove()
