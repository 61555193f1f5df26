"""sinklab.attention.attend: the fused and the manual path agree with each other and with a naive float64 loop."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from sinklab.attention import AttendSpec, Columns, attend

B, C, K, DH, DV = 2, 5, 7, 8, 6


def naive(q, k, v, visible, *, scale, bias=None, columns=(), softcap=None, gate=None):
    """One row at a time in float64: list the visible logits (keys, then columns), softmax, mix the values."""
    b, h, c, _ = q.shape
    rep = h // k.shape[1]
    out = torch.zeros(b, h, c, v.shape[-1], dtype=torch.float64)
    for bi, hi, i in itertools.product(range(b), range(h), range(c)):
        g = hi // rep
        logits, vals, sees_sequence = [], [], False
        for j in range(k.shape[2]):
            if visible[bi if visible.shape[0] > 1 else 0, hi if visible.shape[1] > 1 else 0, i, j]:
                z = float(q[bi, hi, i].double() @ k[bi, g, j].double()) * scale
                if softcap is not None:
                    z = softcap * math.tanh(z / softcap)
                if bias is not None:
                    z += float(bias[bi if bias.shape[0] > 1 else 0, hi if bias.shape[1] > 1 else 0, i, j])
                logits.append(z)
                vals.append(v[bi, g, j].double())
                sees_sequence = True
        for col in columns:
            for e in range(col.logits.shape[-1]):
                seen = col.visible is None or bool(col.visible[bi if col.visible.shape[0] > 1 else 0, 0,
                                                                i if col.visible.shape[2] > 1 else 0, e])
                if not seen:
                    continue
                sees_sequence = sees_sequence or col.visible is not None
                lg = col.logits[bi if col.logits.shape[0] > 1 else 0, hi if col.logits.shape[1] > 1 else 0,
                                i if col.logits.shape[2] > 1 else 0, e]
                logits.append(float(lg))
                if col.values is None:
                    vals.append(torch.zeros(v.shape[-1], dtype=torch.float64))
                else:
                    gv = col.values.shape[1]
                    head = 0 if gv == 1 else (g if gv == k.shape[1] else hi)
                    vals.append(col.values[bi if col.values.shape[0] > 1 else 0, head, e].double())
        if not sees_sequence:  # padding row
            continue
        w = torch.softmax(torch.tensor(logits, dtype=torch.float64), 0)
        row = sum(wj * vj for wj, vj in zip(w, vals))
        if gate is not None:
            row = row * gate[bi, i, hi].double()
        out[bi, hi, i] = row
    return out


def case(seed: int, *, heads: int, kv_heads: int, padding: bool, sink: bool, slot: bool, anchored: bool,
         per_head_values: bool, gate: str | None, bias: bool, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, k, v = r(B, heads, C, DH), r(B, kv_heads, K, DH), r(B, kv_heads, K, DV)
    causal = torch.ones(C, K, dtype=torch.bool).tril(K - C)
    visible = (causal & (torch.rand(B, 1, C, K, generator=g) > 0.3))
    visible[:, :, :, 0] = True  # the first key, as a sink token
    if padding:  # left padding of row 1: its first two queries see nothing, no query sees its first two keys
        visible[1, :, :2] = False
        visible[1, :, :, :2] = False
    columns = []
    if sink:
        columns.append(Columns(r(1, heads, 1, 1)))
    if slot:
        columns.append(Columns(r(B, heads, C, 1), r(1, heads if per_head_values else kv_heads, 1, DV)))
    if anchored:  # two keys scored elsewhere, seen by some queries (also by padding row 1's first query: not padding)
        seen = torch.rand(B, 1, C, 2, generator=g) > 0.4
        seen[1, :, 1] = False
        columns.append(Columns(r(B, heads, C, 2), r(B, kv_heads, 2, DV), seen))
    gates = None
    if gate is not None:
        gates = torch.sigmoid(r(B, C, heads, DV if gate == "elementwise" else 1))
    extra = r(B, heads, C, K) if bias else None
    return q, k, v, visible, columns, gates, extra


GRID = [dict(heads=h, kv_heads=hkv, padding=p, sink=s, slot=sl, anchored=a, per_head_values=ph, gate=gt, bias=bi)
        for (h, hkv), p, s, sl, a, ph, gt, bi in [
            ((4, 2), True, True, True, True, False, "elementwise", False),
            ((4, 2), True, False, False, False, False, None, False),
            ((4, 4), False, True, False, False, False, "headwise", True),
            ((4, 1), True, False, True, False, True, None, False),
            ((2, 2), True, True, True, False, False, None, True),
            ((4, 2), False, False, False, True, False, "headwise", False),
            ((6, 3), True, True, False, True, False, None, True),
        ]]


@pytest.mark.parametrize("spec", GRID, ids=lambda s: "-".join(f"{k}={v}" for k, v in s.items()))
def test_fast_and_manual_paths_agree_with_a_float64_loop(spec):
    q, k, v, visible, columns, gate, bias = case(1, **spec)
    scale = DH**-0.5
    ref = naive(q, k, v, visible, scale=scale, bias=bias, columns=columns, gate=gate)
    kw = dict(scale=scale, bias=bias, columns=columns, gate=gate)
    fast = attend(q, k, v, visible, fast=True, **kw)
    manual, probs = attend(q, k, v, visible, fast=False, weights=True, **kw)
    assert torch.allclose(fast.double(), ref, atol=2e-6, rtol=1e-5), (fast.double() - ref).abs().max()
    assert torch.allclose(manual.double(), ref, atol=2e-6, rtol=1e-5), (manual.double() - ref).abs().max()
    assert torch.allclose(fast, manual, atol=1e-6, rtol=1e-5)
    if spec["padding"]:  # padding rows come out as exact zeros on both paths
        pad = ~(visible.any(-1) | torch.stack([c.visible.any(-1) for c in columns if c.visible is not None] or
                                              [torch.zeros_like(visible.any(-1))]).any(0))
        assert pad.any()
        rows = pad[:, 0]  # (B, C)
        assert fast.transpose(1, 2)[rows].abs().max() == 0 and manual.transpose(1, 2)[rows].abs().max() == 0
    # the weights over the keys: invisible keys exactly 0; each row sums to 1 minus what the columns took
    assert (probs.masked_fill(visible, 0.0) == 0).all()
    if not columns:
        real = visible.any(-1).expand(B, q.shape[1], C)
        assert torch.allclose(probs.sum(-1)[real], torch.ones(()), atol=1e-6)
    # float64 inputs: both paths match the loop to rounding
    q64, k64, v64 = q.double(), k.double(), v.double()
    cols64 = [Columns(c.logits.double(), None if c.values is None else c.values.double(), c.visible) for c in columns]
    kw64 = dict(scale=scale, bias=None if bias is None else bias.double(), columns=cols64,
                gate=None if gate is None else gate.double())
    for path in (True, False):
        out = attend(q64, k64, v64, visible, fast=path, **kw64)
        assert torch.allclose(out, ref, atol=1e-12, rtol=1e-10), (path, (out - ref).abs().max())


@pytest.mark.parametrize("columns", [False, True])
def test_softcap_and_causal(columns):
    q, k, v, visible, cols, gate, _ = case(2, heads=4, kv_heads=2, padding=False, sink=columns, slot=columns,
                                           anchored=False, per_head_values=False, gate=None, bias=False)
    causal = torch.ones(C, K, dtype=torch.bool).tril(K - C)[None, None]
    ref = naive(q, k, v, causal, scale=0.3, columns=cols, softcap=2.0)
    out = attend(q, k, v, causal=True, scale=0.3, columns=cols, softcap=2.0)  # softcap → the manual path
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="softcap"):
        attend(q, k, v, causal=True, softcap=2.0, fast=True)
    # causal with as many keys as queries: the fused kernel's own causal mode
    kk, vv = k[:, :, :C], v[:, :, :C]
    tri = torch.ones(C, C, dtype=torch.bool).tril()[None, None]
    ref = naive(q, kk, vv, tri, scale=0.3, columns=cols)
    for path in (True, False):
        out = attend(q, kk, vv, causal=True, scale=0.3, columns=cols, fast=path)
        assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5)


def test_gradients_reach_the_column_logits():
    q, k, v, visible, cols, _, _ = case(3, heads=4, kv_heads=2, padding=True, sink=True, slot=True, anchored=False,
                                        per_head_values=False, gate=None, bias=False, dtype=torch.float64)
    grads = []
    for path in (True, False):
        sink = cols[0].logits.clone().requires_grad_(True)
        out = attend(q, k, v, visible, columns=[Columns(sink), cols[1]], fast=path)
        out.square().sum().backward()
        grads.append(sink.grad)
    assert grads[0].abs().max() > 0
    assert torch.allclose(grads[0], grads[1], atol=1e-12)


def test_a_switched_off_sink_is_no_column():
    """A −∞ sink logit (a variant's sink initialised off) takes nothing, on both paths (no NaN from −∞ · 0)."""
    q, k, v, visible, _, _, _ = case(4, heads=4, kv_heads=2, padding=True, sink=False, slot=False, anchored=False,
                                     per_head_values=False, gate=None, bias=False)
    off = Columns.sink(torch.full((4,), -math.inf), q)
    for path in (True, False):
        plain = attend(q, k, v, visible, fast=path)
        out = attend(q, k, v, visible, columns=[off], fast=path)
        assert not out.isnan().any() and torch.allclose(out, plain, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype,queries,upcast", [(torch.float16, 1, True), (torch.float16, 5, True),
                                                  (torch.bfloat16, 1, True), (torch.bfloat16, 5, False)])
