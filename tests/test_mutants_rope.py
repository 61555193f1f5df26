"""sinklab.rope: the parts mutation testing found unchecked (docs/testing.md), against a float64 complex rotation.

Pair ``f`` of a rotated key is the complex number ``x_a + i·x_b`` (half layout: ``a = f``, ``b = f + r/2``;
interleaved: ``a = 2f``, ``b = 2f + 1``); a rotation by position ``Δ`` multiplies it by ``e^{iΔω_f}``.
"""

from __future__ import annotations

import pytest
import torch

from sinklab import rope

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(x: torch.Tensor, inv_freq: torch.Tensor, delta: torch.Tensor, interleaved: bool,
               offset: int) -> torch.Tensor:
    """Rotate dimensions ``[offset, offset + r)`` of ``x`` by ``delta · ω`` as complex numbers, in float64."""
    r = 2 * inv_freq.numel()
    xd = x.double()
    xr = xd[..., offset:offset + r]
    a, b = (xr[..., 0::2], xr[..., 1::2]) if interleaved else (xr[..., : r // 2], xr[..., r // 2:])
    z = torch.complex(a, b) * torch.polar(torch.ones(()).double(), delta.double()[..., None] * inv_freq.double())
    rot = torch.stack([z.real, z.imag], -1).flatten(-2) if interleaved else torch.cat([z.real, z.imag], -1)
    lead = torch.broadcast_shapes(xd.shape[:-1], rot.shape[:-1])
    parts = [xd[..., :offset].expand(*lead, offset), rot.expand(*lead, r),
             xd[..., offset + r:].expand(*lead, x.shape[-1] - offset - r)]
    return torch.cat(parts, -1)


FREQS = torch.tensor([1.0, 0.3, 0.05, -0.7], dtype=torch.float64)  # one negative: turns the other way


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("offset, dh", [(0, 8), (0, 11), (3, 11), (3, 8 + 3), (5, 16)])
def test_rotate_equals_a_complex_rotation_for_every_layout_and_offset(interleaved, offset, dh):
    g = torch.Generator().manual_seed(offset * 31 + dh)
    x = torch.randn(2, 3, 4, dh, dtype=torch.float64, generator=g)
    delta = torch.tensor([0.0, 1.0, -7.0, 1234.5], dtype=torch.float64)  # broadcast over the token axis
    spec = rope.RopeSpec(FREQS, interleaved=interleaved, offset=offset)
    assert spec.rot_dim == 8
    got = rope.rotate(x, spec, delta)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, _reference(x, FREQS, delta, interleaved, offset), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(rope.rotate(got, spec, -delta), x, atol=1e-12, rtol=1e-12)


def test_rotate_broadcasts_delta_against_the_leading_axes():
    """``delta`` with more leading axes than ``x``: the result takes the broadcast shape, pass-through included."""
    x = torch.randn(3, 10, dtype=torch.float64)
    delta = torch.tensor([[1.0], [2.0]], dtype=torch.float64)  # (2, 1) against x's (3,)
    spec = rope.RopeSpec(FREQS, offset=1)
    got = rope.rotate(x, spec, delta)
    assert got.shape == (2, 3, 10)
    torch.testing.assert_close(got, _reference(x, FREQS, delta, False, 1), atol=1e-12, rtol=1e-12)


def test_defaults_are_the_half_layout_from_dimension_zero():
    spec = rope.RopeSpec(FREQS)
    assert (spec.interleaved, spec.attention_scaling, spec.offset) == (False, 1.0, 0)
    x = torch.randn(2, 10, dtype=torch.float64)
    delta = torch.tensor(3.0, dtype=torch.float64)
    cos, sin = rope.angles(spec, delta)
    want = _reference(x, FREQS, delta, False, 0)
    torch.testing.assert_close(rope.rotate_with(x, cos, sin), want, atol=1e-12, rtol=1e-12)
    c, s = rope.pair_factors(cos, sin)
    torch.testing.assert_close(rope.rotate_pairs(x, c, s), want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(rope.pair_partner(x[..., :8]), torch.cat([x[..., 4:8], x[..., :4]], -1))


def test_angles_are_float64_products_of_delta_and_frequency():
    spec = rope.RopeSpec(FREQS)
    delta = torch.tensor([4_000_001, -3], dtype=torch.int64)
    cos, sin = rope.angles(spec, delta)
    assert cos.dtype == sin.dtype == torch.float64 and cos.shape == (2, 4)
    theta = torch.tensor([[float(d) * float(w) for w in FREQS] for d in (4_000_001, -3)], dtype=torch.float64)
    torch.testing.assert_close(cos, theta.cos(), atol=1e-12, rtol=0)
    torch.testing.assert_close(sin, theta.sin(), atol=1e-12, rtol=0)


def test_low_precision_keys_rotate_in_the_factors_dtype_and_come_back_in_their_own():
    """``rotate_pairs`` computes in ``c``'s dtype (float64 here) and returns ``x``'s: a bfloat16 key rotated by a
    float64 factor equals the float64 rotation of its exact value, rounded once."""
    x = torch.randn(4, 12).bfloat16()
    spec = rope.RopeSpec(FREQS, interleaved=True, offset=2)
    delta = torch.tensor(1_000_003.0, dtype=torch.float64)
    got = rope.rotate(x, spec, delta)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _reference(x, FREQS, delta, True, 2).bfloat16())


def test_rotate_pairs_computes_in_the_factors_dtype():
    """float64 keys with float32 factors: the rotation is done in float32 (the factors' dtype), then widened back."""
    x = torch.randn(3, 8, dtype=torch.float64)
    theta = torch.tensor([0.7, -1.3, 2.9, 0.1]) * 1000
    c, s = rope.pair_factors(theta.cos(), theta.sin())
    got = rope.rotate_pairs(x, c, s)
    assert got.dtype == torch.float64
    xf = x.float()
    want = (xf * c + torch.cat([xf[..., 4:], xf[..., :4]], -1) * s).double()  # the same sums, all in float32
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    wide = x * c.double() + torch.cat([x[..., 4:], x[..., :4]], -1) * s.double()  # the same factors in float64
    assert (got - wide).abs().max() > 1e-9  # float32 rounding shows
