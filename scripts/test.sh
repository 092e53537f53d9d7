#!/usr/bin/env bash
# Quick start, command 2: set up .venv, lint, type-check, and run the whole test suite.
# The Triton kernels run under the interpreter on the CPU. pytest's exit code 5
# ("no tests collected") is a failure here, like any other non-zero code.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check pagedserve tests benchmarks
# The type check (about 40 s without its cache) runs beside the tests; either failing
# fails the run.
.venv/bin/mypy >.venv/mypy.log 2>&1 &  # the package, as [tool.mypy] in pyproject.toml says
mypy_pid=$!
export TRITON_INTERPRET=1
export PYTHONHASHSEED=0
status=0
.venv/bin/python -m pytest -q "$@" || status=$?
mypy_status=0
wait "$mypy_pid" || mypy_status=$?
cat .venv/mypy.log
[ "$mypy_status" -eq 0 ] || { echo "test.sh: mypy failed" >&2; exit "$mypy_status"; }
exit "$status"
