"""Where an engine step's time goes: host phases and GPU kernels, per workload.

A diagnostic, not a benchmark of record: it answers "why is 8 ragged not 8x one
sequence" and "why is a short prefill slower than HF" with a torch.profiler trace of a few
steps through ``LLMEngine.step()`` on the Qwen3.5-27B shape (random bf16 weights, contexts
filled synthetically as in ``bench_engine.py``).

For each (K/V type, workload) it prints:
- wall ms per step (no profiler) and GPU busy ms per step (sum of kernel times, profiled);
- host ms per step in each phase of ``step()`` (schedule, batch build, execute, sample,
  post-process), from ``record_function`` ranges the script wraps around them;
- the top kernels by GPU time per step.

    python benchmarks/tools/profile_engine.py [--types q4_0,f16] [--steps 5] [--out DIR]

Writes DIR/profile_engine.json (DIR defaults to $OUT, else /tmp).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
import bench_engine  # noqa: E402

from pagedserve.engine import llm_engine as llm_engine_mod  # noqa: E402
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402

K = 1024
WORKLOADS = {"1 x 8K": [8 * K], "8 ragged": [128 * K] + [8 * K] * 7}
PHASES = ("schedule", "build_batch", "execute", "sample", "post_process")


class PhaseClock:
    """Host wall time per phase of ``step()`` (no device sync is added: a phase's time is
    what the host spends in it, which for ``sample`` includes waiting for the GPU)."""

    def __init__(self) -> None:
        self.ms = dict.fromkeys(PHASES, 0.0)

    def reset(self) -> None:
        self.ms = dict.fromkeys(PHASES, 0.0)


def instrument(engine: LLMEngine, clock: PhaseClock) -> None:
    """Wrap the phases of ``step()``: profiler ranges ``phase:<name>`` and ``clock``."""

    def ranged(name, fn):
        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            with record_function(f"phase:{name}"):
                out = fn(*args, **kwargs)
            clock.ms[name] += 1e3 * (time.perf_counter() - t)
            return out
        return wrapper

    engine.scheduler.schedule = ranged("schedule", engine.scheduler.schedule)
    engine.runner.execute = ranged("execute", engine.runner.execute)
    engine._sample = ranged("sample", engine._sample)
    engine._post_process = ranged("post_process", engine._post_process)
    build = getattr(llm_engine_mod.build_forward_batch, "unwrapped",
                    llm_engine_mod.build_forward_batch)
    llm_engine_mod.build_forward_batch = ranged("build_batch", build)
    llm_engine_mod.build_forward_batch.unwrapped = build


def summarize(prof, steps: int, top: int = 12) -> dict:
    kernels, host = {}, {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CPU and not evt.key.startswith("phase:"):
            host[evt.key] = (evt.self_cpu_time_total / 1e3 / steps, evt.count / steps)
        dev = getattr(evt, "self_device_time_total", None)
        if dev is None:
            dev = evt.self_cuda_time_total
        if (dev > 0 and evt.device_type == torch.autograd.DeviceType.CUDA
                and not evt.key.startswith("phase:")):
            kernels[evt.key] = (dev / 1e3 / steps, evt.count / steps)
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]
    ranked_host = sorted(host.items(), key=lambda kv: -kv[1][0])[:top]
    return {"gpu_kernel_ms": sum(ms for ms, _ in kernels.values()),
            "kernels_per_step": sum(n for _, n in kernels.values()),
            "top_kernels": [{"name": k[:110], "ms": ms, "calls": n} for k, (ms, n) in ranked],
            "top_host_ops": [{"name": k[:110], "ms": ms, "calls": n}
                             for k, (ms, n) in ranked_host]}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_steps(engine: LLMEngine, clock: PhaseClock, steps: int) -> dict:
    _sync()
    wall = []
    clock.reset()
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        wall.append(1e3 * (time.perf_counter() - t))
    phases = {k: v / steps for k, v in clock.ms.items()}
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        _sync()
    out = summarize(prof, steps)
    out["wall_ms"] = sorted(wall)[len(wall) // 2]
    out["phases_ms"] = phases
    return out


def profile_prefill(engine: LLMEngine, clock: PhaseClock, prompt_len: int) -> dict:
    """One request of ``prompt_len`` tokens to its first token, after a warm-up request."""
    def one(rid):
        prompt = torch.randint(0, engine.vocab_size, (prompt_len,)).tolist()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        n = 0
        while engine.has_unfinished_requests():
            engine.step()
            n += 1
        return n

    one("warm")
    _sync()
    clock.reset()
    t = time.perf_counter()
    steps = one("timed")
    _sync()
    wall = 1e3 * (time.perf_counter() - t)
    phases = dict(clock.ms)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one("profiled")
        _sync()
    out = summarize(prof, 1)
    # Python functions by own time: where the host spends a prefill outside aten ops.
    py = cProfile.Profile()
    py.enable()
    one("python-profiled")
    _sync()
    py.disable()
    text = io.StringIO()
    pstats.Stats(py, stream=text).sort_stats("tottime").print_stats(15)
    out["python_tottime"] = text.getvalue()
    out.update(wall_ms=wall, steps=steps, phases_ms=phases)
    return out


def print_case(title: str, r: dict) -> None:
    phases = "  ".join(f"{p} {r['phases_ms'].get(p, 0.0):.2f}" for p in PHASES)
    print(f"\n## {title}: wall {r['wall_ms']:.2f} ms, GPU kernels {r['gpu_kernel_ms']:.2f} ms"
          f" in {r['kernels_per_step']:.0f} launches")
    print(f"   host wall per phase (ms): {phases}")
    print("   GPU kernels:")
    for k in r["top_kernels"]:
        print(f"   {k['ms']:8.3f} ms  x{k['calls']:<6.0f} {k['name']}")
    print("   host ops (self CPU time):")
    for k in r["top_host_ops"][:8]:
        print(f"   {k['ms']:8.3f} ms  x{k['calls']:<6.0f} {k['name']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="q4_0,f16")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=512, help="prompt length to profile (0: none)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    ap.add_argument("--dry-run", action="store_true",
                    help="the embedded default model on the CPU, short contexts "
                         "(checks the script)")
    args = ap.parse_args(argv)
    model, device, dtype = "preset:qwen3.5-27b", "cuda", "bfloat16"
    workloads = WORKLOADS
    if args.dry_run:
        model, device, dtype = None, "cpu", "float32"
        workloads = {"1 x 40": [40], "3 ragged": [100, 20, 20]}
    loaded = load_model(model, device, dtype)
    results = {}
    for kv_type in args.types.split(","):
        cfg = EngineConfig(model=model, device=device, dtype=dtype,
                           cache_type_k=kv_type, cache_type_v=kv_type, kv_layout="paged",
                           max_model_len=1024 if args.dry_run else bench_engine.MAX_MODEL_LEN,
                           max_num_seqs=8,
                           max_num_batched_tokens=8192, prefill_chunk=4096,
                           gpu_memory_utilization=0.92, progress=False,
                           **({"num_blocks": 128} if args.dry_run else {}))
        engine = LLMEngine(cfg, loaded=loaded)
        clock = PhaseClock()
        instrument(engine, clock)
        bench_engine.fill_pool(engine)
        for name, contexts in workloads.items():
            for i, c in enumerate(contexts):
                bench_engine.admit_with_context(engine, f"s{i}", c, engine.vocab_size)
            for _ in range(2):
                engine.step()
            r = profile_steps(engine, clock, args.steps)
            bench_engine.abort_all(engine)
            results[f"{kv_type} {name}"] = r
            print_case(f"{kv_type} decode {name}", r)
        if args.prefill:
            r = profile_prefill(engine, clock, args.prefill)
            results[f"{kv_type} prefill {args.prefill}"] = r
            print_case(f"{kv_type} prefill {args.prefill} ({r['steps']} steps)", r)
            print(r["python_tottime"][-3500:])
        del engine
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_engine.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
