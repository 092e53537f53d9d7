#!/usr/bin/env bash
# Everything the H200 runs, in named stages, in one call of the device tool:
#   bash benchmarks/gpu_run.sh STAGE:SECONDS [STAGE:SECONDS ...]
# Stages: tests-gpu (every test that runs on the GPU, in parallel: the one to run before
#           calling kernel work done; about 600 s) tests-gpu-engine (its engine, model and
#           FP8 part) tests-kernels (or tests-kernels-grid +
#           tests-kernels-small) tests-packed
#         tests-fragment (the Gluon q4_0 / q8_0 kernel's GPU tests) tests-triton (the rest)
#         tests-select (pytest $TEST_ARGS)
#         tests-graph tests-gdn tests-engine tests-model bench-attention (library defaults)
#         bench-attention-sweep bench-attention-quick
#         profile-engine ncu-decode ncu-source bench-model bench-engine bench-serve
#         bench-structured bench-chaos bench-prefix probe-decode
#         trace-decode probe-pieces ab-probe tests-fp8 bench-fp8 bench-fp8-engine
#         probe-scaled-mm probe-quantize probe-cudnn probe-elementwise tests-spec-gpu bench-spec bench-spec-e2e profile-spec
#         spec-default-model
#         bench-tp (2 GPUs)
#         train-default-model (issue 38; carry .corpus as well as .whl).
# Each stage has its own time limit, logs to $OUT/<stage>.log, and a one-line status goes
# to the summary printed last. probe-decode runs benchmarks/tools/probe_decode.py with the
# arguments in $PROBE_ARGS (e.g. PROBE_ARGS="--kv-type q8_0 --cases ragged --launch default"),
# once per '|'-separated list.
# Needs: wheels in .whl/ (fla-core, xgrammar + apache-tvm-ffi, and the server's
# fastapi/uvicorn/pydantic stack, which the GPU image lacks; benchmarks/tools/
# fetch_wheels.sh fills it), PAGEDSERVE_COMMIT set by the
# caller (the tree travels without .git). The device takes at most 64 MiB with the 40 MB
# default checkpoint in the tree: .whl/ holds only what the image lacks (matplotlib is
# there; the openai/anthropic clients are not needed), about 12 MB.
# Optional: .triton-cache.tar from an earlier call's $OUT (carry it with .whl).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
  .whl/*.whl >/dev/null || { echo "wheel install failed (fill .whl/ with" \
  "benchmarks/tools/fetch_wheels.sh and carry it)"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# Triton's cache (compiled kernels and autotune results, fla's included) can travel between
# calls: a carried .triton-cache.tar is unpacked here, and the cache is packed back into
# $OUT at the end (bring it home and carry it next time). Optional: nothing fails without it.
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
[ -f .triton-cache.tar ] && tar -xf .triton-cache.tar -C "$TRITON_CACHE_DIR" 2>/dev/null
pack_triton_cache() {
  tar -cf "$OUT/triton-cache.tar" -C "$TRITON_CACHE_DIR" . 2>/dev/null || true
  local size; size=$(stat -c %s "$OUT/triton-cache.tar" 2>/dev/null || echo 0)
  # Over the 16 MB a returned file may have: keep only the autotune results.
  if [ "$size" -gt 16000000 ]; then
    (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar -cf "$OUT/triton-cache.tar" -T -) \
      2>/dev/null || rm -f "$OUT/triton-cache.tar"
  fi
}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
summary=()
run_stage() {
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  # SIGINT first: pytest then prints its summary (the failures' names) before it stops.
  timeout -s INT -k 20 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-16s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) \
    "$(grep -E 'passed|failed|error' "$OUT/$name.log" | tail -1 | cut -c1-90)")")
  tail -n 25 "$OUT/$name.log"
}
PYTEST="python3 -m pytest -q -p no:cacheprovider -rs -x --tb=short"
# Nsight Compute on the third decode-kernel launch of benchmarks/tools/ncu_decode.py (ncu stages).
NCU_KERNEL=(--clock-control none --kernel-name "regex:decode_kernel|float_fragment_kernel"
            --launch-skip 2 --launch-count 1)
for spec in "$@"; do
  stage=${spec%%:*}; limit=${spec##*:}
  echo "=== $stage (limit ${limit}s)"
  case $stage in
    # All of tests/kernels (the decode grid at real sizes, and the interpreter files, which
    # run their Triton cases on CUDA here) with the engine's and the model's GPU tests:
    # 160 gpu-marked tests and 327 others. pytest-xdist (in the GPU image) runs 8 workers
    # on the one GPU, so that Triton's compiles overlap: about 430 s for the decode grid
    # with the kv_write, interpreter-decode, GDN, engine and model files and 120 s for the
    # rest of tests/kernels (one process takes more than 360 s for the decode grid alone).
    # -vv (over $PYTEST's -q) names each test as it ends, so a stage cut short by its limit
    # still shows them.
    tests-gpu)     run_stage "$stage" "$limit" $PYTEST -n 8 -vv --maxfail=1000 tests/kernels \
                     tests/engine/test_engine_gpu.py tests/engine/test_prefill_graphs_gpu.py \
                     tests/engine/test_structured_gpu.py tests/engine/test_speculative_gpu.py \
                     tests/engine/test_draft_graphs_gpu.py tests/engine/test_verify_graphs_gpu.py \
                     tests/model/test_gpu.py tests/model/test_fp8_gpu.py ;;
    # The engine's, the model's and the FP8 kernels' GPU tests alone (about 400 s): the
    # part of tests-gpu that changes most often.
    tests-gpu-engine) run_stage "$stage" "$limit" $PYTEST -n 6 -vv --maxfail=100 \
                     tests/engine/test_engine_gpu.py tests/engine/test_prefill_graphs_gpu.py \
                     tests/engine/test_structured_gpu.py tests/engine/test_speculative_gpu.py \
                     tests/engine/test_draft_graphs_gpu.py tests/engine/test_verify_graphs_gpu.py \
                     tests/model/test_gpu.py tests/model/test_fp8_gpu.py \
                     tests/kernels/test_fp8_linear_gpu.py ;;
    # Speculative decoding's GPU tests alone (issue 39): verify, rollback and draft graphs
    # against eager and plain decoding, the row-walking delta rule, no compile after warm-up.
    tests-spec-gpu) run_stage "$stage" "$limit" $PYTEST -n 4 -vv --maxfail=50 \
                     tests/engine/test_verify_graphs_gpu.py tests/engine/test_draft_graphs_gpu.py \
                     tests/engine/test_speculative_gpu.py tests/kernels/test_gdn_triton.py ;;
    tests-kernels) run_stage "$stage" "$limit" $PYTEST tests/kernels/test_paged_decode_gpu.py \
                     tests/kernels/test_kv_write.py tests/kernels/test_paged_decode.py ;;
    # The same, in two parts (most of their time is Triton compiling each configuration
    # once). With a cold compile cache the grid alone takes more than 370 s: give it a call
    # of its own, or run tests-fragment and tests-triton (its two halves) in separate calls.
    tests-kernels-grid) run_stage "$stage" "$limit" $PYTEST tests/kernels/test_paged_decode_gpu.py ;;
    tests-kernels-small) run_stage "$stage" "$limit" $PYTEST tests/kernels/test_kv_write.py \
                     tests/kernels/test_paged_decode.py ;;
    tests-packed)  run_stage "$stage" "$limit" $PYTEST tests/kernels/test_paged_decode_gpu.py \
                     -k "quant_dot_modes or packed" ;;
    tests-fragment) run_stage "$stage" "$limit" $PYTEST tests/kernels/test_paged_decode_gpu.py \
                     -k "fragment" ;;
    tests-triton)  run_stage "$stage" "$limit" $PYTEST tests/kernels/test_paged_decode_gpu.py \
                     -k "not fragment" ;;
    # Any pytest selection: $TEST_ARGS holds its arguments (paths, -k EXPR).
    tests-select)  run_stage "$stage" "$limit" bash -c "$PYTEST $TEST_ARGS" ;;
    tests-trace)   run_stage "$stage" "$limit" $PYTEST tests/kernels/test_paged_decode_gpu.py \
                     -k "trace" ;;
    tests-graph)   run_stage "$stage" "$limit" $PYTEST \
                     tests/kernels/test_paged_decode_gpu.py::test_cuda_graph_capture_and_replay ;;
    tests-gdn)     run_stage "$stage" "$limit" $PYTEST tests/kernels/test_gdn_triton.py ;;
    tests-engine)  run_stage "$stage" "$limit" $PYTEST tests/engine/test_engine_gpu.py \
                     tests/engine/test_structured_gpu.py ;;
    tests-model)   run_stage "$stage" "$limit" $PYTEST tests/model/test_gpu.py -s ;;
    bench-attention) run_stage "$stage" "$limit" python3 benchmarks/bench_attention.py --out "$OUT" ;;
    bench-attention-sweep) run_stage "$stage" "$limit" python3 benchmarks/bench_attention.py --sweep --out "$OUT" ;;
    bench-attention-quick) run_stage "$stage" "$limit" python3 benchmarks/bench_attention.py --quick --out "$OUT" ;;
    profile-engine) run_stage "$stage" "$limit" python3 benchmarks/tools/profile_engine.py --out "$OUT" ;;
    # Nsight Compute on the decode kernel: the ragged case per K/V type, and f16 at one 4K
    # sequence (the latency-bound corner where SDPA is faster).
    # $NCU_CASES: TYPE:LENS[:LAYOUT] each (LENS ragged or comma-separated; LAYOUT paged or
    # contiguous), default the ragged case of each type and one 4K f16 sequence.
    # Stall reasons: warps stalled per issued instruction, by reason. $NCU_ARGS: more
    # ncu_decode.py arguments for every case (--launch, --window, --block-size).
    ncu-decode)    NCU_STALLS=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' \
                     long_scoreboard short_scoreboard math_pipe_throttle mio_throttle wait \
                     not_selected selected barrier lg_throttle dispatch_stall no_instruction \
                     branch_resolving membar misc tex_throttle drain)
                   NCU_STALLS=${NCU_STALLS%,}
                   for case in ${NCU_CASES:-q4_0:ragged q8_0:ragged f16:ragged f16:4096}; do
                     IFS=: read -r kv lens layout <<< "$case"
                     run_stage "ncu-$kv-${lens//,/_}-${layout:-paged}" "$limit" ncu \
                       "${NCU_KERNEL[@]}" --section SpeedOfLight --section Occupancy --section LaunchStats \
                       --section WarpStateStats --section SchedulerStats \
                       --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
                       --metrics "dram__bytes_read.sum,lts__t_sectors_srcunit_tex_op_read.sum,$NCU_STALLS" \
                       python3 benchmarks/tools/ncu_decode.py --kv-type "$kv" --lens "$lens" \
                       --layout "${layout:-paged}" ${NCU_ARGS:-}
                   done ;;
    # PC sampling of the same cases (and $NCU_ARGS): stall samples per SASS instruction,
    # summarized by benchmarks/tools/ncu_source.py into $OUT/ncu-source-<case>.log.
    ncu-source)    for case in ${NCU_CASES:-q4_0:ragged:paged q4_0:ragged:contiguous}; do
                     IFS=: read -r kv lens layout <<< "$case"
                     name="ncu-source-$kv-${lens//,/_}-${layout:-paged}"
                     ncu "${NCU_KERNEL[@]}" --section SourceCounters --section WarpStateStats \
                       -f -o "/tmp/$name" \
                       python3 benchmarks/tools/ncu_decode.py --kv-type "$kv" --lens "$lens" \
                       --layout "${layout:-paged}" ${NCU_ARGS:-} > "/tmp/$name.run.log" 2>&1
                     ncu --import "/tmp/$name.ncu-rep" --page source --csv --print-source sass \
                       > "/tmp/$name.csv"
                     run_stage "$name" "$limit" python3 benchmarks/tools/ncu_source.py "/tmp/$name.csv"
                   done ;;
    # PROBE_ARGS may hold several argument lists separated by '|': one probe each.
    probe-decode)  IFS='|' read -ra probes <<< "${PROBE_ARGS:-}"
                   for i in "${!probes[@]}"; do
                     run_stage "probe-decode-$i" "$limit" python3 benchmarks/tools/probe_decode.py ${probes[$i]}
                   done ;;
    # Per-program timelines of the fragment kernel (benchmarks/tools/trace_decode.py); $TRACE_ARGS
    # may hold several argument lists separated by '|'.
    trace-decode)  IFS='|' read -ra traces <<< "${TRACE_ARGS:-}"
                   for i in "${!traces[@]}"; do
                     run_stage "trace-decode-$i" "$limit" python3 benchmarks/tools/trace_decode.py \
                       ${traces[$i]} --out "$OUT/trace-$i"
                   done ;;
    # The working tree against another commit's tree (ab_base/, carried), probe_decode
    # alternating between them (benchmarks/tools/ab_probe.sh; $KV $CASES $ROUNDS $MIN_SECONDS).
    ab-probe)      run_stage "$stage" "$limit" bash benchmarks/tools/ab_probe.sh ;;
    # Random pieces against one run, memory only (benchmarks/tools/probe_pieces.py); $PIECES_ARGS
    # are its arguments (default: its own cases and block sizes).
    # The compiled elementwise ops, token dim dynamic against every dim (issue 34).
    probe-elementwise) run_stage "$stage" "$limit" python3 benchmarks/tools/probe_elementwise.py \
                     ${ELEMENTWISE_ARGS:-} ;;
    probe-pieces)  run_stage "$stage" "$limit" python3 benchmarks/tools/probe_pieces.py ${PIECES_ARGS:-} ;;
    tests-prefill) run_stage "$stage" "$limit" $PYTEST -n 8 tests/kernels/test_paged_prefill.py ;;
    # $PREFILL_ARGS: more bench_prefill.py arguments (--parts, --lengths, --configs).
    bench-prefill) run_stage "$stage" "$limit" python3 benchmarks/bench_prefill.py \
                     ${PREFILL_ARGS:-} --out "$OUT" ;;
    # The FP8 linear kernels (issue 37): their GPU tests (27B shapes against the float64
    # oracle, CUDA-graph replay) and their interpreter tests run on CUDA.
    tests-fp8)     run_stage "$stage" "$limit" $PYTEST tests/kernels/test_fp8_linear_gpu.py \
                     tests/kernels/test_fp8_linear.py ;;
    # FP8 against bf16 on the 27B shape's linear layers: decode step, 8K-row prefill, the
    # weight-only / w8a8 crossover. $FP8_ARGS: more bench_fp8.py arguments (--parts,
    # --decode-rows, --gemv-sweep "64/4/4/0;128/4/3/0", --gemm-sweep "128/128/8/8/3;...").
    bench-fp8)     run_stage "$stage" "$limit" python3 benchmarks/bench_fp8.py \
                     ${FP8_ARGS:-} --out "$OUT" ;;
    # FP8 against bf16 weights through the engine: decode at 1 / 8 / 16 users, 8K prefill.
    # $FP8_ENGINE_ARGS: more bench_fp8_engine.py arguments (--sides bf16 fp8 fp8_w8a8_decode:
    # a third side with the decode kernel's e4m3 form on from 2 rows).
    bench-fp8-engine) run_stage "$stage" "$limit" python3 benchmarks/bench_fp8_engine.py \
                     ${FP8_ENGINE_ARGS:-} --out "$OUT" ;;
    # cuDNN's fused attention for long prefill chunks against the paged kernel and flash
    # (issue 34). $CUDNN_ARGS: more probe arguments (--cases NxCTX,... timed; --check
    # NxCTX,... the method's own calls against float64 instead, per part).
    # Run twice: torch's plan per exact shape, then its power-of-two buckets
    # (TORCH_CUDNN_SDPA_AVOID_RECOMPILE, read once per process).
    probe-cudnn)   run_stage "$stage" "$limit" python3 benchmarks/tools/probe_cudnn_attention.py \
                     ${CUDNN_ARGS:-}
                   TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 run_stage "$stage-ragged" "$limit" python3 \
                     benchmarks/tools/probe_cudnn_attention.py ${CUDNN_ARGS:-} ;;
    # Which scale layouts torch._scaled_mm's block-scaled FP8 GEMM reads (issue 37).
    probe-scaled-mm) run_stage "$stage" "$limit" python3 benchmarks/tools/probe_scaled_mm.py ;;
    # The FP8 prefill's activation quantization launches at 8192 rows ($QUANT_ARGS).
    probe-quantize) run_stage "$stage" "$limit" python3 benchmarks/tools/probe_quantize.py \
                     ${QUANT_ARGS:-} ;;
    bench-model)   run_stage "$stage" "$limit" python3 benchmarks/bench_model.py --quick ;;
    bench-engine)  run_stage "$stage" "$limit" python3 benchmarks/bench_engine.py --steps 20 --warmup 2 --out "$OUT" ;;
    # A grammar's cost per decode step at batch 8 on the 27B shape (needs xgrammar and
    # apache-tvm-ffi among the carried wheels).
    # Speculative decoding's cost side (issue 39): verify and draft steps against a plain
    # decode step at batch 1, 8 and 16 with 8K contexts, 27B shape (about 200 s).
    bench-spec)    run_stage "$stage" "$limit" python3 benchmarks/bench_spec.py --out "$OUT" ;;
    # Its end-to-end side: LLMEngine tok/s at acceptance imposed at the verify decision,
    # k = 1..4, a = 0.5 / 0.7 / 0.9, batch 1 and 8, against plain decoding (13 engines on
    # one loaded model). $SPEC_E2E_ARGS: more bench_spec_e2e.py arguments.
    bench-spec-e2e) run_stage "$stage" "$limit" python3 benchmarks/bench_spec_e2e.py \
                     ${SPEC_E2E_ARGS:-} --out "$OUT" ;;
    # Real acceptance (issue 39): the trained default model's MTP head at batch 1, bf16.
    spec-default-model) run_stage "$stage" "$limit" python3 scripts/default_model/measure.py \
                     pagedserve/model/default_checkpoint --device cuda ${MEASURE_ARGS:-} ;;
    # Wall time per phase of a speculative step (issue 39). $PROFILE_SPEC_ARGS: --batch, --k.
    profile-spec)  run_stage "$stage" "$limit" python3 benchmarks/tools/profile_spec.py \
                     ${PROFILE_SPEC_ARGS:-} ;;
    # Tensor parallelism (issue 40): TP=2 against TP=1 on the 27B shape, batch-1 decode
    # step, 8 ragged users, collectives per step. Needs 2 GPUs (nvidia-h100-x2 or larger).
    bench-tp)      run_stage "$stage" "$limit" python3 benchmarks/bench_tp.py ${TP_ARGS:-} \
                     --out "$OUT" ;;
    bench-structured) run_stage "$stage" "$limit" python3 benchmarks/bench_structured.py \
                     --model preset:qwen3.5-27b --out "$OUT" ;;
    # $SERVE_CONCURRENCY (default 4,16) and $SERVE_PROMPTS requests per level (default 64);
    # $SERVE_ARGS: more arguments (--server-log "$OUT/server.log" --server-log-level debug
    # times every engine step; benchmarks/tools/step_log.py groups those steps by what they
    # held).
    bench-serve)   run_stage "$stage" "$limit" python3 -m pagedserve.cli bench serve \
                     --model preset:qwen3.5-27b --device cuda --max-num-seqs 16 \
                     --concurrency "${SERVE_CONCURRENCY:-4,16}" \
                     --num-prompts "${SERVE_PROMPTS:-64}" --output-len 64 --max-model-len 4096 \
                     --cache-type-k q4_0 --cache-type-v q4_0 --out-dir "$OUT" ${SERVE_ARGS:-}
                   # A debug log is too long to come back whole: its step summary and a
                   # compressed copy do.
                   if [ -f "$OUT/server.log" ]; then
                     python3 benchmarks/tools/step_log.py "$OUT/server.log" > "$OUT/step-log.txt"
                     gzip -f "$OUT/server.log"
                   fi ;;
    # The chaos run (issue 32): a 27B-shape server (random bf16 weights, q4_0 K/V, a pool
    # of 1.5 longest requests) under 500 requests of up to 32K tokens with client
    # disconnects; checks no 5xx, no leaked blocks or slots, preemptions, outputs equal to
    # solo reruns. Needs about 480 s: a cold server start (compiles, graphs, warm-up) takes
    # about 180 s, the chaos phase is cut at --chaos-budget-s 240 (its workload_sent check
    # fails if it is) and solo reruns start within --verify-budget-s 45.
    # $CHAOS_ARGS: more bench_chaos.py arguments (--num-requests, --max-prompt-len,
    # --concurrency, --num-verify, --tie-tolerance, --chaos-budget-s ...).
    bench-chaos)   run_stage "$stage" "$limit" python3 benchmarks/bench_chaos.py \
                     ${CHAOS_ARGS:-} --out-dir "$OUT" ;;
    # Prefix caching on and off through the server (benchmarks/bench_prefix.py), 27B shape;
    # $PREFIX_ARGS replaces the scaling knobs. Three servers start (caching on, off, and
    # the checkpoint-budget sweep's one), each about 100 s: about 450 s in all, so run it
    # alone with a limit of about 540 s.
    bench-prefix)  run_stage "$stage" "$limit" python3 benchmarks/bench_prefix.py \
                     --model preset:qwen3.5-27b --device cuda \
                     --server-args "--max-model-len 40960 --max-num-seqs 16 --cache-type-k q4_0 --cache-type-v q4_0" \
                     ${PREFIX_ARGS:---scale 0.25 --conversations 16 --turns 6 --steps 10 --sweep-checkpoints 8} \
                     --out "$OUT" --server-logs "$OUT" ;;
    # The default model (issue 38): scripts/train_default_model.py on the carried corpus
    # (.corpus/corpus.jsonl.xz, built on a CPU machine by scripts/default_model/corpus.py).
    # The checkpoint comes back as $OUT/default-model.tar.part-aa, -ab, ... (15 MB each;
    # `cat default-model.tar.part-* | tar -x` gives default-model/), with its
    # MODEL_CARD.md and train_log.json beside them. $TRAIN_ARGS: more arguments, default
    # --minutes 5. On an H100 with transformers' torch GDN ops (fla's backward refuses
    # Hopper with Triton < 3.7.1) the 10-epoch token budget ends training after about
    # 270 s, and the whole stage takes about 360 s.
    train-default-model) run_stage "$stage" "$limit" bash -c '
                     set -e; out=$1; shift
                     [ -f .corpus/corpus.jsonl.xz ] || { echo "no .corpus/corpus.jsonl.xz"; exit 1; }
                     python3 -c "import transformers, tokenizers, fla; print(transformers.__version__, tokenizers.__version__)"
                     rm -rf /tmp/default-model
                     python3 scripts/train_default_model.py --corpus .corpus/corpus.jsonl.xz \
                       --out /tmp/default-model "$@"
                     tar -cf - -C /tmp default-model | split -b 15000000 - "$out/default-model.tar.part-"
                     cp /tmp/default-model/MODEL_CARD.md /tmp/default-model/train_log.json "$out/"
                     echo "train-default-model: passed"' _ "$OUT" ${TRAIN_ARGS:---minutes 5} ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
pack_triton_cache
echo; echo "=== summary"; printf '%s\n' "${summary[@]}"
