"""sinklab.attention: the parts mutation testing found unchecked (docs/testing.md).

References: the naive float64 loop of tests/test_attention.py, closed forms of the softmax with extra columns,
and the masks written out by hand.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sinklab.attention import Columns, attend, mask_rows, sink_mass, soft_cap, softmax_with_columns, softmax_with_sink
from test_attention import B, C, DH, DV, K, case, naive

pytestmark = pytest.mark.usefixtures("one_thread")


def _softmax_with_sink_reference(z: torch.Tensor, s: float) -> torch.Tensor:
    """``e^{z_j} / (e^s + Σ_k e^{z_k})`` row by row in float64 (``s = −∞``: no sink)."""
    z = z.double()
    top = max(float(z.max()), s)
    e = torch.exp(z - top)
    return e / (e.sum(-1, keepdim=True) + math.exp(s - top))


def test_softmax_with_sink_closed_form_and_per_head_broadcast():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64) * 4 + 300.0  # large: needs the max shift
    sinks = torch.tensor([[-1.0], [320.0], [-math.inf]], dtype=torch.float64)  # [H, 1]
    w = softmax_with_sink(scores, sinks)
    for b in range(2):
        for h in range(3):
            for i in range(4):
                want = _softmax_with_sink_reference(scores[b, h, i], float(sinks[h, 0]))
                torch.testing.assert_close(w[b, h, i], want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(sink_mass(w), 1 - w.sum(-1), atol=0, rtol=0)
    assert torch.allclose(sink_mass(w)[:, 2], torch.zeros(()).double(), atol=1e-12)  # −∞: no sink
    assert (sink_mass(w)[:, 1] > 0.5).all()


def test_a_fully_masked_row_goes_to_the_sink():
    scores = torch.tensor([[-math.inf, -math.inf], [0.0, math.log(3.0)]])
    w = softmax_with_sink(scores, 0.0)
    assert torch.equal(w[0], torch.zeros(2))
    torch.testing.assert_close(w[1], torch.tensor([1 / 5, 3 / 5]))
    w, x = softmax_with_columns(scores, torch.tensor([[math.log(2.0)], [math.log(2.0)]]))
    torch.testing.assert_close(w[1], torch.tensor([1 / 6, 3 / 6]))
    torch.testing.assert_close(x[:, 0], torch.tensor([1.0, 2 / 6]))  # row 0: everything to the column


def test_soft_cap_closed_form():
    x = torch.tensor([-100.0, -1.0, 0.0, 0.5, 30.0], dtype=torch.float64)
    assert soft_cap(x, None) is x
    torch.testing.assert_close(soft_cap(x, 20.0), 20.0 * torch.tanh(x / 20.0), atol=0, rtol=0)


def test_mask_rows_without_a_mask():
    # causal, 3 queries that are the last 3 of 5 positions; rows 1:3 asked
    allowed, add = mask_rows(None, True, 1, 3, 3, 5, "cpu")
    assert add is None and allowed.shape == (1, 1, 2, 5)
    assert allowed[0, 0].tolist() == [[True, True, True, True, False], [True] * 5]
    # one query (decoding) sees everything; not causal: everything
    assert mask_rows(None, True, 0, 1, 1, 4, "cpu")[0].all()
    full, _ = mask_rows(None, False, 0, 3, 3, 3, "cpu")
    assert full.shape == (1, 1, 3, 3) and full.all()


def test_mask_rows_from_boolean_and_additive_masks():
    boolean = torch.rand(2, 1, 4, 6, generator=torch.Generator().manual_seed(1)) > 0.5
    part, add = mask_rows(boolean, True, 1, 3, 4, 5, "cpu")
    assert add is None and torch.equal(part, boolean[..., 1:3, :5])
    for dtype in (torch.float32, torch.bfloat16):
        lowest = torch.finfo(dtype).min
        additive = torch.tensor([[[[0.0, lowest, -2.5], [lowest, lowest, 1.0]]]], dtype=dtype)
        allowed, add = mask_rows(additive, True, 0, 2, 2, 3, "cpu")
        assert allowed[0, 0].tolist() == [[True, False, True], [False, False, True]]
        assert add.dtype == torch.float32 and add[0, 0].tolist() == [[0.0, 0.0, -2.5], [0.0, 0.0, 1.0]]
        # the floor is half the lowest value: an entry just below it still counts as blocked
        allowed, _ = mask_rows(additive / 2 * 1.01, True, 0, 2, 2, 3, "cpu")
        assert allowed[0, 0].tolist() == [[True, False, True], [False, False, True]]


def test_columns_constructors():
    logit = torch.tensor([0.5, -1.0, 2.0], dtype=torch.float64)
    like = torch.zeros(1, dtype=torch.float32)
    sink = Columns.sink(logit, like)
    assert sink.logits.shape == (1, 3, 1, 1) and sink.logits.dtype == torch.float32
    assert sink.values is None and sink.visible is None
    g = torch.Generator().manual_seed(2)
    q, key, value = torch.randn(2, 4, 3, 8, generator=g), torch.randn(4, 8, generator=g), torch.randn(2, 5, generator=g)
    slot = Columns.slot(q, key, value, 0.25, softcap=1.5)
    want = 1.5 * torch.tanh(torch.einsum("bhcd,hd->bhc", q.double(), key.double()) * 0.25 / 1.5)
    assert slot.logits.shape == (2, 4, 3, 1) and slot.values.shape == (1, 2, 1, 5)
    torch.testing.assert_close(slot.logits[..., 0].double(), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(Columns.slot(q, key, value, 0.25).logits[..., 0].double(),
                               torch.einsum("bhcd,hd->bhc", q.double(), key.double()) * 0.25, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fast", [None, True, False])
def test_default_scale_and_no_mask(fast):
    """No ``scale``: ``dh^−½``; no ``visible`` and not causal: every key; with a bias but no mask as well."""
    q, k, v, _, _, _, bias = case(5, heads=4, kv_heads=2, padding=False, sink=False, slot=False, anchored=False,
                                  per_head_values=False, gate=None, bias=True)
    everything = torch.ones(1, 1, C, K, dtype=torch.bool)
    ref = naive(q, k, v, everything, scale=DH**-0.5)
    torch.testing.assert_close(attend(q, k, v, fast=fast).double(), ref, atol=2e-6, rtol=1e-5)
    ref = naive(q, k, v, everything, scale=DH**-0.5, bias=bias)
    torch.testing.assert_close(attend(q, k, v, bias=bias, fast=fast).double(), ref, atol=2e-6, rtol=1e-5)
    causal = torch.ones(C, K, dtype=torch.bool).tril(K - C)[None, None]
    ref = naive(q, k, v, causal, scale=DH**-0.5, bias=bias)
    torch.testing.assert_close(attend(q, k, v, causal=True, bias=bias, fast=fast).double(), ref, atol=2e-6,
                               rtol=1e-5)


def test_causal_square_with_columns_and_bias_uses_an_explicit_mask():
    q, k, v, _, cols, _, bias = case(6, heads=4, kv_heads=2, padding=False, sink=True, slot=True, anchored=False,
                                     per_head_values=False, gate=None, bias=True)
    kk, vv, bb = k[:, :, :C], v[:, :, :C], bias[..., :C]
    tri = torch.ones(C, C, dtype=torch.bool).tril()[None, None]
    for kw in (dict(columns=cols), dict(bias=bb), dict(columns=cols, bias=bb)):
        ref = naive(q, kk, vv, tri, scale=0.3, **kw)
        for path in (True, False):
            out = attend(q, kk, vv, causal=True, scale=0.3, fast=path, **kw)
            torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_weights_come_from_the_manual_path_by_default():
    q, k, v, visible, cols, _, _ = case(7, heads=4, kv_heads=2, padding=True, sink=True, slot=False, anchored=False,
                                        per_head_values=False, gate=None, bias=False)
    out, w = attend(q, k, v, visible, columns=cols, weights=True)
    torch.testing.assert_close(out, attend(q, k, v, visible, columns=cols, fast=False))
    assert w.shape == (B, 4, C, K)
    with pytest.raises(ValueError, match="the attention weights come from the manual path; pass fast=False"):
        attend(q, k, v, visible, weights=True, fast=True)
    with pytest.raises(ValueError, match="4 query heads do not split into groups over 3 key/value heads"):
        attend(q, torch.cat([k, k[:, :1]], 1), torch.cat([v, v[:, :1]], 1))
    with pytest.raises(ValueError, match="scaled_dot_product_attention has no softcap; use the manual path"):
        attend(q, k, v, softcap=3.0, fast=True)
    with pytest.raises(ValueError, match="head axis of size 3 fits neither 2 key/value heads nor 4 query heads"):
        attend(q, k, v, visible.expand(B, 3, C, K).contiguous(), fast=False)


def test_mask_from_only_masks_the_columns_from_it():
    """``mask_from=m``: every row sees keys ``< m``; the result equals the plain masked attention."""
    q, k, v, _, cols, _, _ = case(8, heads=4, kv_heads=2, padding=False, sink=True, slot=False, anchored=False,
                                  per_head_values=False, gate=None, bias=False)
    visible = torch.ones(B, 1, C, K, dtype=torch.bool)
    visible[:, :, :, 3:] = torch.rand(B, 1, C, K - 3, generator=torch.Generator().manual_seed(3)) > 0.5
    ref = naive(q, k, v, visible, scale=0.5, columns=cols)
    out, w = attend(q, k, v, visible, scale=0.5, columns=cols, fast=False, mask_from=3, weights=True)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=1e-5)
    assert (w.masked_fill(visible, 0.0) == 0).all()


@pytest.mark.parametrize("fast", [True, False])
def test_dropout_reaches_the_weights(fast):
    """``dropout`` is applied (p = 1 drops every weight: output 0; p = 0.5 changes it), 0 leaves it alone."""
    q, k, v, visible, cols, _, _ = case(9, heads=2, kv_heads=2, padding=False, sink=False, slot=True, anchored=False,
                                        per_head_values=False, gate=None, bias=False)
    plain = attend(q, k, v, visible, columns=cols, fast=fast)
    assert torch.equal(attend(q, k, v, visible, columns=cols, fast=fast, dropout=0.0), plain)
    assert not torch.allclose(attend(q, k, v, visible, columns=cols, fast=fast, dropout=0.5), plain)
    assert not torch.allclose(attend(q, k, v, visible, fast=fast, dropout=0.5), attend(q, k, v, visible, fast=fast))
    if not fast:
        assert torch.equal(attend(q, k, v, visible, columns=cols, fast=False, dropout=1.0), torch.zeros_like(plain))


@pytest.mark.parametrize("fast", [True, False])
def test_per_query_head_slot_values_with_grouped_keys(fast):
    """Slot values per query head (G = H) over grouped keys (Hkv < H), and a value-less sink next to them."""
    q, k, v, visible, cols, _, _ = case(10, heads=4, kv_heads=2, padding=True, sink=True, slot=True, anchored=False,
                                        per_head_values=True, gate=None, bias=False)
    ref = naive(q, k, v, visible, scale=0.4, columns=cols)
    torch.testing.assert_close(attend(q, k, v, visible, scale=0.4, columns=cols, fast=fast).double(), ref,
                               atol=2e-6, rtol=1e-5)
    assert DV == v.shape[-1]


# ----------------------------------------------------------------------------- from a full mutation run

def _rotated_scores_reference(q, keys, idx, shift, freqs, scale):
    """Per (query, anchored key): the key rotated by its shift as complex pairs (half layout), dotted with the query."""
    b, g, rep, c, dh = q.shape
    half = dh // 2
    out = torch.zeros(b, g, rep, c, idx.numel(), dtype=torch.float64)
    for bi, gi, ci, j in itertools.product(range(b), range(g), range(c), range(idx.numel())):
        k = keys[bi, gi, int(idx[j])].double()
        z = torch.complex(k[:half], k[half:]) * torch.polar(torch.ones(half, dtype=torch.float64),
                                                           float(shift[bi, ci, j]) * freqs)
        kr = torch.cat([z.real, z.imag])
        out[bi, gi, :, ci, j] = (q[bi, gi, :, ci].double() @ kr) * scale
    return out


@pytest.mark.parametrize("budget", [1 << 15, 5])  # one pass, and a few (query, key) pairs at a time
def test_rotated_key_scores_equal_each_key_rotated_per_query(budget, monkeypatch):
    from sinklab import attention
    from sinklab.rope import RopeSpec

    monkeypatch.setattr(attention, "_PAIR_BUDGET", budget)
    g = torch.Generator().manual_seed(7)
    b, hkv, rep, c, dh, slots = 2, 2, 3, 10, 8, 6  # more queries than head dimensions
    q = torch.randn(b, hkv, rep, c, dh, generator=g)
    keys = torch.randn(b, hkv, slots, dh, generator=g)
    idx = torch.tensor([0, 2, 5])
    shift = torch.randint(-9, 30, (b, c, 3), generator=g)
    freqs = torch.tensor([1.0, 0.4, 0.1, 0.02], dtype=torch.float64)
    got = attention.rotated_key_scores(q, keys, idx, shift, RopeSpec(freqs), 0.35)
    assert got.dtype == torch.float32 and got.shape == (b, hkv, rep, c, 3)
    torch.testing.assert_close(got.double(), _rotated_scores_reference(q, keys, idx, shift, freqs, 0.35),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_bidirectional_attention_with_columns_and_no_mask(fast):
    """``visible=None`` and not causal (an encoder): every key and the columns seen by every query."""
    g = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(B, 4, C, DH, generator=g), torch.randn(B, 2, K, DH, generator=g), torch.randn(B, 2, K, DV,
                                                                                                       generator=g)
    cols = [Columns(torch.randn(1, 4, 1, 1, generator=g)), Columns(torch.randn(B, 4, C, 1, generator=g),
                                                                   torch.randn(1, 2, 1, DV, generator=g))]
    got = attend(q, k, v, columns=cols, scale=0.3, fast=fast)
    want = naive(q, k, v, torch.ones(1, 1, C, K, dtype=torch.bool), scale=0.3, columns=cols)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_causal_queries_that_are_the_last_of_more_keys(fast):
    """``causal`` with fewer queries than keys (a decode chunk): query ``i`` sees keys ``≤ K − C + i``."""
    g = torch.Generator().manual_seed(12)
    q, k, v = torch.randn(B, 2, 2, DH, generator=g), torch.randn(B, 2, K, DH, generator=g), torch.randn(B, 2, K, DV,
                                                                                                       generator=g)
    got = attend(q, k, v, causal=True, scale=0.5, fast=fast)
    visible = torch.ones(2, K, dtype=torch.bool).tril(K - 2)[None, None]
    torch.testing.assert_close(got.double(), naive(q, k, v, visible, scale=0.5), atol=1e-5, rtol=1e-5)


def test_mask_rows_without_a_mask_for_later_rows_and_two_queries():
    causal = mask_rows(None, True, 0, 2, 2, 5, "cpu")[0][0, 0]
    assert causal.tolist() == [[True, True, True, True, False], [True] * 5]
    later = mask_rows(None, False, 2, 5, 5, 5, "cpu")[0]
    assert later.shape == (1, 1, 3, 5) and later.dtype == torch.bool and bool(later.all())


@pytest.mark.parametrize("fast", [True, False])
def test_column_values_grouped_over_fewer_heads_than_the_repeated_keys(fast):
    """Keys already repeated to every query head (``Hkv = H``) and a column whose values are per original key/value
    head (2 of 4): each query head reads its group's value."""
    g = torch.Generator().manual_seed(13)
    q, k, v = torch.randn(B, 4, C, DH, generator=g), torch.randn(B, 4, K, DH, generator=g), torch.randn(B, 4, K, DV,
                                                                                                       generator=g)
    values = torch.randn(1, 2, 1, DV, generator=g)
    col = Columns(torch.randn(B, 4, C, 1, generator=g), values)
    visible = torch.ones(C, K, dtype=torch.bool).tril(K - C)[None, None]
    got = attend(q, k, v, visible, columns=[col], scale=0.4, fast=fast)
    want = naive(q, k, v, visible, scale=0.4, columns=[Columns(col.logits, values.repeat_interleave(2, dim=1))])
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_path_errors_name_the_fix():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError) as err:
        attend(q, k, v, fast=True, weights=True)
    assert str(err.value) == "the attention weights come from the manual path; pass fast=False (or leave fast unset)"
    with pytest.raises(ValueError) as err:
        attend(q, k, v, fast=True, softcap=5.0)
    assert str(err.value) == "scaled_dot_product_attention has no softcap; use the manual path (fast=False)"


def test_fused_path_with_values_wider_than_keys_and_columns():
    """``dv > dh + e``: the fused call pads queries and keys to the value width (a non-empty zero block)."""
    g = torch.Generator().manual_seed(14)
    q, k, v = torch.randn(B, 2, C, DH, generator=g), torch.randn(B, 2, K, DH, generator=g), torch.randn(B, 2, K, 12,
                                                                                                       generator=g)
    cols = [Columns(torch.randn(1, 2, 1, 1, generator=g))]
    visible = torch.ones(C, K, dtype=torch.bool).tril(K - C)[None, None]
    got = attend(q, k, v, visible, columns=cols, scale=0.3, fast=True)
    torch.testing.assert_close(got.double(), naive(q, k, v, visible, scale=0.3, columns=cols), atol=1e-5, rtol=1e-5)
