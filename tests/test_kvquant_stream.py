"""``SinkCache(kv_bits=)``: a packed window with exact sinks, against the full-precision stream and float64 references."""

from __future__ import annotations

import pytest
import torch

from sinklab.models import tiny_llama
from sinklab.stream import SinkCache
from test_kvquant import _quantize_reference

pytestmark = pytest.mark.usefixtures("one_thread")


def _stream(model, ids, kv_bits, record=None, layer_idx=0, **kw):
    """Prefill 24 tokens, then decode the rest one by one; returns (last-position logits ``[N, V]``, the layer)."""
    outs = []
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=12, pinned=[(5, 7)], rebase_every=40,
                                    kv_bits=kv_bits, kv_group_size=16, **kw) as cache:
        layer = cache.layers[layer_idx]
        if record is not None:  # the exact key/value states the layer receives, in order
            update = layer.update
            layer.update = lambda k, v, *a, **kw_: (record.append((k.clone(), v.clone())), update(k, v, *a, **kw_))[1]
        outs.append(model(ids[:, :24], cache=cache).logits[:, -1])
        for t in range(24, ids.shape[1]):
            outs.append(model(ids[:, t:t + 1], cache=cache).logits[:, -1])
    return torch.cat(outs), layer


def test_sinks_and_pinned_spans_stay_bit_exact_through_eviction_and_rebase():
    model = tiny_llama(num_hidden_layers=2, vocab_size=1000)
    ids = torch.randint(5, 1000, (1, 90))
    full, exact = _stream(model, ids, None)
    for bits in (2, 4):
        quant, layer = _stream(model, ids, bits)  # 90 tokens through a window of 12: evicted, re-based
        assert torch.equal(layer.anchor_keys, exact.anchor_keys)  # sinks 0, 1 and pinned 5, 6 as first rotated
        assert torch.equal(layer.anchor_values, exact.values[:, :, :4])
        assert (quant - full).abs().max() > 1e-3  # the window really is quantized
    b, hkv, _, d = exact.keys.shape  # 4 bits: W × (d/2 bytes of codes + a float16 scale and zero per 16 channels)
    assert layer.nbytes() == 2 * b * hkv * (12 * (d // 2 + 2 * 2 * d // 16) + 4 * d * 4)  # + 4 exact float32 tokens


@pytest.mark.parametrize("bits,layer_idx", [(3, 0), (8, 0), (4, 1)])
def test_window_as_stored_equals_float64_reference_of_what_was_written(bits, layer_idx):
    """Also the last layer of two: decoded columns are packed for all layers at once, at the next forward."""
    model = tiny_llama(num_hidden_layers=2, vocab_size=1000)
    ids = torch.randint(5, 1000, (1, 38))  # no re-base yet (virtual positions < 40)
    record: list = []
    _, layer = _stream(model, ids, bits, record, layer_idx)
    keys = torch.cat([k for k, _ in record], dim=-2)  # (B, Hkv, 38, d): every stream token, post-RoPE
    values = torch.cat([v for _, v in record], dim=-2)
    free = [t for t in range(38) if t not in (0, 1, 5, 6)]  # the i-th free token lives in ring slot i mod W
    newest = {i % 12: t for i, t in enumerate(free)}
    ring_k, ring_v = layer.dequantized_ring()
    for slot, t in newest.items():
        k_ref = _quantize_reference(keys[:, :, t:t + 1], bits, 16, -1)[1]
        v_ref = _quantize_reference(values[:, :, t:t + 1], bits, 16, -1)[1]
        torch.testing.assert_close(ring_k[:, :, slot:slot + 1].double(), k_ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ring_v[:, :, slot:slot + 1].double(), v_ref, atol=1e-5, rtol=1e-5)


def test_session_save_load_keeps_kv_bits_and_resumes_exactly(tmp_path):
    from sinklab.stream import StreamSession
    from sinklab.stream.quantized import QuantizedSinkWindowLayer

    model = tiny_llama(num_hidden_layers=2, vocab_size=1000)
    ids = torch.randint(5, 1000, (1, 60))
    kw = dict(num_sinks=2, window=12, pinned=[(5, 7)], chunk_size=9, rebase_every=40, kv_bits=3, kv_group_size=8)
    with StreamSession(model, **kw) as whole:  # one unbroken stream: 40 fed, then 20 stepped (evicts, re-bases)
        whole.feed(ids[:, :40])
        expected = torch.stack([whole.step(ids[:, t]) for t in range(40, 60)])
    with StreamSession(model, **kw) as first:
        first.feed(ids[:, :40])
        path = first.save(tmp_path / "s.safetensors")
    resumed = StreamSession.load(model, path)
    assert resumed.kv_bits == 3 and resumed.kv_group_size == 8
    with resumed as s:
        assert all(isinstance(layer, QuantizedSinkWindowLayer) for layer in s.cache.layers)
        got = torch.stack([s.step(ids[:, t]) for t in range(40, 60)])
    assert torch.equal(got, expected)


def test_row_selection_moves_the_packed_ring_with_its_row():
    """Beams / num_return_sequences: re-indexed rows decode exactly like streams fed in that row order."""
    model = tiny_llama(num_hidden_layers=2, vocab_size=1000)
    ids = torch.randint(5, 1000, (2, 30))
    nxt = torch.randint(5, 1000, (3, 1))

    def run(rows, select=None):
        with torch.no_grad(), SinkCache(model, num_sinks=2, window=12, kv_bits=4, kv_group_size=16) as cache:
            model(ids[rows], cache=cache)  # 30 tokens through a window of 12: the ring has wrapped
            if select is not None:
                cache.reorder_cache(torch.tensor(select))
            return model(nxt[: len(select or rows)], cache=cache).logits[:, -1]

    assert torch.equal(run([0, 1], [1, 0]), run([1, 0]))
    assert torch.equal(run([0, 1], [1]), run([1]))
    with torch.no_grad(), SinkCache(model, num_sinks=2, window=12, kv_bits=4, kv_group_size=16) as cache:
        model(ids[:1], cache=cache)
        cache.batch_repeat_interleave(2)
        twice = model(nxt[:2], cache=cache).logits[:, -1]
    assert torch.equal(twice, run([0, 0]))


def test_kv_settings_are_checked_at_construction():
    """Quantization settings of the wrong type, or given without what they modify, are InputErrors at once (a
    float group size used to fail at the first forward; a group size without kv_bits was ignored)."""
    from sinklab.errors import InputError
    from sinklab.kvquant import Protection, quantize, quantized_sink_cache

    model = tiny_llama()
    for kw, message in [(dict(kv_bits=4.0), "kv_bits must be one of"), (dict(kv_bits=4, kv_group_size=True), "integer"),
                        (dict(kv_bits=4, kv_group_size=7.5), "integer"), (dict(kv_group_size=32), "it needs kv_bits")]:
        with pytest.raises(InputError, match=message):
            SinkCache(model, num_sinks=2, window=8, **kw)
    with pytest.raises(InputError, match="protect is a sinklab.kvquant.Protection"):
        quantized_sink_cache(model, 4, protect="bogus")
    with pytest.raises(InputError, match="quantized_sink_cache takes a loaded model"):
        quantized_sink_cache("notamodel", 4, protect=Protection(first=4))
    x = torch.randn(2, 2, 4, 8)
    with pytest.raises(InputError, match="bits must be one of"):
        quantize(x, 5, 8)
    with pytest.raises(InputError, match="dimension 9 does not exist in a 4-D tensor"):
        quantize(x, 4, 8, dim=9)
    with pytest.raises(InputError, match="group_size must be an integer ≥ 1, got 0"):
        quantize(x, 4, 0)
