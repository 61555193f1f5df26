"""sinklab.kvquant.codec: the parts mutation testing found unchecked (docs/testing.md), against closed forms.

The generic (byte-order independent) pack/unpack path, ``packed_width``, the input checks, the byte count and
``dequantize`` into a caller's buffer; references are the little-endian bit string and the stated formulas.
"""

from __future__ import annotations

import pytest
import torch

from sinklab.errors import InputError
from sinklab.kvquant import codec
from sinklab.kvquant.codec import dequantize, pack_bits, packed_width, quantize, unpack_bits

from test_kvquant import _pack_reference  # the one bit-string reference

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 5, 8, 13, 16])
def test_packed_width_is_the_bitstring_length(bits, n):
    width = packed_width(n, bits)
    assert type(width) is int and width == len(_pack_reference([0] * n, bits))
    assert pack_bits(torch.zeros(2, n, dtype=torch.long), bits).shape == (2, packed_width(n, bits))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("n", [1, 6, 9, 24])
def test_generic_path_matches_bitstring_and_round_trips(bits, n, monkeypatch):
    """The shift-and-mask path a big-endian host takes (``_LITTLE_ENDIAN`` False) gives the same bytes."""
    monkeypatch.setattr(codec, "_LITTLE_ENDIAN", False)
    codes = torch.randint(0, 1 << bits, (3, n), generator=torch.Generator().manual_seed(n + bits))
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [_pack_reference(row, bits) for row in codes.tolist()]
    back = unpack_bits(packed, bits, n)
    assert back.dtype == torch.uint8 and torch.equal(back.long(), codes)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_every_code_value_survives_packing(bits):
    """All ``2^bits`` codes, at every position of a word (the top code exercises every bit of the mask)."""
    top = (1 << bits) - 1
    codes = torch.tensor([[top] * 8, list(range(8)) if bits > 2 else [0, 1, 2, 3, 3, 2, 1, 0], [0] * 7 + [top]])
    packed = pack_bits(codes, bits)
    assert packed.tolist() == [_pack_reference(row, bits) for row in codes.tolist()]
    assert torch.equal(unpack_bits(packed, bits, 8).long(), codes)


@pytest.mark.parametrize("bits", [1, 5, 16, 2.0, True, "4"])
def test_bad_bit_widths_are_refused(bits):
    with pytest.raises(InputError, match=r"bits must be one of \(2, 3, 4, 8\), got"):
        quantize(torch.zeros(4, 8), bits, 4)
    with pytest.raises(InputError, match="bits must be one of"):
        pack_bits(torch.zeros(4, 8), bits)


def test_group_checks():
    x = torch.randn(2, 3, 8)
    for dim in (-3, -1, 0, 2):  # every existing dimension, both ends included
        q = quantize(x, 4, x.shape[dim], dim=dim)
        assert q.dim == dim % 3 and q.scale.shape[q.dim] == 1
    for dim in (3, -4):
        with pytest.raises(InputError, match=rf"dimension {dim} does not exist in a 3-D tensor"):
            quantize(x, 4, 1, dim=dim)
    for group in (0, -2, 2.0, True):
        with pytest.raises(InputError, match=r"group_size must be an integer ≥ 1, got"):
            quantize(x, 4, group)
    with pytest.raises(InputError, match="dimension -2 of size 3 is not a multiple of group_size 2"):
        quantize(x, 4, 2, dim=-2)
    assert quantize(x, 4, 1).scale.shape == x.shape  # group_size 1: every entry its own group


def test_quantized_tensor_records_what_dequantize_needs_and_counts_its_bytes():
    x = torch.randn(2, 3, 16, 10, dtype=torch.bfloat16)
    q = quantize(x, 3, 4, dim=-2)
    assert (q.bits, q.group_size, q.dim, q.shape, q.dtype) == (3, 4, 2, (2, 3, 16, 10), torch.bfloat16)
    assert q.packed.shape == (2, 3, 16, packed_width(10, 3)) and q.scale.shape == q.zero.shape == (2, 3, 4, 10)
    # packed bytes + a float16 scale and zero point per group
    assert q.nbytes == 2 * 3 * 16 * packed_width(10, 3) + 2 * (2 * 3 * 4 * 10) * 2
    assert dequantize(q).dtype == torch.bfloat16 and dequantize(q, torch.float64).dtype == torch.float64


