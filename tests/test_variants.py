"""Sink-aware attention variants vs a naive float64 implementation (values and gradients), off-state, save/load."""

from __future__ import annotations

import math

import pytest
import torch
import transformers as tf

import sinklab
from sinklab.attention import sink_mass, softmax_with_sink
from sinklab.errors import InputError, ModelWeightsError, UnsupportedModelError
from sinklab.checkpoint import load, save
from sinklab.variants import VARIANT_NAMES, VARIANTS, VariantConfig, active_variants, apply_variant, parse_variant

import variant_cases
from tiny_models import build
from variant_reference import V, naive_forward as _naive_forward, tiny_llama


def test_the_table_of_variants():
    """One row per variant: a unique name that selects exactly that row; the CLI's names are the table's."""
    names = [v.name for v in VARIANTS]
    assert len(set(names)) == len(names) and list(VARIANT_NAMES) == names
    for variant in VARIANTS:
        assert [v.name for v in active_variants(parse_variant(variant.name))] == [variant.name]
        assert variant.name in variant_cases.SINGLE and (variant.__doc__ or "").strip()
    assert [v.name for v in active_variants(parse_variant("kv-bias+gated+registers"))] == ["kv-bias", "gated", "registers"]


def test_softmax_with_sink_closed_forms_and_worked_example():
    z = torch.randn(3, 5, dtype=torch.float64)
    torch.testing.assert_close(softmax_with_sink(z, -math.inf), torch.softmax(z, -1))
    w1 = softmax_with_sink(z, 0.0)  # softmax₁
    torch.testing.assert_close(w1, z.exp() / (1 + z.exp().sum(-1, keepdim=True)))
    w = softmax_with_sink(torch.zeros(6), 3.0)
    assert float(sink_mass(w)) == pytest.approx(math.exp(3) / (math.exp(3) + 6))  # 0.770
    values = torch.tensor([[0.83, 0.0]]).repeat(6, 1)
    assert float((w @ values).norm()) == pytest.approx(0.83 * 6 / (math.exp(3) + 6))  # 0.191
    # Per-head sinks broadcast over [B, H, Tq, Tk]; masked entries (−inf) get nothing.
    scores = torch.randn(2, 3, 4, 4, dtype=torch.float64).masked_fill(torch.ones(4, 4).triu(1).bool(), -math.inf)
    s = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64).view(3, 1)
    w = softmax_with_sink(scores, s)
    assert float(w[..., torch.ones(4, 4).triu(1).bool()].abs().max()) == 0.0
    ref = scores.exp() / (scores.exp().sum(-1, keepdim=True) + s.exp()[None, :, :, None].squeeze(-1)[..., None])
    torch.testing.assert_close(w, ref)


@pytest.mark.parametrize("name", variant_cases.REFERENCE)
def test_variant_matches_naive_float64_values_and_gradients(name):
    model = tiny_llama()
    handle = apply_variant(model, name)
    with torch.no_grad():  # move every new parameter away from its initial value
        for pname, p in model.named_parameters():
            if "sinklab_" in pname:
                p.add_(torch.randn_like(p) * 0.5)
    ids = torch.randint(0, V, (1, 9), generator=torch.Generator().manual_seed(0))
    ours = model(input_ids=ids, use_cache=False).logits
    ref = _naive_forward(model, ids, handle.config)
    torch.testing.assert_close(ours, ref, atol=1e-10, rtol=1e-9)
    params = [p for _, p in model.named_parameters()]  # the variant's own and the model's weights
    g_ours = torch.autograd.grad(ours.square().sum(), params, allow_unused=True)
    g_ref = torch.autograd.grad(ref.square().sum(), params, allow_unused=True)
    for a, b in zip(g_ours, g_ref):
        if a is None or b is None:
            assert a is None and b is None
            continue
        torch.testing.assert_close(a, b, atol=1e-9, rtol=1e-8)
    handle.remove()
    assert model.config._attn_implementation == "sdpa" and not any("sinklab_" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("name", variant_cases.OFF_IDENTITY)
def test_off_initialisation_leaves_outputs_unchanged(name):
    model = tiny_llama().float()
    ids = torch.randint(0, V, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with apply_variant(model, name, init="off"):
            during = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    torch.testing.assert_close(during, before, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(after, before, atol=0, rtol=0)


def test_kv_bias_at_zero_is_softmax1():
    """A zero key/value slot adds logit 0 with value 0: exactly softmax₁ (no exact 'off' state exists)."""
    model = tiny_llama()
    ids = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with apply_variant(model, "kv-bias"):
            a = model(input_ids=ids).logits
        with apply_variant(model, "softmax1"):
            b = model(input_ids=ids).logits
    torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_save_and_load_round_trip(tmp_path):
    model = tiny_llama().float()
    apply_variant(model, "sink-logit+gated")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "sinklab_" in n:
                p.normal_()
    ids = torch.randint(0, V, (1, 8))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    save(model, tmp_path / "m")
    loaded = sinklab.checkpoint.load(tmp_path / "m")
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelWeightsError, match="corrupt"):
        load(tmp_path / "bad")
    (tmp_path / "pt").mkdir()
    torch.save({}, tmp_path / "pt" / "pytorch_model.bin")
    with pytest.raises(ModelWeightsError, match="safetensors"):
        load(tmp_path / "pt")


def test_bad_variants_are_rejected():
    with pytest.raises(InputError, match="unknown variant"):
        parse_variant("sinky")
    with pytest.raises(InputError, match="either sink_logit or softmax1"):
        parse_variant("sink-logit+softmax1")
    with pytest.raises(InputError, match="twice"):
        parse_variant("gated+gated-headwise")
    with pytest.raises(InputError):
        VariantConfig()
    with pytest.raises(UnsupportedModelError, match="Llama-style"):
        apply_variant(build("gpt2"), "gated")
    model = tiny_llama()
    apply_variant(model, "gated")
    with pytest.raises(InputError, match="already applied"):
        apply_variant(model, "sink-logit")


def _trained_like(model, name):
    """Apply ``name`` and move every variant parameter away from its initial value (as training would)."""
    apply_variant(model, name)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "sinklab_" in pname:
                p.add_(torch.randn_like(p) * 0.5)
    return model


@pytest.mark.parametrize("name", variant_cases.SAVED)
def test_load_model_by_path_restores_every_variant(tmp_path, name):
    model = _trained_like(tiny_llama().float().eval(), name)
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    save(model, tmp_path / "m")
    loaded = sinklab.load_model(str(tmp_path / "m"))  # what scan, diagnose and stream call
    assert loaded.model.config.sinklab_variant == model.config.sinklab_variant
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(input_ids=ids).logits, ref, atol=0, rtol=0)
    if name == "gated":  # the bare transformers load drops the gate: the logits are not the trained model's
        bare = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
        with torch.no_grad():
            assert float((bare(input_ids=ids).logits - ref).abs().max()) > 1e-3


@pytest.mark.parametrize("arch", ["gemma2-softcap", "gpt-oss-learned-sinks"])
def test_off_variant_keeps_the_models_own_softcap_and_sink_logits(arch):
    """A variant at init="off" on a model whose attention soft-caps its logits (Gemma 2) or has learned sink
    logits (gpt-oss) leaves its outputs unchanged: the variant backend keeps both."""
    if arch == "gemma2-softcap":
        config = tf.Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                                 attn_logit_softcapping=0.02, max_position_embeddings=128)
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        model = tf.Gemma2ForCausalLM(config).eval()
    else:
        model = build(arch, attn="eager")
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with apply_variant(model, "gated", init="off"):
            during = model(input_ids=ids).logits
    torch.testing.assert_close(during, before, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "gemma"])
