"""sinklab.kvquant: packing, quantization and the quantized sink cache against independent references."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvquant_models import SINK_ID, massive_sink_llama
from sinklab.kvquant import (
    DynamicQuantizedSinkLayer,
    Protection,
    dequantize,
    pack_bits,
    quantize,
    quantized_sink_cache,
    unpack_bits,
)
from sinklab.kvquant.detect import detect_sinks
from sinklab.models import tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")


def _pack_reference(codes: list[int], bits: int) -> list[int]:
    """Little-endian bit string of the codes, cut into bytes (padded with zero bits to whole words)."""
    k = {2: 4, 3: 8, 4: 2, 8: 1}[bits]
    codes = codes + [0] * ((-len(codes)) % k)
    value = sum(c << (bits * i) for i, c in enumerate(codes))
    return [(value >> (8 * j)) & 0xFF for j in range(len(codes) * bits // 8)]


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 7, 64, 67])
def test_pack_matches_bitstring_and_round_trips(bits, n):
    codes = torch.randint(0, 1 << bits, (3, 2, n))
    packed = pack_bits(codes, bits)
    for row_codes, row_packed in zip(codes.reshape(-1, n).tolist(), packed.reshape(-1, packed.shape[-1]).tolist()):
        assert row_packed == _pack_reference(row_codes, bits)
    assert torch.equal(unpack_bits(packed, bits, n).long(), codes)


def _quantize_reference(x: torch.Tensor, bits: int, group: int, dim: int,
                        clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 min/max per group, scale and zero rounded to float16 (the stated storage): codes and x̂.

    ``clip``: every shrink of the range about its midpoint by 1.0, 0.9, …, 0.5, the one with the least squared
    error over the group kept (the first of equals)."""
    xt = x.double().movedim(dim, -1)  # groups along the last axis
    g = xt.reshape(*xt.shape[:-1], xt.shape[-1] // group, group)  # (..., groups, group)
    levels = 2**bits - 1
    lo0, hi0 = g.min(-1, keepdim=True).values, g.max(-1, keepdim=True).values
    best = None
    for ratio in (1.0, 0.9, 0.8, 0.7, 0.6, 0.5) if clip else (1.0,):
        cut = (1 - ratio) * (hi0 - lo0) / 2
        lo = (lo0 + cut).half().double()
        scale = ((hi0 - lo0 - 2 * cut) / levels).half().double()
        codes = torch.where(scale > 0, torch.round((g - lo) / scale.clamp_min(1e-300)).clamp(0, levels), 0.0)
        err = ((codes * scale + lo - g) ** 2).sum(-1, keepdim=True)
        if best is None:
            best = (err, codes, lo, scale)
        else:
            better = err < best[0]
            best = tuple(torch.where(better, new, old) for new, old in zip((err, codes, lo, scale), best))
    _, codes, lo, scale = best
    back = lambda t: t.reshape(xt.shape).movedim(-1, dim)  # noqa: E731
    return back(codes), back(codes * scale + lo)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dim", [-1, -2])
@pytest.mark.parametrize("clip", [False, True])
def test_quantize_matches_float64_reference(bits, dim, clip):
    x = torch.randn(2, 3, 32, 16) * torch.linspace(0.1, 5.0, 16)  # channels of different ranges
    x[0, 0, 3, 5] = 40.0  # an outlier
    q = quantize(x, bits, 8, dim=dim, clip=clip)
    codes_ref, x_ref = _quantize_reference(x, bits, 8, dim, clip)
    codes = unpack_bits(q.packed, bits, x.shape[-1]).double()
    assert (codes != codes_ref).double().mean() < 1e-3  # only float32-vs-float64 rounding ties may differ
    same = codes == codes_ref
    torch.testing.assert_close(dequantize(q).double()[same], x_ref[same], atol=1e-5, rtol=1e-5)
    assert q.scale.dtype == torch.float16 and q.scale.shape[dim] == x.shape[dim] // 8


@pytest.mark.parametrize("dim", [-1, -2])
def test_clipped_range_is_never_worse_than_min_max_and_cuts_2bit_error(dim):
    x = torch.randn(4, 2, 64, 32, generator=torch.Generator().manual_seed(1))
    x[0, 0, 5, 7] = 30.0  # one group with an outlier: clipping it would cost more than it saves

    def group_error(clip: bool) -> torch.Tensor:
        err = (dequantize(quantize(x, 2, 16, dim=dim, clip=clip)).double() - x.double()) ** 2
        return err.movedim(dim, -1).unflatten(-1, (-1, 16)).sum(-1)  # (..., groups)

    plain, clipped = group_error(False), group_error(True)
    assert (clipped <= plain * (1 + 1e-6) + 1e-9).all()
    assert clipped.sum() < 0.8 * plain.sum()  # Gaussian groups of 16: about 28 % less squared error
    outlier = dequantize(quantize(x, 2, 16, dim=dim, clip=True))[0, 0, 5, 7]
    assert float(outlier) > 25.0  # the outlier's group stays (nearly) min/max: the outlier is not clipped away


def _reference_past(keys, values, protect: Protection, bits: int, group: int, residual: int, clip: bool = False):
    """The stored past rebuilt from full-precision k/v ``[B, H, T, d]`` with the float64 reference quantizer:
    float16 storage; positions below ``n`` packed in blocks of ``group``, where a protected token's key is
    replaced by its block's per-channel minimum over the other tokens before quantizing, and kept exact."""
    keys, values = keys.half().double(), values.half().double()
    t = keys.shape[-2]
    n = max(0, (t - residual) // group * group)
    keep = protect.mask(torch.arange(t))
    k, v = keys.clone(), values.clone()
    if n:
        filled = keys[:, :, :n].clone()
        for b0 in range(0, n, group):
            holes = keep[b0:b0 + group]
            if holes.any():
                lo = keys[:, :, b0:b0 + group][:, :, ~holes].amin(-2, keepdim=True)
                filled[:, :, b0:b0 + group][:, :, holes] = lo.expand(-1, -1, int(holes.sum()), -1)
        k[:, :, :n] = _quantize_reference(filled.float(), bits, group, -2, clip)[1]
        v[:, :, :n] = _quantize_reference(values[:, :, :n].float(), bits, min(group, values.shape[-1]), -1, clip)[1]
        k[:, :, keep], v[:, :, keep] = keys[:, :, keep], values[:, :, keep]
    return k.float(), v.float()


@pytest.mark.parametrize("bits, clip", [(2, False), (4, False), (2, True)])
def test_attention_over_quantized_cache_equals_attention_over_reference_dequantized(bits, clip):
    model = tiny_llama(num_hidden_layers=2, vocab_size=1000)
    ids = torch.randint(5, 1000, (2, 90))
    protect = Protection(first=2, positions=(37,))
    with torch.no_grad():
        full = DynamicCache(config=model.config)
        model(ids[:, :70], cache=full)
        ref_cache = DynamicCache(config=model.config)
        for i, layer in enumerate(full.layers):
            ref_cache.update(*_reference_past(layer.keys, layer.values, protect, bits, 16, 8, clip), i)
        expected = model(ids[:, 70:], cache=ref_cache).logits
        cache = quantized_sink_cache(model, bits, protect, group_size=16, residual=8, clip=clip)
        model(ids[:, :70], cache=cache)
        got = model(ids[:, 70:], cache=cache).logits
    assert cache.layers[0].counts() == {"quantized": 80, "protected": 3, "residual": 10}  # after both forwards
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)
    assert (got - model(ids).logits[:, 70:]).abs().max() > 1e-3  # the quantization is real


def test_protected_tokens_stay_bit_exact_and_bytes_are_counted():
    model = tiny_llama(num_hidden_layers=1, vocab_size=1000)
    ids = torch.randint(5, 1000, (1, 40))
    protect = Protection(first=1, spans=((10, 12),), positions=(30,))
    with torch.no_grad():
        full = DynamicCache(config=model.config)  # the same forwards, unquantized: the exact keys and values
        cache = quantized_sink_cache(model, 2, protect, group_size=8, residual=4, exact_dtype=torch.float32)
        half = quantized_sink_cache(model, 2, protect, group_size=8, residual=4)  # default: 16-bit storage
        bare = quantized_sink_cache(model, 2, None, group_size=8, residual=4)
        for c in (full, cache, half, bare):
            model(ids[:, :20], cache=c)
            for t in range(20, 40):  # decode: blocks get packed around the protected tokens
                model(ids[:, t:t + 1], cache=c)
    layer: DynamicQuantizedSinkLayer = cache.layers[0]
    keys, values = layer.materialize()
    kept = [0, 10, 11, 30]
    assert torch.equal(keys[:, :, kept], full.layers[0].keys[:, :, kept])
    assert torch.equal(values[:, :, kept], full.layers[0].values[:, :, kept])
    others = [p for p in range(32) if p not in kept]  # packed part
    assert not torch.equal(keys[:, :, others], full.layers[0].keys[:, :, others])
    b, h, _, d = keys.shape
    counts = layer.counts()
    assert counts == {"quantized": 32, "protected": 4, "residual": 8}  # protected tokens are holes in the blocks
    packed = counts["quantized"] * b * h * d * 2 // 8 * 2  # keys + values, 2 bits
    meta = 2 * 2 * (counts["quantized"] // 8) * b * h * d + 2 * 2 * counts["quantized"] * b * h * (d // 8)
    fp = (counts["protected"] + counts["residual"]) * b * h * d * 2  # keys + values, one element each
    assert layer.nbytes() == packed + meta + 4 * fp  # float32 storage
    assert half.layers[0].nbytes() == packed + meta + 2 * fp  # float16 storage
    assert half.layers[0].nbytes() - bare.layers[0].nbytes() == 4 * b * h * d * 2 * 2  # 4 exact tokens, no more
    half_keys, half_values = half.layers[0].materialize()
    assert torch.equal(half_keys[:, :, kept], full.layers[0].keys[:, :, kept].half().float())
    assert torch.equal(half_values[:, :, kept], full.layers[0].values[:, :, kept].half().float())


#: This model's sinks draw most of the attention; at the default ε = 0.2 one of its 8 heads also picks position 5.
EPS = 0.3


def test_massive_activation_sink_protection_cuts_kl():
    model = massive_sink_llama()
    ids = torch.randint(2, 256, (1, 160), generator=torch.Generator().manual_seed(0))
    ids[0, 0] = ids[0, 40] = SINK_ID
    detected = detect_sinks(model, ids[0, :128], eps=EPS)
    assert detected == [0, 40]
    assert {0, 40} <= set(detect_sinks(model, ids[0, :128]))  # the default threshold finds them too

    def median_kl(protect: Protection, clip: bool = False) -> float:
        with torch.no_grad():
            ref = model(ids).logits[0, 128:].log_softmax(-1)
            cache = quantized_sink_cache(model, 2, protect, group_size=32, residual=8, clip=clip)
            model(ids[:, :128], cache=cache)
            got = model(ids[:, 128:], cache=cache).logits[0].log_softmax(-1)
        return float((ref.exp() * (ref - got)).sum(-1).median())

    none, first, sinks = median_kl(Protection()), median_kl(Protection(first=1)), median_kl(Protection(positions=detected))
    assert none > 3 * sinks
    assert sinks < first < none
    # least-squares ranges clip whatever stands out of its group: the unprotected sink's key and value (worse
    # than min/max), while with the sinks kept exact they only tighten the ordinary tokens' ranges
    clipped_none = median_kl(Protection(), clip=True)
    clipped_sinks = median_kl(Protection(positions=detected), clip=True)
    assert clipped_none > 1.5 * none
    assert clipped_sinks < 0.5 * sinks


def test_sinks_measured_during_prefill_give_the_cache_a_separate_scan_gives():
    from sinklab.kvquant.detect import prefill_detecting_sinks

    model = massive_sink_llama()
    ids = torch.randint(2, 256, (1, 128), generator=torch.Generator().manual_seed(1))
    ids[0, 0] = ids[0, 40] = SINK_ID
    cache = quantized_sink_cache(model, 2, group_size=32, residual=8)
    logits, sinks = prefill_detecting_sinks(model, ids, cache, eps=EPS)
    assert sinks == detect_sinks(model, ids[0], eps=EPS) == [0, 40]
    with torch.no_grad():
        scanned = quantized_sink_cache(model, 2, Protection(positions=(0, 40)), group_size=32, residual=8)
        model(ids, cache=scanned)
    for i, (got, ref) in enumerate(zip(cache.layers, scanned.layers)):
        assert got.counts() == ref.counts() == {"quantized": 96, "protected": 2, "residual": 32}
        assert torch.equal(got.p_pos, torch.tensor([0, 40]))
        for a, b in zip(got.materialize(), ref.materialize()):  # layer 0 sees the same inputs; later layers
            if i == 0:                                        # see the capture's eager attention's outputs
                assert torch.equal(a, b)
            else:
                torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(logits, model(ids).logits, atol=1e-4, rtol=1e-4)  # the prefill itself is unquantized


def test_beams_move_every_part_of_a_row():
    """reorder_cache / batch_select_indices / batch_repeat_interleave against caches fed in that row order."""
    model = tiny_llama(num_hidden_layers=2, vocab_size=1000)
    ids = torch.randint(5, 1000, (2, 50))
    nxt = torch.randint(5, 1000, (2, 1))
    protect = Protection(first=1, positions=(20,))

    def run(rows, select=None, repeat=None):
        with torch.no_grad():
            cache = quantized_sink_cache(model, 4, protect, group_size=16, residual=4)
            model(ids[rows], cache=cache)  # 50 tokens: packed blocks with holes, exact copies, a residual
            if select is not None:
                cache.reorder_cache(torch.tensor(select))
            if repeat is not None:
                cache.batch_repeat_interleave(repeat)
            n = len(select or rows) * (repeat or 1)
            return model(nxt[:n], cache=cache).logits[:, -1]

    assert torch.equal(run([0, 1], [1, 0]), run([1, 0]))
    assert torch.equal(run([0, 1], [1]), run([1]))
    assert torch.equal(run([1], repeat=2), run([1, 1]))


def _tiny_gemma3_local_global():
    import transformers as tf

    config = tf.Gemma3TextConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
                                 sliding_window=12, layer_types=["sliding_attention", "full_attention"],
                                 query_pre_attn_scalar=16)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return tf.Gemma3ForCausalLM(config).eval()


def test_sliding_layers_release_protected_tokens_no_query_can_see():
    """Gemma 3's local layers: a protected token that has left the window stays a hole in its block but loses its
    exact copy; the logits equal those of a cache keeping every copy (the model's mask hides the token)."""
    model = _tiny_gemma3_local_global()
    ids = torch.randint(5, 300, (1, 60))
    protect = Protection(first=1, positions=(9, 24, 44))  # 24 has left the window when its block is packed
    with torch.no_grad():
        cache = quantized_sink_cache(model, 2, protect, group_size=8, residual=4)
        every = quantized_sink_cache(model, 2, protect, group_size=8, residual=4)
        for layer in every.layers:
            layer.window = None  # the copies kept in every layer: what the cache did before
        assert [layer.window for layer in cache.layers] == [12, None]
        got, expected = [], []
        for c, out in ((cache, got), (every, expected)):
            out.append(model(ids[:, :30], cache=c).logits)
            for t in range(30, 60):  # decode: blocks are packed while the protected tokens leave the window
                out.append(model(ids[:, t:t + 1], cache=c).logits)
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(expected, 1), atol=1e-5, rtol=1e-5)
    local, full = cache.layers
    # Window 12: a key p is seen by no later query once p ≤ seen − 12. Block 24–31 is packed at seen = 36 (8 beyond
    # R = 4), with 24 just out (a hole without a copy, its block-mates quantized around it); 44 is packed in
    # window at seen = 52 and released at the next packing (seen = 60).
    assert local.p_pos is None and local.counts()["protected"] == 0
    assert full.p_pos.tolist() == [0, 9, 24, 44] and every.layers[0].p_pos.tolist() == [0, 9, 24, 44]
    assert local.nbytes() == every.layers[0].nbytes() - 4 * 2 * 16 * 2  # four 16-bit keys and values of width 16
    bare = quantized_sink_cache(model, 2, None, group_size=8, residual=4)
    with torch.no_grad():
        model(ids, cache=bare)
    assert bare.layers[0].nbytes() == local.nbytes()  # the local layer holds what an unprotected one holds


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_returns_the_reference_past_then_the_new_tokens(dtype):
    """What one layer hands attention at every update: the stored past — packed blocks dequantized, a protected
    token's exact copy in its hole, the residual — in position order, then the new tokens as given; against the
    float64 reference rebuild of the past (float32 and a 16-bit model's dtype)."""
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(2, 3, 60, 32, generator=gen).to(dtype)
    values = torch.randn(2, 3, 60, 32, generator=gen).to(dtype)
    protect = Protection(positions=(20,))  # position 0 is an ordinary packed token here
    layer = DynamicQuantizedSinkLayer(bits=4, group_size=16, residual=8, protect=protect)
    at = 0
    for c in (30, 1, 1, 9, 1, 1, 1, 15, 1):
        k, v = layer.update(keys[:, :, at:at + c], values[:, :, at:at + c])
        assert k.dtype == v.dtype == dtype and k.shape[-2] == at + c
        if at:
            want_k, want_v = _reference_past(keys[:, :, :at].float(), values[:, :, :at].float(), protect, 4, 16, 8)
            torch.testing.assert_close(k[:, :, :at].float(), want_k.to(dtype).float(), atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(v[:, :, :at].float(), want_v.to(dtype).float(), atol=2e-5, rtol=1e-5)
        assert torch.equal(k[:, :, at:], keys[:, :, at:at + c]) and torch.equal(v[:, :, at:], values[:, :, at:at + c])
        at += c
    assert layer.counts()["quantized"] > 0 and layer.counts()["protected"] == 1
