"""What-ifs on the Gluon decode kernels' compiled loop, through Triton's ``ir_override``.

``probe_decode --ptx-warp-barriers``: the f16 ring's tile loop (``float_fragments``) with
its CTA barriers turned into warp barriers. Each warp copies and reads only its own ring
slots, so a warp barrier orders what the loop needs; Gluon's barrier analysis puts two
CTA barriers in every tile, which hold the four warps together. The q4_0 / q8_0 kernel
(``quant_fragments``) is routed the same way: its register design has no barrier in the
loop (nothing changes), the shared-memory ring of
docs/benchmarks/logs/probes/03d82e1_quant_ring.patch has two, and its warps too copy and
read only their own rows.

``probe_decode --ptx-loop-barrier``: the q4_0 / q8_0 kernel (``quant_fragments``), which
has no barrier in its loop, with a CTA barrier at the head of each tile (the warps of a
program start each tile, and so issue its loads, together).

Each compiled variant is compiled once as usual, its PTX edited, and from then on
launched from the edited PTX. Probes, not the library's path (results:
docs/benchmarks/README.md, "Sixteenth session").
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from pagedserve.kernels import float_fragments, quant_fragments


def _tile_loop(lines: list[str]) -> tuple[int, int]:
    """First and last line of the PTX loop with the most ``mma.sync`` lines."""
    labels = {m.group(1): i for i, line in enumerate(lines)
              if (m := re.match(r"^(\$L__BB\d+_\d+):", line))}
    loops = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$L__BB\d+_\d+);", line)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            lo = labels[m.group(1)]
            loops.append((sum("mma.sync" in x for x in lines[lo:i]), lo, i))
    _, lo, hi = max(loops)
    return lo, hi


def tile_loop_barriers_to_warp(ptx: str) -> tuple[str, str]:
    """The PTX with the ``bar.sync 0`` lines of its tile loop made warp barriers."""
    lines = ptx.splitlines()
    lo, hi = _tile_loop(lines)
    changed = 0
    for i in range(lo, hi):
        if re.match(r"^\s*bar\.sync\s+0;", lines[i]):
            lines[i] = "\tbar.warp.sync \t-1;"
            changed += 1
    return "\n".join(lines) + "\n", f"{changed} loop barriers -> warp barriers"


def tile_loop_head_barrier(ptx: str) -> tuple[str, str]:
    """The PTX with a CTA barrier at the head of its tile loop."""
    lines = ptx.splitlines()
    lo, _ = _tile_loop(lines)
    lines.insert(lo + 1, "\tbar.sync \t0;")
    return "\n".join(lines) + "\n", "a CTA barrier at the tile loop's head"


def _edited_launcher(kernel, edit):
    """``run(grid, args, kwargs, num_warps, maxnreg)``: ``kernel`` launched from its PTX
    as ``edit`` leaves it, one edited file per compiled variant."""
    out_dir = tempfile.mkdtemp(prefix="ptx_edit_")
    paths: dict = {}

    def run(grid, args, kwargs, num_warps, maxnreg):
        key = (tuple(sorted((k, repr(v)) for k, v in kwargs.items())), num_warps, maxnreg)
        if key not in paths:
            compiled = kernel[grid](*args, **kwargs, num_warps=num_warps, maxnreg=maxnreg)
            ptx, what = edit(compiled.asm["ptx"])
            paths[key] = os.path.join(out_dir, f"variant_{len(paths)}.ptx")
            Path(paths[key]).write_text(ptx)
            print(f"ptx-edit: {what} ({paths[key]})", flush=True)
        kernel[grid](*args, **kwargs, num_warps=num_warps, maxnreg=maxnreg,
                     ir_override=paths[key])

    return run


def install_warp_barriers() -> None:
    """Route ``float_fragments.launch`` and ``quant_fragments.launch`` through
    ``tile_loop_barriers_to_warp``."""
    run = _edited_launcher(float_fragments.float_fragment_kernel, tile_loop_barriers_to_warp)

    def launch(grid, args, constants, num_warps, stages, maxnreg):
        kwargs = {k: constants[k] for k in float_fragments.SHARED_CONSTANTS}
        kwargs.update(float_fragments.kernel_constants(num_warps, stages))
        run(grid, args, kwargs, num_warps, maxnreg)

    float_fragments.launch = launch
    _route_quant(tile_loop_barriers_to_warp)


def install_quant_loop_barrier() -> None:
    """Route ``quant_fragments.launch`` through ``tile_loop_head_barrier``."""
    _route_quant(tile_loop_head_barrier)


def _route_quant(edit) -> None:
    run = _edited_launcher(quant_fragments.fragment_decode_kernel, edit)

    def launch(grid, args, constants, kv_type, num_warps, tokens_per_warp, maxnreg,
               *stages):  # the ring patch adds the stage count
        kwargs = {k: constants[k] for k in quant_fragments.SHARED_CONSTANTS}
        kwargs.update(quant_fragments.kernel_constants(kv_type, num_warps, tokens_per_warp,
                                                       *stages))
        run(grid, args, kwargs, num_warps, maxnreg)

    quant_fragments.launch = launch
