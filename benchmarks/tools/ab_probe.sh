#!/usr/bin/env bash
# A/B of two trees' decode launches in one device call (probe_decode.py, alternating).
#
# The working tree ("new") against a base tree ("base", the library at another commit),
# alternating, so that both see the same H200 instance and the same thermal and power
# state. Optionally held at the power cap (MIN_SECONDS 0.5), with nvidia-smi sampling
# clocks and power.
#
#   here:   git archive REV pagedserve benchmarks | (mkdir -p ab_base && tar -x -C ab_base)
#           echo ab_base/ >> .git/info/exclude     # never committed; carried instead
#   device: KV=q8_0 CASES="131072x8 ragged" MIN_SECONDS="0.05 0.5" ROUNDS=2 \
#             LAUNCHES="default fragment:128:4:3:128:-:2:block" \
#             bash benchmarks/gpu_run.sh ab-probe:300   # carry [".whl", "ab_base"]
#
# gpu_run.sh installs the wheels and runs this as its ab-probe stage. The base tree's
# probe_decode.py (benchmarks/tools/, or benchmarks/ in older trees) must take
# --min-seconds.
#
# Writes $OUT/ab_$KV.log (the probes' rows, each headed by tree, round and seconds) and
# $OUT/clocks_$KV.csv (time, SM clock, power, temperature, throttle reasons; 0x4 = power
# cap; every 100 ms).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BASE=${BASE:-ab_base}
SITE=${SITE:-/tmp/site}  # gpu_run.sh's wheels
[ -d "$BASE/pagedserve" ] || { echo "no base tree at $BASE (see the header)"; exit 2; }
KV=${KV:-q8_0}
CASES=${CASES:-"131072x8 65536x8 131072x4 ragged"}
ROUNDS=${ROUNDS:-2}
MIN_SECONDS=${MIN_SECONDS:-0.05}
LAUNCHES=${LAUNCHES:-default}  # probe_decode.py's --launch list, the same for both trees
nvidia-smi --format=csv,noheader -lms 100 \
  --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  > "$OUT/clocks_${KV}.csv" &
smi=$!
for round in $(seq "$ROUNDS"); do
  for secs in $MIN_SECONDS; do
    for tree in new base; do
      if [ "$tree" = new ]; then root=$PWD; else root=$PWD/$BASE; fi
      probe=$root/benchmarks/tools/probe_decode.py
      [ -f "$probe" ] || probe=$root/benchmarks/probe_decode.py
      echo "== round $round $tree min-seconds $secs $(date +%T.%N | cut -c1-12)"
      PYTHONPATH=$SITE:$root python3 "$probe" --kv-type "$KV" \
        --cases $CASES --launch $LAUNCHES --min-seconds "$secs" 2>&1 | grep -v Warning
    done
  done
done 2>&1 | tee -a "$OUT/ab_${KV}.log"
kill "$smi"
