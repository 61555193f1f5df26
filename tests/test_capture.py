"""Chunked capture statistics vs eager ``output_attentions=True`` references, on every architecture."""

from __future__ import annotations

import pytest
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from sinklab import AttentionCapture, CaptureConfig, metrics
from sinklab._compat import find_layers, head_weights

from tiny_models import CAUSAL, EAGER_ONLY, TEXT_MODELS, VISION_MODELS, build, inputs_for

ALL = list(TEXT_MODELS) + list(VISION_MODELS)
TOL = 1e-5


def _eager_reference(name: str):
    model = build(name, attn="eager")
    inputs = inputs_for(name)
    with torch.no_grad():
        out = model(**inputs, output_attentions=True, output_hidden_states=True)
    attn = torch.stack(out.attentions, dim=1).double()  # (B, L, H, T, T)
    return model, inputs, attn, out


def _visibility(name: str, model, inputs, attn: torch.Tensor) -> torch.Tensor:
    """Independent visibility: causal/bidirectional, the config's sliding windows, padding."""
    b, n_layers, _, t, _ = attn.shape
    mask = inputs.get("attention_mask")
    qmask = mask.bool() if mask is not None else torch.ones(b, t, dtype=torch.bool)
    vis = metrics.visibility(t, t, causal=name in CAUSAL, query_mask=qmask, key_mask=qmask)  # (B, T, T)
    layers = []
    types = getattr(model.config, "layer_types", None)
    window = getattr(model.config, "sliding_window", None)
    for layer in range(n_layers):
        v = vis
        sliding = window is not None and (types is None or types[layer] == "sliding_attention")
        if sliding:
            i = torch.arange(t)[:, None]
            j = torch.arange(t)[None, :]
            v = v & (i - j < window)
        layers.append(v)
    return torch.stack(layers, dim=1)[:, :, None]  # (B, L, 1, T, T)


