"""Where a kernel's warps stall, per SASS instruction, from Nsight Compute's PC sampling.

Summarizes the source page as ``gpu_run.sh ncu-source`` exports it::

    ncu --section SourceCounters --section WarpStateStats -o NAME python3 ...
    ncu --import NAME.ncu-rep --page source --csv --print-source sass > NAME.csv
    python benchmarks/tools/ncu_source.py NAME.csv [--top 25]

Prints the samples by stall reason over the whole kernel, the stall samples per opcode
for the reasons that dominate, and the instructions with the most samples. Two
summaries side by side (a paged and a contiguous launch) show where one loses time the
other does not (such as ``wait`` samples on the dequantization instructions of one
layout's loop).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys

REASONS = ("selected", "not_selected", "wait", "math", "long_sb", "short_sb", "barrier",
           "dispatch", "mio", "lg", "branch_resolving", "no_inst")
SAMPLES = "Warp Stall Sampling (All Samples)"


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read_source_page(path: str) -> list[dict[str, str]]:
    """The per-instruction rows of one kernel's exported source page."""
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    header = next(i for i, row in enumerate(rows) if row and row[0] == "Address")
    names = rows[header]
    return [dict(zip(names, row)) for row in rows[header + 1:] if len(row) == len(names)]


def opcode(source: str) -> str:
    m = re.match(r"\s*(@!?U?P\w+\s+)?([A-Z0-9_]+)", source)
    return m.group(2) if m else "?"


def summarize(rows: list[dict[str, str]], top: int) -> str:
    total = {r: sum(_number(x.get(f"stall_{r}", "0")) for x in rows) for r in REASONS}
    out = [f"samples {sum(_number(x[SAMPLES]) for x in rows):.0f}, instructions executed "
           f"{sum(_number(x['Instructions Executed']) for x in rows):.0f}",
           "  by reason: " + "  ".join(f"{r}={v:.0f}" for r, v in total.items() if v)]
    for reason in ("wait", "long_sb", "math"):
        by_op = collections.Counter()
        for x in rows:
            by_op[opcode(x["Source"])] += _number(x.get(f"stall_{reason}", "0"))
        out.append(f"  {reason} by opcode: " + ", ".join(
            f"{op} {v:.0f}" for op, v in by_op.most_common(8) if v))
    out.append(f"  top {top} instructions (samples, the three largest reasons):")
    for x in sorted(rows, key=lambda x: -_number(x[SAMPLES]))[:top]:
        why = sorted(((_number(x.get(f"stall_{r}", "0")), r) for r in REASONS), reverse=True)
        out.append(f"    {_number(x[SAMPLES]):6.0f}  {x['Source'][:58]:58s} "
                   + " ".join(f"{r}={v:.0f}" for v, r in why[:3] if v))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args(argv)
    for path in args.csv:
        print(f"== {path}")
        print(summarize(read_source_page(path), args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
