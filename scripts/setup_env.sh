#!/usr/bin/env bash
# Creates (or reuses) .venv with everything pagedserve and its tests need, on the CPU.
# torch is named and pinned to the 2.13.0 CPU wheel that these machines keep on disk; any
# looser specifier could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY=$candidate; break; fi
  done
fi
[ -n "$PY" ] || { echo "setup_env: no python3 found" >&2; exit 1; }

stamp_src="$(cat pyproject.toml requirements/cpu-constraints.txt | sha256sum | cut -c1-16)"
if [ -f .venv/.stamp ] && [ "$(cat .venv/.stamp)" = "$stamp_src" ]; then
  exit 0
fi

say() { echo "setup_env: $*" >&2; }
say "setting up .venv with $PY (the first run installs torch and the test tools, ~1-2 min)..."
"$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
say "installing torch 2.13.0 (CPU), pagedserve and its dependencies..."
.venv/bin/python -m pip install -q -c requirements/cpu-constraints.txt torch==2.13.0 \
  -e '.[test,bench]'
echo "$stamp_src" > .venv/.stamp
say ".venv is ready"
