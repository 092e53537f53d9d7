"""Compile the FP8 decode kernel (``fp8_gemv``) for sm_90 offline (no GPU) and print what
its code holds.

    python tests/kernels/fp8_compile.py FORM:BLOCK_M:SPLIT ...

prints one JSON line per launch: registers, spilled bytes, shared memory, the Hopper
tensor-core MMAs (``wgmma``) by operand type, the e4m3 -> 16-bit conversions (the
weight-only dot's widening) and the asynchronous global -> shared copies. Run without
``TRITON_INTERPRET``: under the interpreter ``triton.jit`` functions cannot be compiled.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagedserve.kernels import fp8_gemv
from pagedserve.quant import fp8

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "srow_ptr": "*i32",
            "out_ptr": "*bf16", "part_ptr": "*fp32", "counter_ptr": "*i32"}
# Integers that are multiples of 16 at every 27B-shape projection, which Triton's launch
# specializes as such (N, K and the row strides: 5120, 6144, 17408, ...).
MULTIPLES_OF_16 = {"N", "K", "stride_xm", "stride_wn", "stride_om"}


def compile_launch(form: str, block_m: int, split: bool) -> dict:
    config = fp8_gemv.GemvConfig(block_m, fp8_gemv.BLOCK_N, 2 if split else 1, form=form)
    if form == "fma":
        config = fp8_gemv.GemvConfig(block_m, fp8_gemv.BLOCK_N, config.splits,
                                     fp8_gemv.ONE_ROW_WARPS, form=form)
    kernel = fp8_gemv._gemv_kernel
    const = dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK=fp8.BLOCK, SPLIT=split,
                 ROW_MAP=False, NATIVE=True, IEEE=False, FORM=fp8_gemv.FORMS[form])
    names = kernel.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in POINTERS or name in MULTIPLES_OF_16:
            signature[name] = POINTERS.get(name, "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in const:
            signature[name] = "constexpr"
        else:
            signature[name] = "i32"
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": config.num_warps,
                                       "num_stages": config.num_stages})
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    regs, stack = re.search(r"REG:(\d+) STACK:(\d+)", usage).groups()
    ptx = compiled.asm["ptx"]
    return {"launch": f"{form}:{block_m}:{int(split)}", "registers": int(regs),
            "spilled_bytes": int(stack), "shared_bytes": compiled.metadata.shared,
            "wgmma_e4m3": len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
            "wgmma_16bit": len(re.findall(r"wgmma\.mma_async\S*\.bf16\.bf16", ptx)),
            "widening_cvt": len(re.findall(r"cvt\.rn\.(?:f16x2|bf16x2)\.e4m3x2", ptx)),
            "async_copies": ptx.count("cp.async") + ptx.count("cp.async.bulk")}


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        form, block_m, split = spec.split(":")
        print(json.dumps(compile_launch(form, int(block_m), bool(int(split)))), flush=True)
