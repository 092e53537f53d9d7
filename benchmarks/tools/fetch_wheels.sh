#!/usr/bin/env bash
# Fills .whl/ with the wheels the GPU image lacks (Python 3.12, manylinux x86-64), from
# this machine's pip index; gpu_run.sh installs them there. .whl/ is git-ignored, so a
# fresh checkout needs this once before its first device call (carry [".whl"]).
#   bash benchmarks/tools/fetch_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl
# The server's stack (fastapi 0.165 imports opentelemetry-api), fla-core (GDN prefill) with
# einops, xgrammar with apache-tvm-ffi (structured outputs), gguf; pydantic needs
# typing-extensions >= 4.16, newer than the image's.
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux_2_28_x86_64 \
  fla-core einops fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core \
  annotated-types typing-inspection typing-extensions uvicorn==0.54.0 h11 \
  opentelemetry-api gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 \
  2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
ls .whl