@pytest.mark.parametrize("name", ALL)
def test_chunked_statistics_equal_eager_attentions(name):
    model, inputs, attn, out = _eager_reference(name)
    vis = _visibility(name, model, inputs, attn)
    captured_model = build(name)
    cfg = CaptureConfig(candidates=(0, 1, 5), map_len=8, chunk_elements=150)  # many query chunks
    with AttentionCapture(captured_model, cfg) as cap:
        batch = cap.run(**inputs)

    ref_mass = metrics.column_mass(attn, vis)
    assert torch.equal(torch.isnan(ref_mass), torch.isnan(batch.column_mass))
    torch.testing.assert_close(batch.column_mass.double().nan_to_num(), ref_mass.nan_to_num(), atol=TOL, rtol=0)
    torch.testing.assert_close(batch.column_min.double().nan_to_num(),
                               metrics.column_min(attn, vis).nan_to_num(), atol=TOL, rtol=0)
    ref_routed = metrics.routed_fraction(attn, vis)
    assert (batch.routed_fraction.double().nan_to_num() - ref_routed.nan_to_num()).abs().max() < TOL
    qvalid = vis.any(-1)[..., None]  # (B, L, 1, T, 1)
    ref_cand = torch.where(qvalid, attn[..., [0, 1, 5]], torch.nan)
    torch.testing.assert_close(batch.candidate_attention.double().nan_to_num(), ref_cand.nan_to_num(), atol=TOL, rtol=0)
    torch.testing.assert_close(batch.attention_maps.double(), attn[0, :, :, :8, :8], atol=TOL, rtol=0)
    row_sum = attn.sum(-1)  # (B, L, H, T)
    q = vis.any(-1).double()  # (B, L, 1, T)
    ref_sink = ((1 - row_sum) * q).sum(-1) / q.sum(-1)
    torch.testing.assert_close(batch.learned_sink_mass.double(), ref_sink, atol=TOL, rtol=0)
    if name in EAGER_ONLY:
        assert float(ref_sink.min()) > 0.01  # learned sink logits really take mass
    # Hidden states: index l = input of block l (the last entry of output_hidden_states may be post-norm).
    n_layers = attn.shape[1]
    for layer in range(n_layers):
        h = out.hidden_states[layer].double()
        tmask = batch.token_mask
        ref_norm = torch.where(tmask, h.norm(dim=-1), torch.nan)
        torch.testing.assert_close(batch.hidden_norm[:, layer].double().nan_to_num(), ref_norm.nan_to_num(),
                                   atol=1e-4, rtol=1e-5)
        ref_max = torch.where(tmask, h.abs().amax(-1), torch.nan)
        torch.testing.assert_close(batch.hidden_max_abs[:, layer].double().nan_to_num(), ref_max.nan_to_num(),
                                   atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("name", [n for n in ALL if n not in EAGER_ONLY])
def test_capture_leaves_model_outputs_unchanged_and_restores_it(name):
    model = build(name)
    inputs = inputs_for(name)
    with torch.no_grad():
        plain = model(**inputs).last_hidden_state if name in VISION_MODELS or name == "bert" else model(**inputs).logits
    with AttentionCapture(model) as cap:
        assert model.config._attn_implementation != "sdpa"
        with torch.no_grad():
            captured = model(**inputs)
        cap.run(**inputs)
    captured = captured.last_hidden_state if name in VISION_MODELS or name == "bert" else captured.logits
    mask = inputs.get("attention_mask")
    keep = mask.bool() if mask is not None else torch.ones(captured.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(captured[keep], plain[keep], atol=2e-5, rtol=1e-4)
    assert model.config._attn_implementation == "sdpa"
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in find_layers(model))


def test_capture_is_undone_when_the_forward_fails():
    model = build("llama-gqa")
    with pytest.raises(IndexError):
        with AttentionCapture(model) as cap:
            cap.run(input_ids=torch.full((1, 3), 10_000))  # id beyond the embedding
    assert model.config._attn_implementation == "sdpa"
    assert not find_layers(model)[0]._forward_pre_hooks


# ----------------------------------------------------------------------------- value / update / QK references
def _value_and_output(name: str, layer, x: torch.Tensor, n_heads: int, dh: int):
    """Reference value vectors (B, Hkv, T, dh) and per-head output maps (H, d, dh), written per layout."""
    b, t, d = x.shape
    if name == "llama-gqa":
        v = layer.self_attn.v_proj(layer.input_layernorm(x))
        wo = layer.self_attn.o_proj.weight
    elif name == "bert":
        v = layer.attention.self.value(x)
        wo = layer.attention.output.dense.weight
    elif name == "gpt2":
        v = layer.attn.c_attn(layer.ln_1(x))[..., 2 * d :]
        wo = layer.attn.c_proj.weight.t()
    elif name == "dinov2":
        attn = layer.attention
        if hasattr(attn, "v_proj"):  # transformers ≥ 5.x refactor
            v, wo = attn.v_proj(layer.norm1(x)), attn.o_proj.weight
        else:  # earlier 5.x: ViT-style attention.attention.value / attention.output.dense
            v, wo = attn.attention.value(layer.norm1(x)), attn.output.dense.weight
        wo = layer.layer_scale1.lambda1[:, None] * wo
    v = v.reshape(b, t, -1, dh).transpose(1, 2).double()
    return v, wo.double().reshape(d, n_heads, dh).permute(1, 0, 2)


@pytest.mark.parametrize("name", ["llama-gqa", "bert", "gpt2", "dinov2"])
def test_value_norms_and_update_spectrum_against_weights(name):
    model, inputs, attn, out = _eager_reference(name)
    with AttentionCapture(build(name)) as cap:
        batch = cap.run(**inputs)
    layers = find_layers(model)
    n_heads = attn.shape[2]
    d = out.hidden_states[0].shape[-1]
    dh = d // n_heads
    mask = batch.token_mask
    for index, layer in enumerate(layers):
        with torch.no_grad():
            v, wo = _value_and_output(name, layer, out.hidden_states[index], n_heads, dh)
        v = v.repeat_interleave(n_heads // v.shape[1], dim=1)  # (B, H, T, dh)
        ref = torch.where(mask[:, None], v.norm(dim=-1), torch.nan)
        torch.testing.assert_close(batch.value_norm[:, index].double().nan_to_num(), ref.nan_to_num(), atol=1e-4, rtol=1e-4)
        u_all = torch.einsum("hed,bhtd->bhte", wo, v)  # (B, H, T, d)
        ref_out = torch.where(mask[:, None], u_all.norm(dim=-1), torch.nan)
        torch.testing.assert_close(batch.value_norm_out[:, index].double().nan_to_num(), ref_out.nan_to_num(),
                                   atol=1e-4, rtol=1e-4)
        update = attn[:, index] @ u_all * mask[:, None, :, None]  # U = A·u over real queries
        torch.testing.assert_close(metrics.stable_rank_from_singular_values(batch.update_spectrum[:, index]),
                                   metrics.stable_rank(update), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(batch.common_mode[:, index].double(),
                                   metrics.common_mode_fraction(update, mask[:, None].expand(-1, n_heads, -1)),
                                   atol=1e-4, rtol=1e-4)


QK_MODELS = ["llama-gqa", "qwen2", "mistral-sliding", "gemma", "phi3", "gpt-neox-partial-rotary", "gpt2", "opt",
             "bert", "vit", "dinov2"]


@pytest.mark.parametrize("name", QK_MODELS)
def test_qk_spectrum_layout_matches_the_models_own_projections(name):
    """RoPE is the identity at position 0, so with biases zeroed q_h(x0)·k_h(x0) = x0ᵀ Θ_h x0 (any layout)."""
    model = build(name)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.zero_()
    seen: dict[int, tuple] = {}
    layers = find_layers(model)
    first_attn: dict[int, torch.Tensor] = {}

    def record(module, query, key, value, attention_mask, **kwargs):
        seen[id(module)] = (module, query.detach(), key.detach())
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    def pre_hook(module, args, kwargs):
        first_attn[id(module)] = (args[0] if args else kwargs["hidden_states"]).detach()

    handles = []
    for layer in layers:
        for sub in layer.modules():
            if any(isinstance(getattr(sub, n, None), torch.nn.Module)
                   for n in ("q_proj", "query", "qkv_proj", "query_key_value", "c_attn")):
                handles.append(sub.register_forward_pre_hook(pre_hook, with_kwargs=True))
    AttentionInterface.register("sinklab_test_record", record)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    AttentionMaskInterface.register("sinklab_test_record", sdpa_mask)
    model.set_attn_implementation("sinklab_test_record")
    try:
        with torch.no_grad():
            model(**inputs_for(name, batch=1, pad=False))
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation("sdpa")
    with AttentionCapture(model) as cap:
        batch = cap.run(**inputs_for(name, batch=1, pad=False))
    for index, layer in enumerate(layers):
        module, q, k = next(v for key, v in seen.items() if any(key == id(s) for s in layer.modules()))
        x0 = next(first_attn[id(s)] for s in layer.modules() if id(s) in first_attn)[0, 0].double()
        n_heads, hkv, dh = q.shape[1], k.shape[1], q.shape[-1]
        weights = head_weights(layer, module, n_heads, hkv, dh)
        for h in range(n_heads):
            theta = weights.wq[h].T @ weights.wk[h // (n_heads // hkv)]  # (d, d)
            lhs = float(q[0, h, 0].double() @ k[0, h // (n_heads // hkv), 0].double())
            folded = dh**-0.5 if name == "opt" else 1.0  # OPT multiplies q by the softmax scale in forward()
            assert lhs == pytest.approx(folded * float(x0 @ theta @ x0), rel=1e-4, abs=1e-4)
            ref = torch.linalg.svdvals(theta)[:dh]
            torch.testing.assert_close(batch.qk_spectrum[index, h].double(), ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_model_statistics_track_float32():
    inputs = inputs_for("llama-gqa")
    with AttentionCapture(build("llama-gqa")) as cap:
        ref = cap.run(**inputs)
    with AttentionCapture(build("llama-gqa", dtype=torch.bfloat16)) as cap:
        low = cap.run(**inputs)
    assert low.column_mass.dtype == torch.float32
    # bf16 weights and activations carry ~3 significant digits; attention statistics follow at ~1e-2.
    torch.testing.assert_close(low.column_mass.nan_to_num(), ref.column_mass.nan_to_num(), atol=3e-2, rtol=0)
