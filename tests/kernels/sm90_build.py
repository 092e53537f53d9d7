"""Build a Triton kernel for sm_90 offline (no GPU), read what the build holds, and run a
build script from a test.

The build scripts (``prefill_compile.py``, ``fp8_compile.py``) print one JSON line per
launch; tests run them in a child process (``run_build_script``) without
``TRITON_INTERPRET``, under which ``triton.jit`` functions cannot be compiled.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def build(kernel: Any, types: dict[str, str], const: dict[str, Any], divisible: set[str],
          num_warps: int, num_stages: int) -> Any:
    """``kernel`` compiled for sm_90. ``types``: the Triton type of each runtime argument
    (``i32`` where left out); ``const``: the constexprs; ``divisible``: the arguments
    Triton's launch would specialize as multiples of 16 (16-byte aligned pointers, or
    integers such as the 27B shapes' strides)."""
    names = kernel.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in const:
            signature[name] = "constexpr"
            continue
        signature[name] = types.get(name, "i32")
        if name in divisible:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def resources(compiled: Any) -> dict[str, int]:
    """Registers per thread, spilled bytes (``cuobjdump -res-usage``) and shared memory."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    assert found, usage
    return {"registers": int(found.group(1)), "spilled_bytes": int(found.group(2)),
            "shared_bytes": compiled.metadata.shared}


def run_build_script(script: Path, launch: str) -> dict[str, Any]:
    """The JSON line a build script prints for ``launch``, run without
    ``TRITON_INTERPRET``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(script.parents[2]), str(script.parent),
                                         env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(script), launch], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])