def test_16_bit_fused_attention_on_a_cpu_computes_in_float32_where_that_is_faster(dtype, queries, upcast,
                                                                                   monkeypatch):
    """The fused path on a CPU hands float16, and one-query bfloat16, to torch's kernel in float32 (its 16-bit CPU
    kernel is slower on AVX2: docs/stream.md) and rounds the output once; several bfloat16 queries keep the 16-bit kernel.
    Either way — plain, with a sink column, with a bias — the output is the float64 loop's to the 16-bit format's
    rounding."""
    q, k, v, visible, columns, _, bias = case(9, heads=6, kv_heads=2, padding=False, sink=True, slot=False,
                                              anchored=False, per_head_values=False, gate=None, bias=True)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    q, visible, bias = q[:, :, -queries:], visible[:, :, -queries:], bias[:, :, -queries:].to(dtype)
    columns = [Columns(c.logits.to(dtype)) for c in columns]
    kernel, seen = torch.nn.functional.scaled_dot_product_attention, []

    def spy(query, key, value, attn_mask=None, **kw):
        seen.append({query.dtype, key.dtype, value.dtype} | ({attn_mask.dtype} - {torch.bool} if attn_mask is not None
                                                             else set()))
        return kernel(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    scale = DH**-0.5
    for cols, b in (((), None), (columns, None), ((), bias)):
        out = attend(q, k, v, visible, columns=cols, bias=b, scale=scale, fast=True)
        assert out.dtype == dtype and seen.pop() == {torch.float32 if upcast else dtype}
        ref = naive(q, k, v, visible, scale=scale, columns=cols, bias=b)
        tol = 2 * torch.finfo(dtype).eps
        assert torch.allclose(out.double(), ref, atol=tol, rtol=tol), (out.double() - ref).abs().max()


@pytest.mark.parametrize("fast", [True, False])
def test_a_spec_object_is_the_keyword_form_and_keywords_override_it(fast):
    """``attend(q, k, v, visible, AttendSpec(...))`` runs the same maths as the keywords (the float64 loop), and a
    keyword given beside a spec replaces that one field only."""
    q, k, v, visible, columns, gate, bias = case(3, **GRID[0])
    scale = DH**-0.5
    spec = AttendSpec(scale=scale, columns=columns, gate=gate, fast=fast)
    ref = naive(q, k, v, visible, scale=scale, columns=columns, gate=gate)
    out = attend(q, k, v, visible, spec)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5), (out.double() - ref).abs().max()
    assert isinstance(spec.columns, tuple) and spec.columns == tuple(columns)  # a list given is kept as a tuple
    scaled = naive(q, k, v, visible, scale=0.5, columns=columns, gate=gate)
    out = attend(q, k, v, visible, spec, scale=0.5)
    assert torch.allclose(out.double(), scaled, atol=2e-6, rtol=1e-5), (out.double() - scaled).abs().max()
    assert spec.scale == scale  # the spec itself is unchanged
    out, probs = attend(q, k, v, visible, spec, fast=False, weights=True)
    assert torch.allclose(out.double(), ref, atol=2e-6, rtol=1e-5) and probs.shape == (B, 4, C, K)
    # the path: fused unless there is a softcap or the weights are asked for
    assert AttendSpec().fused(False) is True and AttendSpec(softcap=2.0).fused(False) is False
    assert AttendSpec().fused(True) is False and AttendSpec(fast=False).fused(False) is False
    wide = attend(q, k, v, visible, spec, gate=gate.double())  # a float64 gate: the output keeps the query's dtype
    assert wide.dtype == torch.float32 and torch.allclose(wide.double(), ref, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="no softcap"):
        AttendSpec(softcap=2.0, fast=True)
    with pytest.raises(ValueError, match="weights come from the manual path"):
        attend(q, k, v, visible, AttendSpec(fast=True), weights=True)
    with pytest.raises(TypeError):
        attend(q, k, v, visible, casual=True)  # a misspelt option is not silently dropped
