"""Host-side checks of the Gluon decode kernels, which run only on a GPU.

- How a launcher binds a kernel: replaced by ``LaunchRecorder``, ``kernel[grid](*args,
  **kwargs)`` records its call instead, and ``assert_binds_signature`` checks it against
  the kernel's own signature (each run-time argument once, in order, then every
  compile-time one by name).
- What a launch compiles to: ``compile_for_sm90`` runs ``benchmarks/tools/decode_sass.py``
  (Triton's bundled ptxas, an H100/H200 target, no GPU) and returns its loop statistics.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from pathlib import Path


class LaunchRecorder:
    """``recorder[grid](*args, **kwargs)`` keeps ``grid``, ``args`` and ``kwargs`` in
    ``seen``, and launches ``kernel`` with them when one is given."""

    def __init__(self, kernel=None) -> None:
        self.seen: dict = {}
        self.kernel = kernel

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            self.seen.update(grid=grid, args=args, kwargs=kwargs)
            if self.kernel is not None:
                return self.kernel[grid](*args, **kwargs)
        return call


def assert_binds_signature(seen: dict, arg_names: list[str], scale: float) -> int:
    """The recorded call passes the run-time arguments positionally, up to the first
    constexpr ``G`` (the softmax scale times log2(e) second to last, the trace pointer
    last), and every constexpr by name; returns the run-time argument count."""
    n = len(seen["args"])
    assert n == arg_names.index("G")
    assert seen["args"][n - 2] == scale * 1.4426950408889634
    assert set(seen["kwargs"]) - {"num_warps", "maxnreg"} == set(arg_names[n:])
    return n


@functools.cache
def compile_for_sm90(spec: str, paged: bool) -> dict:
    """Registers spilled, MMAs, loop instructions and the most frequent opcodes (``ops``),
    memory instructions, the 16-byte global loads issued before the ``O^T`` MMAs
    (``loads_before_pv``) and the stall cycles its control codes
    schedule (``stall_cycles``) of the tile loop of launch ``spec``
    (``decode_sass.py``'s ``K:V:MODE:BLOCK_N:WARPS[:STAGES[:TABLE_READ]]``), compiled
    offline. A subprocess without ``TRITON_INTERPRET``: under the interpreter, Triton
    functions cannot be compiled into a Gluon kernel. Cached per launch (several tests
    read the same compile; callers must not modify the dict)."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, str(root / "benchmarks" / "tools" / "decode_sass.py"), spec]
    if not paged:
        args.insert(2, "--contiguous")
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    return {
        "spill": int(re.search(r"(\d+) B spilled", lines[0]).group(1)),
        "mma": int(re.search(r"\((\d+) MMAs\)", lines[0]).group(1)),
        "instructions": int(re.search(r"loop (\d+) instructions", lines[0]).group(1)),
        "ops": dict(ast.literal_eval(lines[1].split("ops ", 1)[1])),
        "memory_ops": ast.literal_eval(lines[2].split("memory ", 1)[1]),
        "loads_before_pv": int(re.search(r"before the O\^T MMAs: (\d+)", lines[3]).group(1)),
        "stall_cycles": int(re.search(r"\(control codes\): (\d+)", lines[4]).group(1)),
    }
