"""The decode kernels' tile loops as compiled for the H200 (sm_90), checked on any machine.

A guard, not an oracle: correctness is the other kernel tests' business. What this pins
is the machine code behind the figures in ``docs/benchmarks``. Code outside a loop moves
it (a change to the merge alone has moved the q4_0 paged loop, and with it the H200's
paged / contiguous at 8 x 128K by 1.5%). So a change that moves a loop is measured on the
H200 before its new size is recorded here (``benchmarks/tools/ab_probe.sh`` against the
previous commit, then the full ``bench_attention.py`` run; docs/kernel-decisions.md).

Each library launch (``decode_plan.default_config``) is compiled for sm_90 by
``gluon_checks.compile_for_sm90`` (``benchmarks/tools/decode_sass.py``, Triton's own ptxas and
``cuobjdump``); no GPU is needed.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")
from gluon_checks import compile_for_sm90  # noqa: E402

from pagedserve.kernels.decode_plan import default_config  # noqa: E402

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
# SASS instructions of the tile loop, paged and contiguous (Triton 3.6.0's ptxas), of the
# kernels measured in docs/benchmarks/attention.md.
LOOP_INSTRUCTIONS = {
    "q4_0 wide": (1264, 1210),
    "q4_0": (1277, 1223),
    "q8_0 wide": (824, 790),
    "q8_0": (825, 791),
    "f16": (553, 540),
}


def launch_spec(kv_type: str, tokens: int, batch: int, paged: bool) -> str:
    """``decode_sass.py``'s spec of ``default_config``'s launch, checked to compile the
    same kernel (the spec fixes ``min_partition`` at ``max(128, block_n)``, no register
    cap; ``occupancy`` only sizes the grid)."""
    cfg = default_config(kv_type, kv_type, tokens, paged=paged, batch=batch)
    assert cfg.quant_dot == "fragment"  # the Gluon kernels, the library's GPU launches
    assert cfg.min_partition == max(128, cfg.block_n) and cfg.maxnreg is None
    table = cfg.table_read + ("" if cfg.table_ahead else "-now")
    return (f"{kv_type}:{kv_type}:{cfg.quant_dot}:{cfg.block_n}:{cfg.num_warps}:"
            f"{cfg.num_stages}:{table}")


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
@pytest.mark.parametrize("launch", sorted(LAUNCHES))
def test_tile_loop_is_the_measured_one(launch, paged):
    stats = compile_for_sm90(launch_spec(*LAUNCHES[launch], paged), paged)
    assert stats["spill"] == 0, f"{launch}: the tile loop's kernel spills"
    want = LOOP_INSTRUCTIONS[launch][0 if paged else 1]
    assert stats["instructions"] == want, (
        f"{launch} {'paged' if paged else 'contiguous'}: the tile loop is "
        f"{stats['instructions']} SASS instructions, measured at {want}; measure the "
        "change on an H200 before recording the new size (see this module's docstring)"
    )
