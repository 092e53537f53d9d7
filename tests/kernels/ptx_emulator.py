"""A tiny interpreter of the PTX subset in the dequantization asm of ``kernels/kv_tiles.py``.

CI has no GPU, so the inline PTX never runs there; this runs it on the host, instruction
by instruction, with the semantics of the PTX ISA manual: 32-bit registers as Python ints,
``prmt`` in its default mode, ``lop3`` by its lookup table, and ``f16x2`` arithmetic as two
IEEE half operations (numpy's float16 rounds each result to nearest even, as the GPU does).

Supported: ``.reg .b32`` declarations, ``mov.b32``, ``and.b32``, ``shr.b32``, ``prmt.b32``,
``lop3.b32``, ``sub.f16x2``, ``mul.f16x2``, ``fma.rn.f16x2`` (one rounding: the exact
product and sum in float64, then to f16). Anything else raises, so an edit to the asm that
uses a new instruction fails loudly here instead of passing untested.
"""

from __future__ import annotations

import re

import numpy as np

MASK = 0xFFFFFFFF


def _halves(x: int) -> np.ndarray:
    return np.array([x & 0xFFFF, x >> 16], dtype=np.uint16).view(np.float16)


def _pack(h: np.ndarray) -> int:
    lo, hi = h.astype(np.float16).view(np.uint16).tolist()
    return lo | (hi << 16)


def _prmt(a: int, b: int, sel: int) -> int:
    pool = (a | (b << 32)).to_bytes(8, "little")
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        if nib & 8:
            raise NotImplementedError("prmt sign-replicate selectors are not emulated")
        out |= pool[nib] << (8 * i)
    return out


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    out = 0
    for k in range(8):
        if lut >> k & 1:
            term = MASK
            for value, bit in ((a, k >> 2 & 1), (b, k >> 1 & 1), (c, k & 1)):
                term &= value if bit else ~value & MASK
            out |= term
    return out


def run(asm: str, inputs: list[int], num_outputs: int) -> list[int]:
    """Run ``asm`` with ``$0 .. $(num_outputs - 1)`` as outputs and the next operands bound
    to ``inputs`` (32-bit register values); return the outputs."""
    regs: dict[str, int] = {f"${num_outputs + i}": v & MASK for i, v in enumerate(inputs)}

    def val(tok: str) -> int:
        tok = tok.strip()
        if tok in regs:
            return regs[tok]
        if re.fullmatch(r"0x[0-9a-fA-F]+|\d+", tok):
            return int(tok, 0) & MASK
        raise KeyError(f"register {tok!r} read before it was written")

    for raw in asm.replace("{", "").replace("}", "").split(";"):
        line = raw.strip()
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *src = [t.strip() for t in rest.split(",")]
        if op == "mov.b32":
            out = val(src[0])
        elif op == "and.b32":
            out = val(src[0]) & val(src[1])
        elif op == "shr.b32":
            out = val(src[0]) >> (val(src[1]) & 31)
        elif op == "prmt.b32":
            out = _prmt(val(src[0]), val(src[1]), val(src[2]))
        elif op == "lop3.b32":
            out = _lop3(val(src[0]), val(src[1]), val(src[2]), val(src[3]))
        elif op in ("sub.f16x2", "mul.f16x2"):
            a, b = _halves(val(src[0])), _halves(val(src[1]))
            with np.errstate(over="ignore"):  # f16 overflow gives inf, as on the GPU
                out = _pack(a - b if op == "sub.f16x2" else a * b)
        elif op == "fma.rn.f16x2":
            a, b, c = (_halves(val(t)).astype(np.float64) for t in src)
            with np.errstate(over="ignore"):
                out = _pack((a * b + c).astype(np.float16))
        else:
            raise NotImplementedError(f"instruction {op!r} is not emulated")
        regs[dst] = out & MASK
    return [regs[f"${i}"] for i in range(num_outputs)]


def pack_bytes(values: list[int]) -> int:
    """Four 8-bit elements in one register, element 0 in the low byte (Triton's packing of
    sub-32-bit asm operands)."""
    return int.from_bytes(bytes(v & 0xFF for v in values), "little")


def pack_f16(values: list[float]) -> list[int]:
    """f16 elements two per register, element 0 in the low half."""
    h = np.array(values, dtype=np.float16).view(np.uint16).tolist()
    return [h[i] | (h[i + 1] << 16) for i in range(0, len(h), 2)]


def unpack_f16(regs: list[int]) -> list[float]:
    return [float(v) for r in regs for v in _halves(r)]
