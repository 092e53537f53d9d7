"""The dequantization PTX of ``kv_tiles`` and ``quant_fragments`` against
``formats.dequantize``, on the host.

The GPU tests run this asm for real; CI cannot, so ``ptx_emulator`` executes it
instruction by instruction. Every byte value and a spread of scales (negative, tiny,
large) must give exactly the f16 that ``formats.dequantize`` (itself bit-exact against
``gguf``) rounds to. Operands are packed the way Triton packs sub-32-bit asm operands:
consecutive elements, element 0 in the low bits.
"""

from __future__ import annotations

import pytest
import torch
from ptx_emulator import pack_bytes, pack_f16, run, unpack_f16

from pagedserve.kernels import kv_tiles
from pagedserve.kv import formats

SCALES = [1.0, -0.0078125, 0.000123, 3.5e-05, 61.25, -1024.0]


def _q4_values(byte_values: list[int], d: float) -> tuple[list[float], list[float]]:
    """f16 values of the low and high nibbles of bytes placed in one q4_0 group."""
    group = torch.zeros(1, 16, dtype=torch.uint8)
    group[0, : len(byte_values)] = torch.tensor(byte_values, dtype=torch.uint8)
    vals = formats.dequantize(group, torch.tensor([[d]], dtype=torch.float16), "q4_0",
                              torch.float16)[0].tolist()  # 32 values: lo nibbles, then hi
    n = len(byte_values)
    return vals[:n], vals[16:16 + n]


@pytest.mark.parametrize("d", SCALES)
def test_q8_0_pairs(d):
    for start in range(-128, 128, 4):
        qs = list(range(start, start + 4))
        out = run(kv_tiles.Q8_PAIRS_ASM.value, [pack_bytes(qs), *pack_f16([d] * 4)], 2)
        data = torch.tensor([qs + [0] * 28], dtype=torch.int8)
        want = formats.dequantize(data, torch.tensor([[d]], dtype=torch.float16), "q8_0",
                                  torch.float16)[0, :4].tolist()
        assert unpack_f16(out) == want, qs


@pytest.mark.parametrize("d", SCALES)
def test_q4_0_halves(d):
    for start in range(0, 256, 4):
        b = list(range(start, start + 4))
        out = unpack_f16(run(kv_tiles.Q4_HALVES_ASM.value, [pack_bytes(b), *pack_f16([d] * 4)],
                             4))
        lo, hi = _q4_values(b, d)
        assert out == lo + hi, b


def test_q4_0_group_values():
    """``Q4_GROUP_ASM`` (the Gluon kernel's q4_0 K, scaled per group after the products):
    bytes b0..b3 -> registers (lo b0, lo b2), (lo b1, lo b3), (hi b0, hi b2), (hi b1, hi b3)
    of f16 values that exceed ``formats.dequantize``'s at scale 1 (nibble - 8, exact) by
    exactly ``LO_EXCESS`` (low nibbles) and ``HI_EXCESS`` (high nibbles)."""
    from pagedserve.kernels import quant_fragments as qf

    order = [0, 2, 1, 3]
    for start in range(0, 256, 4):
        b = list(range(start, start + 4))
        out = unpack_f16(run(qf.Q4_GROUP_ASM.value, [pack_bytes(b)], 4))
        lo, hi = _q4_values(b, 1.0)
        want = ([lo[k] + qf.LO_EXCESS.value for k in order]
                + [hi[k] + qf.HI_EXCESS.value for k in order])
        assert out == want, b


def test_q8_0_group_values():
    """``Q8_GROUP_ASM`` (the Gluon kernel's q8_0 K, scaled per group after the products):
    bytes b0..b3 -> registers (b0, b2), (b1, b3) of f16 values that exceed
    ``formats.dequantize``'s at scale 1 (qs, exact) by exactly ``Q8_EXCESS``."""
    from pagedserve.kernels import quant_fragments as qf

    for start in range(-128, 128, 4):
        qs = list(range(start, start + 4))
        out = unpack_f16(run(qf.Q8_GROUP_ASM.value, [pack_bytes(qs)], 2))
        data = torch.tensor([qs + [0] * 28], dtype=torch.int8)
        vals = formats.dequantize(data, torch.tensor([[1.0]], dtype=torch.float16), "q8_0",
                                  torch.float16)[0, :4].tolist()
        assert out == [vals[k] + qf.Q8_EXCESS.value for k in (0, 2, 1, 3)], qs


@pytest.mark.parametrize("d_pair", [(1.0, -0.0078125), (61.25, 3.5e-05), (-1024.0, 0.000123)])
def test_q4_0_pairs(d_pair):
    """``Q4_PAIRS_ASM`` (the Gluon kernel's V): bytes 0..3 of rows t and t + 1 -> eight
    registers of (row t, row t + 1) values, each with its row's scale."""
    from pagedserve.kernels import quant_fragments

    d_t, d_t1 = d_pair
    for start in range(0, 256, 4):
        row_t = list(range(start, start + 4))
        row_t1 = [(b * 37 + 11) % 256 for b in row_t]
        out = unpack_f16(run(quant_fragments.Q4_PAIRS_ASM.value,
                             [pack_bytes(row_t), pack_bytes(row_t1), *pack_f16([d_t, d_t1] * 2)],
                             8))
        lo_t, hi_t = _q4_values(row_t, d_t)
        lo_t1, hi_t1 = _q4_values(row_t1, d_t1)
        want = []
        for vals_t, vals_t1 in ((lo_t, lo_t1), (hi_t, hi_t1)):
            for k in range(4):
                want += [vals_t[k], vals_t1[k]]
        assert out == want, (row_t, row_t1)


@pytest.mark.parametrize("d_pair", [(1.0, -0.0078125), (61.25, 3.5e-05), (-1024.0, 0.000123)])
def test_q8_0_pairs_of_rows(d_pair):
    """``Q8_PAIRS_ROWS_ASM`` (the Gluon kernel's q8_0 V): bytes 0..3 of rows t and t + 1
    -> four registers of (row t, row t + 1) values, each with its row's scale."""
    from pagedserve.kernels import quant_fragments

    d_t, d_t1 = d_pair
    for start in range(-128, 128, 4):
        row_t = list(range(start, start + 4))
        row_t1 = [((b * 37 + 11) % 256) - 128 for b in row_t]
        out = unpack_f16(run(quant_fragments.Q8_PAIRS_ROWS_ASM.value,
                             [pack_bytes(row_t), pack_bytes(row_t1), *pack_f16([d_t, d_t1] * 2)],
                             4))
        want = []
        for k in range(4):
            for row, d in ((row_t, d_t), (row_t1, d_t1)):
                data = torch.tensor([[row[k]] + [0] * 31], dtype=torch.int8)
                want += formats.dequantize(data, torch.tensor([[d]], dtype=torch.float16),
                                           "q8_0", torch.float16)[0, :1].tolist()
        assert out == want, (row_t, row_t1)


def test_emulator_rejects_what_it_does_not_know():
    with pytest.raises(NotImplementedError, match="'add.u32'"):
        run("{ add.u32 $0, $1, 1; }", [5], 1)
