"""Compile the FP8 decode kernel (``fp8_gemv``) for sm_90 offline (no GPU) and print what
its code holds.

    python tests/kernels/fp8_compile.py FORM:BLOCK_M:SPLIT ...

prints one JSON line per launch (the launch rule's tile, warps and stages for the form):
registers, spilled bytes, shared memory, the Hopper tensor-core MMAs (``wgmma``) by
operand type, the e4m3 -> 16-bit conversions (the weight-only forms' widening) and the
asynchronous global -> shared copies. Run without ``TRITON_INTERPRET`` (``sm90_build``).
"""

from __future__ import annotations

import json
import re
import sys

from sm90_build import build, resources

from pagedserve.kernels import fp8_gemv
from pagedserve.quant import fp8

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32", "srow_ptr": "*i32",
            "out_ptr": "*bf16", "part_ptr": "*fp32", "counter_ptr": "*i32"}
# Integers that are multiples of 16 at every 27B-shape projection, which Triton's launch
# specializes as such (N, K and the row strides: 5120, 6144, 17408, ...).
MULTIPLES_OF_16 = {"N", "K", "stride_xm", "stride_wn", "stride_om"}


def compile_launch(form: str, block_m: int, split: bool) -> dict:
    # The rule's launch for the form (the 27B down projection on 132 SMs): one row for
    # fma, ``block_m`` rows for the others.
    config = fp8_gemv.launch_config(1 if form == "fma" else block_m, 5120, 17408, 132,
                                    w8a8=form == "e4m3")
    assert config.form == form and config.block_m == block_m, config
    const = dict(BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK=fp8.BLOCK, SPLIT=split,
                 ROW_MAP=False, NATIVE=True, IEEE=False, FORM=fp8_gemv.FORMS[form])
    compiled = build(fp8_gemv._gemv_kernel, POINTERS, const, set(POINTERS) | MULTIPLES_OF_16,
                     config.num_warps, config.num_stages)
    ptx = compiled.asm["ptx"]
    return {"launch": f"{form}:{block_m}:{int(split)}", **resources(compiled),
            "wgmma_e4m3": len(re.findall(r"wgmma\.mma_async\S*\.e4m3\.e4m3", ptx)),
            "wgmma_16bit": len(re.findall(r"wgmma\.mma_async\S*\.bf16\.bf16", ptx)),
            "widening_cvt": len(re.findall(r"cvt\.rn\.(?:f16x2|bf16x2)\.e4m3x2", ptx)),
            "async_copies": ptx.count("cp.async")}


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        form, block_m, split = spec.split(":")
        print(json.dumps(compile_launch(form, int(block_m), bool(int(split)))), flush=True)
