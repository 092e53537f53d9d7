"""Where a speculative step's time goes: wall time per phase of ``SpeculativeDecoding``.

A diagnostic, not a benchmark of record. One engine with ``--speculative-config`` (MTP,
``k`` drafts) on the Qwen3.5-27B shape decodes ``B`` sequences at an imposed acceptance
(``bench_spec_e2e.ImposedAcceptance``). Each phase of a step is wrapped with a device
synchronize on both sides, so its wall time is its own host work plus the GPU work it
issued: draft proposal, the verify forward pass, the logits, the verify decision, the
drafter's observe pass, the rollback, the commit. Compare the step with a plain decode
step of the same shape from ``bench_spec_e2e.py`` or ``bench_engine.py``.

    python benchmarks/tools/profile_spec.py [--batch 1] [--k 3] [--acceptance 0.7] [--kernels]

The step's own wall time is measured first, with nothing wrapped. ``--syncs`` lists where
the host waits for the device in a step (``torch.cuda.set_sync_debug_mode``), by the
innermost pagedserve frame.

``--kernels`` adds the GPU side: the top kernels per step under torch.profiler (graph
replays included), for the speculative engine and for a plain engine decoding the same
prompts, so the verify pass's kernels can be set against the decode step's.

Writes profile_spec.json to $OUT when set.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/
from bench_spec_e2e import ImposedAcceptance  # noqa: E402
from profile_engine import summarize  # noqa: E402

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402

PHASES = ("_forward", "_verify", "_sample_plain", "_observe", "_roll_back", "_apply")


def timed(times: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn(*args, **kwargs)
        torch.cuda.synchronize()
        times[name].append(time.perf_counter() - t)
        return out
    return wrapper


def start(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> None:
    """Add ``prompts`` and run the prefill and the first decode steps (untimed)."""
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, params)
    for _ in range(4):
        engine.step()


def step_wall_ms(engine: LLMEngine, steps: int) -> float:
    """Median wall time of ``engine``'s next ``steps`` steps, each fenced by a sync."""
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def sync_census(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Host waits per step over ``engine``'s next ``steps`` steps, by the innermost frame
    under ``pagedserve/`` (torch's sync debug mode warns at each synchronizing call)."""
    sites: collections.Counter[str] = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1]
                  if "/pagedserve/" in f.filename.replace("\\", "/")]
        where = (f"{Path(frames[-1].filename).name}:{frames[-1].lineno} {frames[-1].name}"
                 if frames else f"{Path(filename).name}:{lineno}")
        sites[where] += 1

    with warnings.catch_warnings():  # restores the filters and showwarning on exit
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    per_step = {k: v / steps for k, v in sites.most_common()}
    print(f"  host waits per step: {sum(per_step.values()):.1f}")
    for where, n in per_step.items():
        print(f"    {n:5.2f}  {where}")
    return per_step


def kernels(engine: LLMEngine, steps: int, top: int = 20) -> dict:
    """GPU time per step of ``engine``'s next ``steps`` steps, by kernel, printed."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    out = summarize(prof, steps, top)
    print(f"  GPU {out['gpu_kernel_ms']:.2f} ms/step in {out['kernels_per_step']:.0f} kernels")
    for k in out["top_kernels"]:
        print(f"    {k['ms']:7.3f} ms  x{k['calls']:<5.0f} {k['name'][:90]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="preset:qwen3.5-27b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--acceptance", type=float, default=0.7)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--kernels", action="store_true",
                    help="also profile the kernels of speculative and plain steps")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="draft over a vocabulary subset (engine/draft_vocab.py)")
    ap.add_argument("--syncs", action="store_true",
                    help="also list where a step waits for the device")
    args = ap.parse_args(argv)
    loaded = load_model(args.model, "cuda", torch.bfloat16, progress=False, mtp=True)
    config = EngineConfig(
        model=args.model, device="cuda", dtype="bfloat16", max_model_len=2048,
        max_num_seqs=args.batch, cache_type_k="q4_0", cache_type_v="q4_0", progress=False)
    speculative: dict = {"method": "mtp", "num_speculative_tokens": args.k}
    if args.draft_vocab_size is not None:
        speculative["draft_vocab_size"] = args.draft_vocab_size
    engine = LLMEngine(dataclasses.replace(config, speculative_config=speculative),
                       loaded=loaded)
    spec = engine.spec
    assert spec is not None
    ImposedAcceptance(spec, args.acceptance, seed=1)
    params = SamplingParams(max_tokens=3 * args.steps * (args.k + 1) + 64, temperature=0.0,
                            ignore_eos=True)
    prompts = [torch.randint(0, engine.vocab_size, (512,)).tolist() for _ in range(args.batch)]
    start(engine, prompts, params)
    bare_ms = step_wall_ms(engine, args.steps)  # nothing wrapped
    census = sync_census(engine, min(args.steps, 5)) if args.syncs else None
    times: dict[str, list[float]] = collections.defaultdict(list)
    for name in PHASES:
        setattr(spec, name, timed(times, name, getattr(spec, name)))
    spec.drafter.propose = timed(times, "drafter.propose", spec.drafter.propose)
    spec.drafter.observe = timed(times, "drafter.observe", spec.drafter.observe)
    step_times = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        step_times.append(time.perf_counter() - t)
    ms = {name: 1e3 * sum(v) / args.steps for name, v in times.items()}
    step_ms = 1e3 * statistics.median(step_times)
    result = {"batch": args.batch, "k": args.k, "acceptance": args.acceptance,
              "draft_vocab_size": args.draft_vocab_size,
              "step_ms_p50": bare_ms, "phased_step_ms_p50": step_ms,
              "phase_ms_per_step": ms, "host_waits_per_step": census,
              "mean_acceptance_length": spec.stats.mean_acceptance_length}
    print(f"B={args.batch} k={args.k} a={args.acceptance}: step {bare_ms:.2f} ms (p50), "
          f"{step_ms:.2f} ms with each phase fenced, "
          f"{spec.stats.mean_acceptance_length:.2f} tokens/verify")
    for name, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {name:18s} {v:7.2f} ms/step")
    if args.kernels:
        print("speculative steps:")
        result["kernels"] = {"speculative": kernels(engine, args.steps)}
        engine.close()
        del engine, spec
        gc.collect()
        torch.cuda.empty_cache()
        plain = LLMEngine(config, loaded=loaded)
        start(plain, prompts, params)
        result["plain_step_ms_p50"] = step_wall_ms(plain, args.steps)
        print(f"plain decode steps: {result['plain_step_ms_p50']:.2f} ms (p50)")
        result["kernels"]["plain"] = kernels(plain, args.steps)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "profile_spec.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
