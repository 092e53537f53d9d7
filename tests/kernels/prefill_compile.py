"""Compile the paged prefill kernel for sm_90 offline (no GPU) and print its resources.

    python tests/kernels/prefill_compile.py K_TYPE:V_TYPE:HEAD_DIM:GROUP ...

prints one JSON line per launch: registers, spilled bytes, shared memory, and the count of
Hopper tensor-core MMAs (``wgmma``) in the PTX. Run without ``TRITON_INTERPRET``
(``sm90_build``).
"""

from __future__ import annotations

import json
import sys

from sm90_build import build, resources

from pagedserve.kernels import paged_prefill

POINTER_TYPES = {"f16": "*fp16", "bf16": "*bf16", "q8_0": "*i8", "q4_0": "*u8"}


def compile_launch(k_type: str, v_type: str, head_dim: int, group: int,
                   num_kv_heads: int = 4, block_size: int = 16) -> dict:
    block_m, block_n, warps, stages = paged_prefill.launch_config(head_dim, group)
    interleave = 2 if k_type == v_type else 1
    const = dict(HKV=num_kv_heads, G=group, D=head_dim, BS=block_size,
                 ROWS_PER_HEAD=interleave * block_size,
                 K_TYPE=paged_prefill.TYPE_CODES[k_type],
                 V_TYPE=paged_prefill.TYPE_CODES[v_type], BLOCK_M=block_m, BLOCK_N=block_n,
                 NATIVE=True, SPLIT=False)
    scales = {t: "*fp16" if t.startswith("q") else POINTER_TYPES[t] for t in (k_type, v_type)}
    pointers = {"q_ptr": "*bf16", "o_ptr": "*bf16", "part_acc_ptr": "*fp32",
                "part_ml_ptr": "*fp32", "k_ptr": POINTER_TYPES[k_type],
                "ks_ptr": scales[k_type], "v_ptr": POINTER_TYPES[v_type],
                "vs_ptr": scales[v_type], "tables_ptr": "*i32", "qsl_ptr": "*i32",
                "seq_lens_ptr": "*i32"}
    compiled = build(paged_prefill._paged_prefill_kernel, {**pointers, "qk_scale": "fp32"},
                     const, set(pointers), warps, stages)
    return {"launch": f"{k_type}:{v_type}:{head_dim}:{group}", **resources(compiled),
            "wgmma": compiled.asm["ptx"].count("wgmma.mma_async")}


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        k, v, d, g = spec.split(":")
        print(json.dumps(compile_launch(k, v, int(d), int(g))), flush=True)
