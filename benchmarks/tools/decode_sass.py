"""Instruction counts of the decode kernel's tile loop, compiled for sm_90 on any machine.

No GPU needed: Triton compiles the kernel for an H100/H200 target (``GPUTarget("cuda", 90,
32)``) with the launch's divisibility hints (pointers and 16-divisible strides, as the JIT
would see them for the Qwen3.5 shape), and ``cuobjdump`` from Triton's wheel disassembles
it. For each configuration it prints registers, spill bytes, the instruction count of
the main tile loop (the largest backward branch), its most frequent opcodes and memory
instructions, its barriers, and what each forward branch inside it skips (the body of a
rarely taken ``if`` counts in the loop's size, not in its usual path): a quick way to
compare tile formulations before spending device time.

    python benchmarks/tools/decode_sass.py [--contiguous] [--separate]
        [K:V:MODE:BLOCK_N:WARPS[:STAGES[:TABLE_READ]] ...]
    e.g. python benchmarks/tools/decode_sass.py q4_0:q4_0:packed:64:8 q8_0:q8_0:fragment:64:4

K and V are in the library's layout (``KVBlockStorage.allocate_pair``: side by side when
their types match); ``--separate`` compiles the launch over K and V in their own buffers.

``MAXNREG=N`` in the environment caps registers as ``DecodeConfig.maxnreg`` does. The counts
are per thread per loop iteration; compare configurations with the same
values per thread (``block_n * 256 * 2 / (32 * warps)`` for D = 256).
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import _common  # noqa: E402
from triton.experimental.gluon._runtime import GluonASTSource  # noqa: E402

from pagedserve.kernels import float_fragments, fragment_warps, quant_fragments  # noqa: E402
from pagedserve.kernels.decode_plan import DecodeConfig  # noqa: E402
from pagedserve.kernels.paged_decode import _paged_decode_kernel, launch_constants  # noqa: E402

HQ, HKV, D, BS = 24, 4, 256, 16
POINTER_TYPES = {"f16": "*fp16", "bf16": "*bf16", "q8_0": "*i8", "q4_0": "*u8"}
DEFAULTS = ["f16:f16:fragment:64:4:2:block", "q8_0:q8_0:fragment:64:4:2:block",
            "q4_0:q4_0:fragment:128:4:2:block", "q4_0:q4_0:packed:128:4:1"]


def compile_decode(k_type: str, v_type: str, cfg: DecodeConfig, paged: bool = True,
                   separate: bool = False):
    """The compiled kernel for one launch configuration (Qwen3.5 attention shape; the
    paged or the contiguous layout's tile addressing; K and V as ``allocate_pair`` makes
    them, or ``separate``ly allocated), with the compile-time arguments
    the library's launcher would pass (``paged_decode.launch_constants``; for
    ``fragment``, the Gluon kernel's subset and layouts, as ``quant_fragments.launch`` and
    ``float_fragments.launch``)."""
    interleave = 2 if k_type == v_type and not separate else 1
    const = launch_constants(cfg, k_type, v_type, HQ // HKV, D, BS, paged=paged,
                             max_batch=8, native=True, interleave=interleave,
                             trace=os.environ.get("TRACE") == "1")
    if cfg.quant_dot == "fragment" and k_type == v_type == "f16":
        kernel, source = float_fragments.float_fragment_kernel, GluonASTSource
        const = {k: const[k] for k in fragment_warps.SHARED_CONSTANTS}
        const.update(float_fragments.kernel_constants(cfg.num_warps, cfg.num_stages))
    elif cfg.quant_dot == "fragment":
        kernel, source = quant_fragments.fragment_decode_kernel, GluonASTSource
        const = {k: const[k] for k in fragment_warps.SHARED_CONSTANTS}
        const.update(quant_fragments.kernel_constants(k_type, cfg.num_warps,
                                                      cfg.block_n // cfg.num_warps,
                                                      cfg.num_stages))
    else:
        kernel, source = _paged_decode_kernel, ASTSource
    names = kernel.arg_names
    pointers = {
        "q_ptr": "*fp16", "out_ptr": "*fp16", "kd_ptr": POINTER_TYPES[k_type],
        "ks_ptr": "*fp16", "vd_ptr": POINTER_TYPES[v_type], "vs_ptr": "*fp16",
        "table_ptr": "*i32", "lens_ptr": "*i32", "part_acc_ptr": "*fp32",
        "part_ml_ptr": "*fp32", "group_counter_ptr": "*i32", "seq_counter_ptr": "*i32",
        "trace_ptr": "*i64",
    }
    # Strides of q, out and the block table at the Qwen3.5 shape: all multiples of 16.
    strides16 = {"stride_qb", "stride_qh", "stride_ob", "stride_oh"}
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in const:
            signature[name] = "constexpr"
        else:
            signature[name] = "fp32" if name == "qk_scale" else "i32"
            if name in strides16:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = source(fn=kernel, signature=signature,
                 constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages,
                                   **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {})})


def _cuobjdump(cubin: bytes, flag: str) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"decode_sass_{os.getpid()}.cubin"
    path.write_bytes(cubin)
    try:
        return subprocess.run([str(tool), flag, str(path)], capture_output=True, text=True,
                              check=True).stdout
    finally:
        path.unlink(missing_ok=True)


def loop_stats(kernel) -> dict:
    """Registers, spills, and the main loop's instruction mix of a compiled kernel."""
    cubin = kernel.asm["cubin"]
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", _cuobjdump(cubin, "-res-usage")).groups()
    code, stall = [], {}
    lines = _cuobjdump(cubin, "-sass").splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(.*?);", line)
        if m:
            code.append((int(m.group(1), 16), m.group(2)))
            # sm_70+: the second 64-bit word of an instruction holds its control bits, the
            # stall count (cycles before the next instruction issues) at bits 41-44.
            hi = re.search(r"/\* (0x[0-9a-f]+) \*/", lines[i + 1]) if i + 1 < len(lines) else None
            stall[code[-1][0]] = (int(hi.group(1), 16) >> 41) & 0xF if hi else 0
    loops = []
    for addr, text in code:
        target = re.search(r"BRA .*0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < addr:
            lo = int(target.group(1), 16)
            loops.append((sum(1 for a, _ in code if lo <= a <= addr), lo, addr))
    # The tile loop: the largest loop with tensor-core instructions (the merge's loops,
    # which the Gluon kernel's can outgrow, have none).
    mma_loops = [loop for loop in loops
                 if any("HMMA" in text for a, text in code if loop[1] <= a <= loop[2])]
    size, lo, hi = max(mma_loops or loops)
    ops, mem = collections.Counter(), collections.Counter()
    # Where the 16-byte global loads are issued: how many come before the second half of
    # the loop's MMAs (the O^T products, after S^T's), i.e. early in the iteration.
    mma_total = sum(1 for a, text in code if lo <= a <= hi and "HMMA" in text)
    loads_early = 0
    # Forward branches inside the loop and how many instructions each skips: an ``if``
    # whose body runs rarely (say, a rescale) is counted in the loop's size but not in
    # its usual path.
    skips = []
    for addr, text in code:
        if lo <= addr <= hi:
            target = re.search(r"BRA .*0x([0-9a-f]+)", text)
            if target and addr < int(target.group(1), 16) <= hi:
                end = int(target.group(1), 16)
                skips.append(sum(1 for a, _ in code if addr < a < end))
            ops[re.match(r"(@!?U?P\w+\s+)?([A-Z0-9_]+)", text).group(2)] += 1
            m = re.search(r"\b((?:LDG|LDGSTS|STS|LDS|STSM|LDSM)\S*)", text)
            if m:
                mem[m.group(1)] += 1
            if m and m.group(1) == "LDG.E.128" and 2 * ops["HMMA"] <= mma_total:
                loads_early += 1
    return {"registers": int(regs), "spill_bytes": int(stack), "loop_instructions": size,
            "branch_skips": skips, "barriers": ops["BAR"],
            "stall_cycles": sum(stall[a] for a, _ in code if lo <= a <= hi),
            "mma": ops["HMMA"], "top_ops": ops.most_common(8),
            "memory_ops": dict(mem.most_common(6)), "loads_before_pv": loads_early}


def main(argv: list[str]) -> int:
    paged = "--contiguous" not in argv
    separate = "--separate" in argv
    argv = [a for a in argv if a not in ("--contiguous", "--separate")]
    for spec in argv or DEFAULTS:
        parts = spec.split(":")
        if len(parts) not in (5, 6, 7):
            raise SystemExit(
                f"bad spec {spec!r}: want K:V:MODE:BLOCK_N:WARPS[:STAGES[:TABLE_READ]]")
        k_type, v_type, mode = parts[:3]
        block_n, warps = int(parts[3]), int(parts[4])
        stages = int(parts[5]) if len(parts) >= 6 else 2
        table = _common.table_read_fields(parts[6] if len(parts) == 7 else "row")
        cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                           min_partition=max(128, block_n), quant_dot=mode,
                           maxnreg=int(os.environ["MAXNREG"]) if "MAXNREG" in os.environ else None,
                           **table)
        st = loop_stats(compile_decode(k_type, v_type, cfg, paged, separate))
        per_thread = block_n * D * 2 // (32 * warps)
        print(f"{spec}: {st['registers']} regs, {st['spill_bytes']} B spilled, loop "
              f"{st['loop_instructions']} instructions ({st['mma']} MMAs) for {per_thread} K+V "
              "values/thread")
        print(f"    ops {st['top_ops']}")
        print(f"    memory {st['memory_ops']}")
        print(f"    16-byte global loads before the O^T MMAs: {st['loads_before_pv']}")
        print(f"    stall cycles scheduled in the loop (control codes): {st['stall_cycles']}")
        print(f"    barriers {st['barriers']}; forward branches in the loop skip "
              f"{st['branch_skips']} instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
