#!/usr/bin/env bash
# Quick start, command 1: set up .venv and serve the embedded default model.
# Extra arguments go to `pagedserve serve` (e.g. --port 8001).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
echo "serve.sh: starting pagedserve serve (the model loads and warms up before its" \
     "'pagedserve ready at' line)..." >&2
exec .venv/bin/pagedserve serve "$@"
