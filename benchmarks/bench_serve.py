"""The serving benchmark as a script: ``python benchmarks/bench_serve.py [flags]`` is
``pagedserve bench serve [flags]`` (see ``pagedserve/commands/bench.py``)."""

from __future__ import annotations

import sys

from pagedserve.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "serve", *sys.argv[1:]]))
