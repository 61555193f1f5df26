"""Every metric against a naive float64 loop (hypothesis) and closed-form cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sinklab import metrics

SETTINGS = settings(max_examples=40, deadline=None)


def _attention(seed: int, b: int, tq: int, tk: int, sharp: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(sharp * torch.randn(b, tq, tk, generator=g, dtype=torch.float64), dim=-1)


def _mask(seed: int, b: int, t: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    return torch.arange(t)[None] < lengths[:, None]


shapes = st.tuples(st.integers(0, 10_000), st.integers(1, 3), st.integers(1, 9))


@SETTINGS
@given(shapes, st.booleans())
def test_column_statistics_match_naive_loops(shape, causal):
    seed, b, t = shape
    attn = _attention(seed, b, t, t)
    mask = _mask(seed, b, t)
    vis = metrics.visibility(t, t, causal=causal, query_mask=mask, key_mask=mask)
    mass, low, routed = metrics.column_mass(attn, vis), metrics.column_min(attn, vis), metrics.routed_fraction(attn, vis)
    for s in range(b):
        n = int(mask[s].sum())
        for j in range(t):
            queries = [i for i in range(n) if j < n and (not causal or i >= j)]
            if not queries:
                assert math.isnan(mass[s, j]) and math.isnan(low[s, j])
                continue
            vals = [float(attn[s, i, j]) for i in queries]
            assert float(mass[s, j]) == pytest.approx(sum(vals) / len(vals), abs=1e-12)
            assert float(low[s, j]) == pytest.approx(min(vals), abs=1e-12)
            assert float(routed[s, j]) == pytest.approx(sum(v >= 0.5 for v in vals) / len(vals), abs=1e-12)


def test_column_mass_closed_forms():
    n = 6
    # Uniform causal attention: query i gives 1/(i+1) to each visible key, so α_j = mean_{i≥j} 1/(i+1).
    uniform = torch.tril(torch.ones(n, n, dtype=torch.float64))
    uniform = uniform / uniform.sum(-1, keepdim=True)
    mass = metrics.column_mass(uniform, metrics.visibility(n, n))
    for j in range(n):
        assert float(mass[j]) == pytest.approx(sum(1 / (i + 1) for i in range(j, n)) / (n - j))
    # One-hot column: everyone attends to key 0.
    onehot = torch.zeros(n, n, dtype=torch.float64)
    onehot[:, 0] = 1
    mass = metrics.column_mass(onehot, metrics.visibility(n, n))
    assert float(mass[0]) == 1.0 and float(mass[1:].sum()) == 0.0
    assert bool(metrics.is_eps_sink(metrics.column_min(onehot, metrics.visibility(n, n)), 0.0)[0])
    assert bool(metrics.is_relaxed_sink(metrics.routed_fraction(onehot, metrics.visibility(n, n)))[0])
    assert not bool(metrics.is_relaxed_sink(metrics.routed_fraction(uniform, metrics.visibility(n, n)))[0])


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 3), st.integers(1, 3), st.integers(2, 6),
       st.floats(0.05, 0.9))
def test_sink_rate_matches_naive_count(seed, s, layers, heads, t, eps):
    g = torch.Generator().manual_seed(seed)
    cm = torch.rand(s, layers, heads, t, generator=g, dtype=torch.float64)
    cm[0, :, :, t - 1] = math.nan  # sample 0 is one token short
    for pos in range(t):
        per_sample = []
        for i in range(s):
            if math.isnan(cm[i, 0, 0, pos]):
                continue
            hits = sum(float(cm[i, l_, h, pos]) > eps for l_ in range(layers) for h in range(heads))
            per_sample.append(100.0 * hits / (layers * heads))
        if per_sample:
            assert metrics.sink_rate(cm, pos, eps) == pytest.approx(float(np.mean(per_sample)), abs=1e-9)
        else:
            assert math.isnan(metrics.sink_rate(cm, pos, eps))


def test_sink_rate_rejects_bad_shapes_and_positions():
    with pytest.raises(ValueError):
        metrics.sink_rate(torch.zeros(2, 3, 4), 0)
    with pytest.raises(ValueError):
        metrics.sink_rate(torch.zeros(1, 1, 1, 3), 3)
    with pytest.raises(ValueError):
        metrics.is_eps_sink(torch.zeros(3), 1.5)


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(2, 8), st.integers(1, 5))
def test_value_norm_ratio_matches_naive(seed, b, t, d):
    g = torch.Generator().manual_seed(seed)
    norms = torch.rand(b, t, generator=g, dtype=torch.float64) + 0.1
    mask = _mask(seed, b, t) | (torch.arange(t) < 2)  # at least two real tokens
    sink = torch.randint(0, 2, (b,), generator=g)
    ratio = metrics.value_norm_ratio(norms, sink, mask)
    for s in range(b):
        others = [float(norms[s, j]) for j in range(t) if mask[s, j] and j != int(sink[s])]
        assert float(ratio[s]) == pytest.approx(float(norms[s, sink[s]]) / np.mean(others), rel=1e-12)


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 8), st.integers(1, 8))
def test_spectral_metrics_match_numpy(seed, n, d):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(n, d, generator=g, dtype=torch.float64)
    s = np.linalg.svd(u.numpy(), compute_uv=False)
    assert float(metrics.stable_rank(u)) == pytest.approx(float((s**2).sum() / s[0] ** 2), rel=1e-10)
    assert float(metrics.rank1_energy(u)) == pytest.approx(float(s[0] ** 2 / (s**2).sum()), rel=1e-10)
    mean = u.numpy().mean(0)
    expected = float(np.mean(mean**2) / np.mean(u.numpy() ** 2))  # E(mean_i u_i) / E(u)
    assert float(metrics.common_mode_fraction(u)) == pytest.approx(expected, rel=1e-10)


def test_spectral_closed_forms():
    a, b = torch.randn(7, 1, dtype=torch.float64), torch.randn(1, 5, dtype=torch.float64)
    assert float(metrics.stable_rank(a @ b)) == pytest.approx(1.0)
    assert float(metrics.rank1_energy(a @ b)) == pytest.approx(1.0)
    same = torch.randn(1, 5, dtype=torch.float64).expand(4, 5)
    assert float(metrics.common_mode_fraction(same)) == pytest.approx(1.0)
    orth = torch.eye(4, dtype=torch.float64)
    assert float(metrics.stable_rank(orth)) == pytest.approx(4.0)
    # Common mode of rows that cancel: zero.
    assert float(metrics.common_mode_fraction(torch.tensor([[1.0, 2.0], [-1.0, -2.0]]))) == pytest.approx(0.0)


@SETTINGS
@given(st.integers(0, 10_000), st.sampled_from([(4, 4), (4, 2), (4, 1), (2, 2)]), st.integers(2, 4),
       st.integers(4, 9))
def test_qk_spectrum_matches_dense_theta(seed, heads, dh, d):
    h, hkv = heads
    g = torch.Generator().manual_seed(seed)
    wq = torch.randn(h, dh, d, generator=g, dtype=torch.float64)
    wk = torch.randn(hkv, dh, d, generator=g, dtype=torch.float64)
    got = metrics.qk_spectrum(wq, wk)
    for head in range(h):
        theta = wq[head].T @ wk[head // (h // hkv)]  # (d, d) = Wq_hᵀ · Wk_h
        ref = np.linalg.svd(theta.numpy(), compute_uv=False)[: got.shape[-1]]
        np.testing.assert_allclose(got[head].numpy(), ref, rtol=1e-9, atol=1e-9)
    # The transpose trap: Wq·Wkᵀ (dh × dh) is a different matrix with a different spectrum in general.
    assert got.shape == (h, min(dh, d))


def test_qk_spectrum_rank_one_gate_and_sigma_ratio():
    d = 6
    q = torch.zeros(1, 2, d, dtype=torch.float64)
    q[0, 0, 0] = 3.0
    k = torch.zeros(1, 2, d, dtype=torch.float64)
    k[0, 0, 1] = 2.0
    s = metrics.qk_spectrum(q, k)
    assert float(s[0, 0]) == pytest.approx(6.0) and float(s[0, 1]) == pytest.approx(0.0)
    assert math.isinf(float(metrics.sigma_ratio(s)[0]))
    with pytest.raises(ValueError):
        metrics.qk_spectrum(torch.zeros(3, 2, d), torch.zeros(2, 2, d))


@SETTINGS
@given(st.integers(0, 10_000), st.integers(1, 3), st.integers(2, 7), st.integers(2, 6))
def test_massive_activations_match_naive(seed, b, t, d):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, d, generator=g, dtype=torch.float64)
    hidden[0, 0, 1] = 2000.0  # one massive entry
    mask = _mask(seed, b, t) | (torch.arange(t) < 1)
    flag, max_abs, dim = metrics.massive_activations(hidden, mask)
    for s in range(b):
        real = hidden[s][mask[s]].abs().numpy()
        med = float(np.sort(real.ravel())[(real.size - 1) // 2])  # lower median, like torch
        for i in range(t):
            m = float(hidden[s, i].abs().max())
            assert float(max_abs[s, i]) == m and int(dim[s, i]) == int(hidden[s, i].abs().argmax())
            expected = bool(mask[s, i]) and m > 100 and m >= 1000 * med
            assert bool(flag[s, i]) == expected
    assert bool(flag[0, 0]) == (2000.0 >= 1000 * float(metrics.activation_median(hidden, mask)[0]))


@SETTINGS
@given(st.integers(0, 10_000), st.integers(5, 30), st.floats(2.0, 8.0))
def test_high_norm_tokens_match_naive(seed, t, k):
    g = torch.Generator().manual_seed(seed)
    norms = torch.rand(t, generator=g, dtype=torch.float64) + 1.0
    norms[0] = 50.0
    flag = metrics.high_norm_tokens(norms, k=k)
    x = norms.numpy()
    med = float(np.sort(x)[(t - 1) // 2])
    mad = float(np.sort(np.abs(x - med))[(t - 1) // 2])
    np.testing.assert_array_equal(flag.numpy(), x > med + k * 1.4826 * mad)
    assert bool(flag[0])


def test_common_mode_fraction_batched_with_padding_rows_vs_loops():
    """Batched [B, H, N, d] input with padded rows: each (b, h) equals a float64 loop over its real rows only."""
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(2, 3, 5, 4, generator=gen)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)
    mask[0, :, 3:] = False  # sample 0 has 3 real rows
    mask[1, 1, 4] = False
    u[~mask] = 1e3  # padding rows hold garbage that must not count
    got = metrics.common_mode_fraction(u, mask)
    assert got.shape == (2, 3)
    for b in range(2):
        for h in range(3):
            rows = [u[b, h, i].double() for i in range(5) if mask[b, h, i]]
            mean = sum(rows) / len(rows)
            energy = sum(float((r * r).sum()) for r in rows) / len(rows)
            assert float(got[b, h]) == pytest.approx(float((mean * mean).sum()) / energy, rel=1e-10)
    full = torch.ones_like(mask)  # no mask means every row, batched too
    torch.testing.assert_close(metrics.common_mode_fraction(u), metrics.common_mode_fraction(u, full))
