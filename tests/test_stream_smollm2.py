"""Streaming the real SmolLM2-135M-Instruct: dense before eviction, the float64 reference after, multi-turn chat."""

from __future__ import annotations

import warnings

import pytest
import torch
from stream_reference import Reference

from sinklab.stream import SinkCache, StreamSession


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


TEXT = ("The old lighthouse keeper climbed the stairs every evening to light the lamp. Ships passing in the night "
        "relied on its beam to avoid the rocks below, and the keeper never missed a single night in forty years.")


@pytest.mark.long
def test_smollm2_stream_equals_dense_then_reference(smollm2):
    ids = torch.tensor([smollm2.tokenizer(TEXT)["input_ids"][:28]])
    model = smollm2.model
    with torch.no_grad():
        dense = model(input_ids=ids).logits[0]
    with StreamSession(model, num_sinks=4, window=28, chunk_size=10) as s:  # S + W = 32 > 28: no eviction
        early = s.feed(ids, all_logits=True)[0]
    assert _rel(early, dense) < 1e-5, _rel(early, dense)
    ref = Reference(model, 2, 8)
    with StreamSession(model, num_sinks=2, window=8, chunk_size=16) as s:  # the first chunk overflows S + W = 10
        late = s.feed(ids[:, :16], all_logits=True)[0]
        late = torch.cat([late, torch.stack([s.step(ids[:, i])[0] for i in range(16, 22)])])
    worst = max(_rel(late[i], ref.step(int(ids[0, i]))) for i in range(22))
    assert worst < 1e-4, worst
    assert _rel(late[21], dense[21]) > 1e-3  # evictions did change something


@pytest.mark.long
def test_smollm2_multi_turn_chat_without_with(smollm2):
    """transformers' old SinkCache test, shortened: three turns through one persistent cache, no with block."""
    model, tok = smollm2.model, smollm2.tokenizer
    prompt = "Write a short travel note about Hawaii."
    cache = SinkCache(model, num_sinks=4, window=60)
    ids = torch.zeros(1, 0, dtype=torch.long)
    starts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for _ in range(3):
            turn = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                           return_tensors="pt")["input_ids"]
            ids = torch.cat([ids, turn], dim=1)
            starts.append(ids.shape[1])
            ids = model.generate(ids, do_sample=False, max_new_tokens=28, past_key_values=cache)
        first = model.generate(ids[:, : starts[0]], do_sample=False, max_new_tokens=64 - starts[0])  # dense
    assert ids.shape[1] > 2 * 64 and starts[0] + 28 > 64  # well past the cache size; turn 1 evicts
    n = first.shape[1]  # before the cache's first eviction, turn 1 is dense greedy generation
    assert torch.equal(ids[:, :n], first)
    cache.close()
    assert model.config._attn_implementation != "sinklab_stream"


@pytest.mark.long
def test_smollm2_with_variants_generates_and_streams(smollm2):
    """kv-bias + output gate + 2 registers on the real model (variant weights moved off their start): KV-cache
    decoding == full forwards; SinkCache == dense before eviction and == the float64 reference after."""
    from sinklab.variants import apply_variant

    model = smollm2.model
    ids = torch.tensor([smollm2.tokenizer(TEXT)["input_ids"][:20]])
    handle = apply_variant(model, "kv-bias+gated+registers", init="off", registers=2)
    try:
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "sinklab_" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * (0.3 if "gate.bias" not in name else 0.0) - (
                        28.0 if "gate.bias" in name else 0.0))  # gate σ(≈ 2 ± noise): it now scales every head
            dense = model(input_ids=ids, use_cache=False).logits[0]
            out = model(input_ids=ids[:, :12], use_cache=True)
            cache, steps = out.past_key_values, [out.logits[0]]
            for i in range(12, 20):
                steps.append(model(input_ids=ids[:, i : i + 1], cache=cache).logits[0])
        assert _rel(torch.cat(steps), dense) < 1e-4, _rel(torch.cat(steps), dense)
        with StreamSession(model, num_sinks=4, window=28, chunk_size=8) as s:  # 2 registers + 20 < 32: no eviction
            early = s.feed(ids, all_logits=True)[0]
        assert _rel(early, dense) < 1e-4, _rel(early, dense)
        ref = Reference(model, 4, 6)  # the 2 registers and 2 tokens are the sinks
        ref.feed_registers()
        with StreamSession(model, num_sinks=4, window=6, chunk_size=8) as s:
            late = s.feed(ids[:, :8], all_logits=True)[0]
            late = torch.cat([late, torch.stack([s.step(ids[:, i])[0] for i in range(8, 16)])])
        worst = max(_rel(late[i], ref.step(int(ids[0, i]))) for i in range(16))
        assert worst < 1e-4, worst
        assert _rel(late[15], dense[15]) > 1e-3  # evictions did change something
    finally:
        handle.remove()
    assert not any("sinklab_" in n for n, _ in model.named_parameters())
