"""Everything sinklab does to a model is explicit and reversible, and never reaches a model next to it.

* A second model built from the SAME config object is never switched by scan/capture, a variant or a stream
  (transformers keeps the attention implementation on the config, so switching one model used to switch both).
* Every entry point (scan, diagnose, circuit, stream, kv tools, variants) leaves the model and its config exactly as it found
  them, starting from an eager, an sdpa and a variant model.
* Guard: no module outside the ``sinklab/_compat/`` package touches transformers' attention-dispatch internals.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import transformers as tf

import sinklab
from sinklab import AttentionCapture, SinkCache, apply_variant

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(__file__).resolve().parents[1] / "src" / "sinklab"
V = 61


def _config(attn: str) -> tf.LlamaConfig:
    config = tf.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config._attn_implementation = attn
    return config


def _twins(attn: str = "sdpa"):
    """Two different models (different weights) that share ONE config object."""
    config = _config(attn)
    torch.manual_seed(0)
    a = tf.LlamaForCausalLM(config).eval()
    torch.manual_seed(1)
    b = tf.LlamaForCausalLM(config).eval()
    assert a.config is b.config
    return a, b


IDS = torch.randint(3, V, (2, 10), generator=torch.Generator().manual_seed(5))


def _eager_logits(model) -> torch.Tensor:
    """The model's logits from transformers' own eager attention, on a private copy of the config (reference)."""
    import copy

    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    with torch.no_grad():
        return twin(IDS).logits


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_twin_sharing_a_config_is_never_switched_by_an_open_stream(attn):
    a, b = _twins(attn)
    ref_b = _eager_logits(b)
    with torch.no_grad(), SinkCache(a, num_sinks=2, window=4) as cache:
        a(IDS[:, :6], cache=cache, use_cache=True)
        assert b.config._attn_implementation == attn
        out_b = b(IDS).logits  # the dense twin runs its own attention while a's stream is open
        a(IDS[:, 6:], cache=cache, use_cache=True)  # and a's stream still works afterwards
    torch.testing.assert_close(out_b, ref_b, atol=1e-5, rtol=1e-5)
    assert a.config is b.config and a.config._attn_implementation == attn


def test_twin_sharing_a_config_is_never_switched_by_a_capture_or_a_variant():
    a, b = _twins("sdpa")
    ref_b = _eager_logits(b)
    with torch.no_grad(), AttentionCapture(a) as cap:
        cap.run(input_ids=IDS)
        assert b.config._attn_implementation == "sdpa"
        torch.testing.assert_close(b(IDS).logits, ref_b, atol=1e-5, rtol=1e-5)
    handle = apply_variant(a, "sink-logit+gated", init="off")
    try:
        assert b.config._attn_implementation == "sdpa"
        assert getattr(b.config, "sinklab_variant", None) is None
        with torch.no_grad():
            torch.testing.assert_close(b(IDS).logits, ref_b, atol=1e-5, rtol=1e-5)
    finally:
        handle.remove()
    assert a.config is b.config and a.config._attn_implementation == "sdpa"


# ----------------------------------------------------------------------------- every entry point restores
def _state(model) -> dict:
    """Everything sinklab could leave behind on a model: config object and contents, attention backend,
    attributes, parameters, buffers, hooks."""
    config = model.config
    return {
        "config_id": id(config),
        "config_ids": sorted({id(m.__dict__["config"]) for m in model.modules() if "config" in m.__dict__}),
        "config": config.to_dict(),
        "attn": config._attn_implementation,
        "extra_attrs": sorted(f"{n}.{a}" for n, m in model.named_modules() for a in vars(m)
                              if a.startswith("sinklab")),
        "params": sorted(n for n, _ in model.named_parameters()),
        "buffers": sorted(n for n, _ in model.named_buffers()),
        "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()),
        "training": model.training,
    }


def _entry_points(model):
    loaded = sinklab.load_model("builtin:tiny-lm")
    tok = loaded.tokenizer
    texts = ["The quick brown fox jumps over the lazy dog. " * 4]
    yield "scan", lambda: sinklab.scan(model, tok, texts, seq_len=12, samples=2)
    yield "diagnose", lambda: sinklab.diagnose(model, tok, texts, seq_len=12, samples=2, edit_samples=1)
    yield "circuit", lambda: sinklab.circuit(model, tok, texts, seq_len=12, samples=2)

    def stream():
        with torch.no_grad(), SinkCache(model, num_sinks=2, window=4) as cache:
            model(IDS[:, :6], cache=cache, use_cache=True)
            model(IDS[:, 6:], cache=cache, use_cache=True)
        cache2 = SinkCache(model, num_sinks=2, window=4)  # implicit activation, released by close()
        with torch.no_grad():
            model(IDS, cache=cache2, use_cache=True)
        cache2.close()

    yield "stream", stream

    def kv_tools():  # the kv-quant comparison (full, packed and detected-sink caches) and a packed stream
        from sinklab.kvquant.evaluate import KvQuantPlan, kv_quant

        plan = KvQuantPlan(bits=(4,), protect=("none", "detected"), context=24, score=8, samples=1, group_size=8,
                           value_group=8, residual=4, decode_steps=1)
        kv_quant(model, torch.randint(5, 4000, (32,), generator=torch.Generator().manual_seed(0)), plan)
        with torch.no_grad(), SinkCache(model, num_sinks=2, window=8, kv_bits=4, kv_group_size=4) as cache:
            model(IDS, cache=cache, use_cache=True)

    yield "kv tools", kv_tools

    def variants():
        for name in sinklab.variants.VARIANT_NAMES:
            if getattr(model, "sinklab_variant_handle", None) is not None:
                return  # a variant model: a second variant is refused (tested in test_variants)
            with apply_variant(model, name, init="off"):
                with torch.no_grad():
                    model(IDS)

    yield "variants", variants


def _tiny_lm_model(start: str):
    model = sinklab.load_model("builtin:tiny-lm").model
    if start == "variant":
        apply_variant(model, "kv-bias+gated", init="off")
    else:
        model.set_attn_implementation(start)
    return model


@pytest.mark.parametrize("start", ["eager", "sdpa", "variant"])
def test_every_entry_point_gives_the_model_back_unchanged(start):
    model = _tiny_lm_model(start)
    twin = type(model)(model.config).eval()  # a second model built from the same config object
    twin_attn = model.config._attn_implementation
    before = _state(model)
    for name, run in _entry_points(model):
        run()
        after = _state(model)
        assert after == before, f"{name} changed the {start} model: " + ", ".join(
            k for k in before if before[k] != after[k])
        assert twin.config._attn_implementation == twin_attn


def test_guard_no_transformers_internals_outside_compat():
    """Attention dispatch, mask registration and private cache state are touched in the sinklab/_compat/ package only."""
    forbidden = re.compile(r"_attn_implementation|AttentionInterface|AttentionMaskInterface|ALL_ATTENTION_FUNCTIONS|"
                           r"ALL_MASK_ATTENTION_FUNCTIONS|set_attn_implementation|_seen_tokens|\.key_cache\b|"
                           r"\.value_cache\b|_distributed_cache_data")
    # synth/model.py is a model definition: transformers decides from its SOURCE whether it can switch the model's
    # attention (it looks for "ALL_ATTENTION_FUNCTIONS.get_interface("), so it follows transformers' own convention.
    allowed = {*(SRC / "_compat").glob("*.py"), SRC / "synth" / "model.py"}
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        if path in allowed:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if forbidden.search(line):
                offenders.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not offenders, "transformers internals outside _compat:\n" + "\n".join(offenders)
