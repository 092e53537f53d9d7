"""Per-program trace records of the decode kernels (``trace=``: diagnostics only).

A traced launch is a separately compiled variant (``TRACE``) of any decode kernel, the
Triton one (``paged_decode``) or a Gluon one (``quant_fragments``, ``float_fragments``);
all call the functions here, so their records read alike
(``benchmarks/tools/trace_decode.py``). Program ``slot`` (``h * programs per head + pid``)
owns row ``slot`` of an int64 ``[programs, 8]`` buffer::

    field   0      1        2      3       4       5       6    7
            entry  planned  loop   looped  stored  merged  sm   tiles

Fields 0-5 are the global nanosecond timer at those points of the program, 6 the SM it
ran on, 7 the tiles of its chunk. A program beyond the plan records only its entry.
"""

from __future__ import annotations

import triton
import triton.language as tl

TRACE_FIELDS = ("entry", "planned", "loop", "looped", "stored", "merged", "sm", "tiles")
GLOBALTIMER_ASM = tl.constexpr("mov.u64 $0, %globaltimer;")
SMID_ASM = tl.constexpr("mov.u32 $0, %smid;")


@triton.jit
def stamp(trace_ptr, slot, field: tl.constexpr, TRACE: tl.constexpr):
    """``TRACE``: the global timer into field ``field`` of record ``slot``."""
    if TRACE:
        t = tl.inline_asm_elementwise(GLOBALTIMER_ASM, "=l,r", [slot], dtype=tl.int64,
                                      is_pure=False, pack=1)
        tl.store(trace_ptr + slot * 8 + field, t)


@triton.jit
def record_program(trace_ptr, slot, pid, tiles, TRACE: tl.constexpr):
    """``TRACE``: the SM that runs program ``pid`` and its ``tiles`` into fields 6 and 7
    of record ``slot``."""
    if TRACE:
        sm = tl.inline_asm_elementwise(SMID_ASM, "=r,r", [pid], dtype=tl.int32, is_pure=False,
                                       pack=1)
        tl.store(trace_ptr + slot * 8 + 6, sm.to(tl.int64))
        tl.store(trace_ptr + slot * 8 + 7, tiles.to(tl.int64))