def test_variants_round_trip_on_other_llama_style_classes(tmp_path, arch):
    model = _trained_like(build(arch), "sink-logit+gated")
    ids = torch.randint(0, V, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    save(model, tmp_path / arch)
    loaded = sinklab.load_model(str(tmp_path / arch)).model
    assert type(loaded) is type(model)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ref, atol=0, rtol=0)


def test_tampered_checkpoints_refuse_to_load(tmp_path):
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    model = _trained_like(tiny_llama().float(), "gated")
    save(model, tmp_path / "good")
    tensors = load_file(str(tmp_path / "good" / "model.safetensors"))

    def tampered(label, change):
        folder = tmp_path / label
        shutil.copytree(tmp_path / "good", folder)
        t = dict(tensors)
        change(t)
        save_file(t, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return str(folder)

    extra = tampered("extra", lambda t: t.update({"model.layers.0.self_attn.extra_proj.weight": torch.zeros(2, 2)}))
    with pytest.raises(ModelWeightsError, match=r"1 weight\(s\) in the files are not used.*extra_proj"):
        sinklab.load_model(extra)
    gate = tampered("gate", lambda t: t.pop("model.layers.1.self_attn.sinklab_gate.weight"))
    with pytest.raises(ModelWeightsError, match="variant's weights are missing.*layers.1.self_attn.sinklab_gate.weight"):
        sinklab.load_model(gate)
    base = tampered("base", lambda t: t.pop("model.norm.weight"))
    with pytest.raises(ModelWeightsError, match=r"not in the files \(they would stay random\): model.norm.weight"):
        sinklab.load_model(base)
    shape = tampered("shape", lambda t: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ModelWeightsError):
        sinklab.load_model(shape)
    no_meta = tmp_path / "no-meta"
    shutil.copytree(tmp_path / "good", no_meta)
    (no_meta / "sinklab_variant.json").unlink()
    config = json.loads((no_meta / "config.json").read_text())
    config.pop("sinklab_variant")
    (no_meta / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelWeightsError, match="variant weights without sinklab_variant.json"):
        sinklab.load_model(str(no_meta))
    weights = tmp_path / "good" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(ModelWeightsError, match="corrupt or truncated"):
        load(tmp_path / "good")


def test_gates_of_several_variants_multiply(monkeypatch):
    """Two gating variants on one module: the output is scaled by both gates (the first one alone was returned)."""
    import sinklab.variants as variants

    g1 = torch.full((1, 2, 4, 1), 0.5)
    g2 = torch.rand(1, 2, 4, 8)

    class Gate:
        def __init__(self, g):
            self.g = g

        def gate(self, module, heads):
            return self.g

    monkeypatch.setattr(variants, "active_variants", lambda config: [Gate(g1), Gate(None), Gate(g2)])
    torch.testing.assert_close(variants.variant_gate(torch.nn.Identity(), 4), g1 * g2, rtol=0, atol=0)
    monkeypatch.setattr(variants, "active_variants", lambda config: [Gate(None)])
    assert variants.variant_gate(torch.nn.Identity(), 4) is None