def test_constant_and_two_valued_groups_decode_exactly():
    """A constant group stores scale 0 and decodes to its float16 value; a group of two float16 values decodes
    to both exactly (codes 0 and 2^b − 1, with ``(hi − lo) / (2^b − 1)`` exact)."""
    x = torch.tensor([[0.3], [0.1], [0.5]]).expand(3, 8)  # float16 rounds 0.3 up, 0.1 down, 0.5 exactly
    q = quantize(x, 2, 8)
    assert torch.equal(q.scale, torch.zeros(3, 1, dtype=torch.float16))
    assert torch.equal(dequantize(q), x.half().float())
    assert torch.equal(unpack_bits(q.packed, 2, 8), torch.zeros(3, 8, dtype=torch.uint8))
    for bits in (2, 3, 4, 8):
        levels = (1 << bits) - 1
        y = torch.tensor([[-float(levels), 0.0] * 4, [0.0, 2.0 * levels] * 4])  # scales 1 and 2: exact
        q = quantize(y, bits, 8)
        codes = unpack_bits(q.packed, bits, 8).long()
        assert codes.tolist() == [[0, levels] * 4, [0, levels] * 4]
        assert torch.equal(dequantize(q), y)


def test_codes_round_to_nearest_and_clamp():
    """``code = round((x − zero) / scale)`` in ``[0, 2^b − 1]`` (float64 closed form on an exact grid)."""
    lo, scale = -2.0, 0.25
    grid = torch.tensor([0.0, 0.4, 0.6, 1.0, 1.49, 1.51, 2.6, 3.0]) * scale + lo  # codes 0 0 1 1 1 2 3 3
    q = quantize(grid[None], 2, 8)
    assert float(q.zero) == lo and float(q.scale) == scale
    assert unpack_bits(q.packed, 2, 8).tolist() == [[0, 0, 1, 1, 1, 2, 3, 3]]


@pytest.mark.parametrize("dim", [-1, -2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_into_a_strided_buffer_equals_the_returned_tensor(dim, dtype):
    x = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(3)) * 3
    q = quantize(x, 4, 4, dim=dim)
    # float64 closed form: code · scale + zero, group by group
    codes = unpack_bits(q.packed, 4, 12).double()
    scale, zero = (t.double().repeat_interleave(4, dim=dim) for t in (q.scale, q.zero))
    want = codes * scale + zero
    torch.testing.assert_close(dequantize(q).double(), want, atol=1e-6, rtol=1e-6)
    big = torch.full((2, 8, 20), float("nan"), dtype=dtype)
    out = big[..., 4:16]  # unit last stride, not contiguous
    got = dequantize(q, out=out)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    torch.testing.assert_close(big[..., 4:16].double(), want.to(dtype).double(), atol=1e-2, rtol=1e-3)
    assert big[..., :4].isnan().all() and big[..., 16:].isnan().all()


@pytest.mark.parametrize("bits", [2, 4])
def test_unpacking_a_column_major_buffer_equals_unpacking_a_contiguous_one(bits):
    """Packed bytes held with a non-unit last stride (a transposed buffer) unpack to the same codes."""
    codes = torch.randint(0, 1 << bits, (6, 16), generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    column_major = packed.t().contiguous().t()
    assert column_major.stride()[-1] != 1 and torch.equal(column_major, packed)
    assert torch.equal(unpack_bits(column_major, bits, 16).long(), codes)


def test_quantize_defaults_to_min_max_groups_along_the_last_axis():
    """Default ``dim=-1``, ``clip=False``: each row group's zero is its minimum and its scale (max − min) / 3."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))
    q = quantize(x, 2, 16)
    g = x.double().unflatten(-1, (2, 16))
    lo, hi = g.amin(-1), g.amax(-1)
    assert q.dim == 1 and torch.equal(q.zero, lo.half()) and torch.equal(q.scale, ((hi - lo) / 3).half())
    assert not torch.equal(quantize(x, 2, 16, clip=True).scale, q.scale)  # clipping would shrink some range
