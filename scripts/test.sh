#!/usr/bin/env bash
# Quick start, command 2: set up .venv, lint, type-check, and run the whole test suite.
# The Triton kernels run under the interpreter on the CPU. pytest's exit code 5
# ("no tests collected") is a failure here, like any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check pagedserve tests benchmarks
.venv/bin/mypy  # the package, as [tool.mypy] in pyproject.toml configures it
export TRITON_INTERPRET=1
export PYTHONHASHSEED=0
.venv/bin/python -m pytest -q "$@"
