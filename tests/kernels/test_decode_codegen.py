"""The decode kernels' tile loops as compiled for the H200 (sm_90), checked on any machine.

A guard, not an oracle: correctness is the other kernel tests' business. What this pins
is the machine code behind the figures in ``docs/benchmarks``. Code outside a loop moves
it: a change to the merge only made the q4_0 paged loop 1289 instructions instead of
1277, and in the same H200 call q4_0's paged / contiguous at 8 x 128K read 0.957-0.959
against 0.972-0.974 (docs/benchmarks/README.md, "Twenty-second session"; the merge
itself was not ruled out as the cause). So a change that moves a loop is measured on the
H200 before its new size is recorded here (``benchmarks/ab_probe.sh`` against the
previous commit, then the full ``bench_attention.py`` run).

Triton compiles each library launch (``decode_plan.default_config``) for
``GPUTarget("cuda", 90, 32)`` and its wheel's ``cuobjdump`` disassembles it
(``benchmarks/decode_sass.py``); no GPU is needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[2]

# The sizes below come from this release's ptxas; another compiler schedules differently.
RECORDED_WITH = "3.6.0"
pytestmark = pytest.mark.skipif(
    triton.__version__ != RECORDED_WITH,
    reason=f"loop sizes recorded with Triton {RECORDED_WITH}, not {triton.__version__}")

# (K/V type, table tokens, batch) -> the launch default_config picks for it: the wide
# one-program-per-SM launch for a short small batch, the two-programs-per-SM one above.
LAUNCHES = {
    "q4_0 wide": ("q4_0", 1 << 14, 1),
    "q4_0": ("q4_0", 1 << 20, 8),
    "q8_0 wide": ("q8_0", 1 << 14, 1),
    "q8_0": ("q8_0", 1 << 20, 8),
    "f16": ("f16", 1 << 20, 8),
}
# SASS instructions of the tile loop, paged and contiguous (Triton 3.6.0's ptxas), as
# measured on the H200 in docs/benchmarks/attention.md (kernels of 3e5d8e8).
LOOP_INSTRUCTIONS = {
    "q4_0 wide": (1264, 1210),
    "q4_0": (1277, 1223),
    "q8_0 wide": (824, 790),
    "q8_0": (824, 791),
    "f16": (559, 540),
}


# Compiles in a child process: under TRITON_INTERPRET=1 (the suite's setting) the kernels
# are interpreter objects, which Triton cannot compile for a GPU.
_COMPILE_ALL = """
import json, sys
sys.path.insert(0, "benchmarks")
import decode_sass
from pagedserve.kernels.decode_plan import default_config
out = {}
for name, (kv, tokens, batch) in json.loads(sys.argv[1]).items():
    for paged in (True, False):
        cfg = default_config(kv, kv, tokens, paged=paged, batch=batch)
        st = decode_sass.loop_stats(decode_sass.compile_decode(kv, kv, cfg, paged))
        out[f"{name}|{paged}"] = dict(mode=cfg.quant_dot, spill=st["spill_bytes"],
                                      loop=st["loop_instructions"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_ALL, json.dumps(LAUNCHES)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_tile_loop_is_the_measured_one(compiled, launch, paged):
    stats = compiled[f"{launch}|{paged}"]
    assert stats["mode"] == "fragment"  # the Gluon kernels, the library's GPU launches
    assert stats["spill"] == 0, f"{launch}: the tile loop's kernel spills"
    want = LOOP_INSTRUCTIONS[launch][0 if paged else 1]
    assert stats["loop"] == want, (
        f"{launch} {'paged' if paged else 'contiguous'}: the tile loop is {stats['loop']} "
        f"SASS instructions, measured at {want}; measure the change on an H200 before "
        "recording the new size (see this module's docstring)"
    )
