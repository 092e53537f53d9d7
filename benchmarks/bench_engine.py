"""Whole-engine decode benchmark: concurrent ragged sequences on the Qwen3.5-27B shape.

One run on one GPU, random bf16 weights of the real shape (``--model preset:qwen3.5-27b``).
Every figure is measured through ``LLMEngine.step()`` (scheduler, batch building, CUDA-graph
forward, sampling, reading each step's tokens back), so aggregate tok/s is what a server
would get. Async scheduling is on, as by default on CUDA; the 8-sequence ragged case also
runs without it ("sync"), in the same run.

Contexts are filled synthetically: the K/V pool is filled once with random values of the
storage type (random payload bytes and fp16 scales in [0.005, 0.02] for q8_0/q4_0; N(0, 1)
for f16), every state slot with small random values, and each sequence is admitted with its
context already "computed" (blocks appended, ``num_computed_tokens = L - 1``) so the next
step decodes at position ``L - 1``. Decode time does not depend on the values read, only
on how many bytes are read, so this measures the same work as a real 128K prefill would
leave behind, without spending minutes on prefill.

Writes ``docs/benchmarks/engine.{md,json,png}`` (and copies to ``$OUT``).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from pagedserve.config import CacheConfig  # noqa: E402
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import RequestStatus, SamplingParams  # noqa: E402
from pagedserve.kv.block_pool import BlockPool  # noqa: E402
from pagedserve.kv.kv_manager import KVCacheManager  # noqa: E402
from pagedserve.kv.memory import GiB  # noqa: E402
from pagedserve.model.loader import load_model  # noqa: E402
from pagedserve.plan import footprint  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 1024
RAGGED_8 = "8 ragged (128K + 7x8K)"
# name -> context lengths of the concurrent sequences
WORKLOADS = {
    "1 x 8K": [8 * K],
    "1 x 128K": [128 * K],
    "4 ragged": [64 * K, 8 * K, 4 * K, 2 * K],
    RAGGED_8: [128 * K] + [8 * K] * 7,
    "16 ragged (128K + 7x8K + 8x4K)": [128 * K] + [8 * K] * 7 + [4 * K] * 8,
}
MAX_MODEL_LEN = 128 * K + 256
CAPACITY_BUDGET = 40 * GiB


def fill_pool(engine: LLMEngine, seed: int = 0) -> None:
    """Random K/V in every block and random recurrent state in every slot."""
    gen = torch.Generator(device=engine.runner.device).manual_seed(seed)
    for k, v in engine.runner.kv_caches:
        for store in (k, v):
            if store.scales is None:
                store.data.normal_(0.0, 1.0, generator=gen)
            else:
                store.data.view(torch.uint8).random_(0, 256, generator=gen)
                store.scales.uniform_(0.005, 0.02, generator=gen)


def admit_with_context(engine: LLMEngine, rid: str, context: int, vocab: int) -> None:
    """Admit a request whose first ``context - 1`` tokens are already in the cache."""
    prompt = torch.randint(0, vocab, (context,)).tolist()
    req = engine.make_request(rid, prompt, SamplingParams(max_tokens=1 << 20, temperature=0.0,
                                                          ignore_eos=True))
    engine.enqueue(req)
    sched = engine.scheduler
    sched.waiting.remove(req)
    req.kv_handle = engine.kv.create()
    if not engine.kv.append(req.kv_handle, context - 1):
        raise RuntimeError(f"pool too small for a {context}-token context")
    req.state_handle = engine.runner.state_pool.acquire()
    slot = engine.runner.state_pool.slot(req.state_handle)
    engine.runner.state_pool.conv_state[:, slot].normal_(0.0, 0.1)
    engine.runner.state_pool.recurrent_state[:, slot].normal_(0.0, 0.01)
    req.num_computed_tokens = context - 1
    req.status = RequestStatus.RUNNING
    sched.running.append(req)


def time_decode(engine: LLMEngine, contexts: list[int], steps: int, warmup: int) -> dict:
    for i, c in enumerate(contexts):
        admit_with_context(engine, f"s{i}", c, engine.vocab_size)
    for _ in range(warmup):
        engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()  # one step's tokens read back (the next may be in flight)
        times.append(time.perf_counter() - t)
        assert len(outs) == len(contexts), "every sequence must decode every step"
    abort_all(engine)
    ms = sorted(1e3 * t for t in times)
    p50 = statistics.median(ms)
    return {
        "contexts": contexts, "num_seqs": len(contexts), "steps": steps,
        "ms_per_step_p50": p50, "ms_per_step_p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))],
        "ms_per_step_mean": statistics.fmean(ms),
        "tok_per_s": len(contexts) * 1e3 / p50,
    }


def abort_all(engine: LLMEngine) -> None:
    """Abort every request, then read back the step still in flight (async scheduling),
    so the next case starts from an idle engine."""
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def time_ttft(engine: LLMEngine, prompt_len: int, repeats: int = 3) -> float:
    """Median seconds from adding a ``prompt_len``-token request to its first token over
    ``repeats`` requests, after one untimed request of the same length (first use of a
    shape compiles and autotunes). Each prompt is new random tokens: no prefix hit."""
    times = []
    for i in range(repeats + 1):
        prompt = torch.randint(0, engine.vocab_size, (prompt_len,)).tolist()
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.add_request(f"ttft-{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:])


def capacity(model_cfg, cache_cfg, budget: int, ctx: int, max_len: int) -> dict:
    """Most concurrent ``ctx``-token sequences in ``budget`` bytes of K/V + state: paged
    (allocated for real in a pool of that many blocks) vs padded to ``max_len``."""
    kv = footprint(model_cfg, cache_cfg)
    state = model_cfg.state_shapes(torch.bfloat16).bytes_per_slot
    padded = budget // (max_len * kv.bytes_per_token + state)
    # Paged: every admitted sequence takes a slot first, then its blocks.
    n = 0
    while (n + 1) * state + kv.block_rounded_tokens([ctx] * (n + 1)) * kv.bytes_per_token \
            <= budget:
        n += 1
    blocks = (budget - n * state) // kv.bytes_per_block
    mgr = KVCacheManager(BlockPool(int(blocks), kv.block_size), n + 1, -(-ctx // kv.block_size))
    fitted = 0
    for _ in range(n + 1):
        h = mgr.create()
        if not mgr.append(h, ctx):
            break
        fitted += 1
    return {"budget_gib": budget / GiB, "context": ctx, "padded_to": max_len,
            "paged_seqs": fitted, "padded_seqs": int(padded),
            "ratio": fitted / max(int(padded), 1)}


def run(args) -> dict:
    meta = _common.run_meta()
    t0 = time.perf_counter()
    loaded = load_model("preset:qwen3.5-27b", "cuda", "bfloat16")
    print(f"random weights {loaded.weights_bytes / 1e9:.1f} GB in "
          f"{time.perf_counter() - t0:.1f} s")
    results = {"meta": meta, "weights_bytes": loaded.weights_bytes, "cases": [],
               "memory": {}, "ttft_s": {}}
    layouts = [("paged", "q4_0"), ("paged", "f16"), ("contiguous", "q4_0"),
               ("contiguous", "f16")]
    if args.quick:
        layouts = [("paged", "q4_0"), ("paged", "f16")]
    for layout, kv_type in layouts:
        workloads = dict(WORKLOADS)
        max_seqs = 16
        if layout == "contiguous":
            # Padded to 128K each: 16 f16 sequences would need 128 GiB of K/V.
            workloads = {k: v for k, v in WORKLOADS.items() if len(v) <= 8}
            max_seqs = 8
        cfg = EngineConfig(model="preset:qwen3.5-27b", device="cuda", dtype="bfloat16",
                           cache_type_k=kv_type, cache_type_v=kv_type, kv_layout=layout,
                           max_model_len=MAX_MODEL_LEN, max_num_seqs=max_seqs,
                           max_num_batched_tokens=8192, prefill_chunk=4096,
                           gpu_memory_utilization=0.92, progress=False)
        torch.cuda.reset_peak_memory_stats()
        t = time.perf_counter()
        engine = LLMEngine(cfg, loaded=loaded)
        print(f"{layout} {kv_type}: engine ready in {time.perf_counter() - t:.1f} s, "
              f"{engine.kv.pool.num_blocks} blocks")
        fill_pool(engine)
        mem = engine.runner.memory_usage()
        cases = [(name, contexts, True) for name, contexts in workloads.items()]
        if layout == "paged":
            cases.append((f"{RAGGED_8}, sync", WORKLOADS[RAGGED_8], False))
        for name, contexts, lookahead in cases:
            engine.async_scheduling = lookahead
            r = time_decode(engine, contexts, args.steps, args.warmup)
            r.update(layout=layout, kv_type=kv_type, workload=name, async_scheduling=lookahead)
            results["cases"].append(r)
            print(f"  {name:32s} {r['ms_per_step_p50']:7.2f} ms/step  {r['tok_per_s']:7.1f} tok/s")
        engine.async_scheduling = True
        if layout == "paged":
            results["ttft_s"][kv_type] = {n: time_ttft(engine, n) for n in (512, 8192)}
            print(f"  TTFT {results['ttft_s'][kv_type]}")
        results["memory"][f"{layout} {kv_type}"] = {
            "weights_gib": mem.weights_bytes / GiB, "kv_gib": mem.kv_bytes / GiB,
            "state_gib": mem.state_bytes / GiB,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
        }
        if kv_type == "q4_0" and layout == "paged":
            results["capacity"] = {
                t: capacity(loaded.config, CacheConfig(t, t), CAPACITY_BUDGET,
                            8 * K, 128 * K) for t in ("q4_0", "f16")}
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    return results


def summarize(res: dict) -> list[dict]:
    by = {(c["layout"], c["kv_type"], c["workload"]): c for c in res["cases"]}
    out = []
    for kv in ("q4_0", "f16"):
        single = by.get(("paged", kv, "1 x 8K"))
        eight = by.get(("paged", kv, RAGGED_8))
        if single and eight:
            out.append({"kv": kv, "speedup_8_vs_1": eight["tok_per_s"] / single["tok_per_s"],
                        "tok_per_s_8": eight["tok_per_s"]})
    return out


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        "# Engine decode benchmark (Qwen3.5-27B shape, random bf16 weights)", "",
        _common.meta_line(m), "",
        "Measured through `LLMEngine.step()` (scheduler + batch build + CUDA-graph forward + "
        "sampling + reading the tokens back), with async scheduling (the CUDA default) except "
        "in the rows marked 'sync'. Contexts filled synthetically (see the script's "
        "docstring). p50/p99 over the timed steps.", "",
    ]
    rows = [[c["workload"], c["layout"], c["kv_type"], f"{c['ms_per_step_p50']:.2f}",
             f"{c['ms_per_step_p99']:.2f}", f"{c['tok_per_s']:.1f}"] for c in res["cases"]]
    lines.append(_common.md_table(["workload", "layout", "K/V", "TPOT p50 ms", "TPOT p99 ms",
                                   "aggregate tok/s"], rows))
    lines += ["", "## Targets (issue 5)", ""]
    for s in summarize(res):
        lines.append(f"- {s['kv']}: 8 ragged = {s['speedup_8_vs_1']:.2f}x single 8K "
                     f"(target >= 6x: {'met' if s['speedup_8_vs_1'] >= 6 else 'MISSED'}); "
                     f"{s['tok_per_s_8']:.0f} tok/s (target >= 400: "
                     f"{'met' if s['tok_per_s_8'] >= 400 else 'MISSED'})")
    lines += ["", "## TTFT (median of three requests, prefill through the engine)", ""]
    for kv, d in res["ttft_s"].items():
        lines.append(f"- {kv}: " + ", ".join(f"{n} tokens {s * 1e3:.0f} ms" for n, s in d.items()))
    lines += ["", "## Memory", ""]
    lines.append(_common.md_table(
        ["engine", "weights GiB", "K/V pool GiB", "state GiB", "peak allocated GiB"],
        [[k, f"{v['weights_gib']:.1f}", f"{v['kv_gib']:.2f}", f"{v['state_gib']:.2f}",
          f"{v['peak_allocated_gib']:.1f}"] for k, v in res["memory"].items()]))
    if "capacity" in res:
        lines += ["", "## Capacity: concurrent 8K sequences in 40 GiB of K/V + state", ""]
        lines.append(_common.md_table(
            ["K/V", "paged", "padded to 128K", "ratio"],
            [[k, v["paged_seqs"], v["padded_seqs"], f"{v['ratio']:.1f}x"]
             for k, v in res["capacity"].items()]))
    return "\n".join(lines) + "\n"


def figure(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = list(dict.fromkeys(c["workload"] for c in res["cases"]))
    series = sorted({(c["layout"], c["kv_type"]) for c in res["cases"]})
    width = 0.8 / max(len(series), 1)
    for j, (layout, kv) in enumerate(series):
        vals = [next((c["tok_per_s"] for c in res["cases"] if c["workload"] == n
                      and c["layout"] == layout and c["kv_type"] == kv), 0) for n in names]
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=f"{layout} {kv}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names, rotation=15,
                  fontsize=8)
    ax.set_ylabel("aggregate decode tok/s")
    ax.set_title(f"pagedserve engine, Qwen3.5-27B shape, {res['meta']['gpu']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="paged layouts only")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_engine needs a CUDA GPU", file=sys.stderr)
        return 2
    res = run(args)
    paths = _common.write_outputs(args.out, "engine", res, markdown(res),
                                  lambda p: figure(res, p))
    print(markdown(res))
    print("wrote", ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
