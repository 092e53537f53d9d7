"""What-ifs on the Gluon decode kernels' compiled loop, through Triton's ``ir_override``.

``probe_decode --ptx-warp-barriers``: the f16 ring's tile loop (``float_fragments``) with
its CTA barriers turned into warp barriers. Each warp copies and reads only its own ring
slots, so a warp barrier orders what the loop needs; Gluon's barrier analysis puts two
CTA barriers in every tile, which hold the four warps together. The q4_0 / q8_0 kernel
(``quant_fragments``) is routed the same way: its register design has no barrier in the
loop (nothing changes); its shared-memory ring (the library's launch since d8fb4b4) has
three, and its warps too copy and read only their own rows (slower with warp barriers:
docs/benchmarks/logs/probes/2582e1a_ring_ids_ab.log).

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


class _EditedKernel:
    """Stands in for a Gluon kernel object: ``kernel[grid](*args, **kwargs)`` compiles
    each variant once as usual, edits its PTX with ``edit``, and from then on launches
    it from the edited PTX. The library's ``launch`` functions look their kernel up in
    their module at call time, so replacing the module attribute routes them here with
    their own arguments."""

    def __init__(self, kernel, edit) -> None:
        self.kernel, self.edit = kernel, edit
        self.out_dir = tempfile.mkdtemp(prefix="ptx_edit_")
        self.paths: dict = {}

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
            if key not in self.paths:
                compiled = self.kernel[grid](*args, **kwargs)
                ptx, what = self.edit(compiled.asm["ptx"])
                self.paths[key] = os.path.join(self.out_dir, f"variant_{len(self.paths)}.ptx")
                Path(self.paths[key]).write_text(ptx)
                print(f"ptx-edit: {what} ({self.paths[key]})", flush=True)
            self.kernel[grid](*args, **kwargs, ir_override=self.paths[key])
        return call


def install_warp_barriers() -> None:
    """Both Gluon kernels through ``tile_loop_barriers_to_warp``."""
    float_fragments.float_fragment_kernel = _EditedKernel(
        float_fragments.float_fragment_kernel, tile_loop_barriers_to_warp)
    quant_fragments.fragment_decode_kernel = _EditedKernel(
        quant_fragments.fragment_decode_kernel, tile_loop_barriers_to_warp)


def install_quant_loop_barrier() -> None:
    """The q4_0 / q8_0 kernel through ``tile_loop_head_barrier``."""
    quant_fragments.fragment_decode_kernel = _EditedKernel(
        quant_fragments.fragment_decode_kernel, tile_loop_head_barrier)
