"""Tensor parallelism (issue 40): ``LLMEngine`` at ``--tensor-parallel-size 2`` against one
GPU on the Qwen3.5-27B shape (random bf16 weights).

Three figures per size: the batch-1 decode step (median wall time of ``engine.step()``
over steady decode steps; target at TP=2: <= 0.6x TP=1), the decode throughput of 8
users with ragged prompts (tokens generated after each request's first, over the time
from the last first token to the end; target >= 1.6x), and the collectives' time per
decode step (rank 0's all-reduce and all-gather time in a profiled batch-1 step: NCCL
kernels on CUDA, so it includes waiting for the slower rank). Writes
``tp.{md,json,png}`` (``tp_quick`` with ``--quick``: the tiny random model on the CPU
with gloo, a smoke test whose figures mean nothing).
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402
from pagedserve.model.random_checkpoint import random_model_path  # noqa: E402

COLLECTIVE_NAMES = ("allreduce", "all_reduce", "allgather", "all_gather")


def make_engine(args, tp: int) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=args.model, device=args.device, tensor_parallel_size=tp, progress=False,
        cache_type_k=args.kv_type, cache_type_v=args.kv_type, max_num_seqs=8,
        max_model_len=args.max_model_len, enable_prefix_caching=False if tp == 1 else None))


def decode_steps(engine: LLMEngine, prompts: list[list[int]], output_len: int,
                 profile: bool = False) -> dict:
    """Run ``prompts`` to ``output_len`` tokens; time each step once every request has its
    first token. ``profile``: the collectives' time of one such step."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    first: set[str] = set()
    steps: list[float] = []
    tokens_after_first = 0
    collective_us = None
    while engine.has_unfinished_requests():
        steady = len(first) == len(prompts)
        if steady and profile and collective_us is None:
            collective_us = profiled_collectives(engine)
            continue
        start = time.perf_counter()
        outs = engine.step()
        if engine.runner.device.type == "cuda":
            torch.cuda.synchronize()
        if steady:
            steps.append(time.perf_counter() - start)
            tokens_after_first += sum(len(o.new_token_ids) for o in outs)
        first |= {o.request_id for o in outs if o.new_token_ids}
    return {"step_ms": 1e3 * statistics.median(steps) if steps else None,
            "decode_tok_s": tokens_after_first / sum(steps) if steps else None,
            "collective_ms_per_step": collective_us and collective_us / 1e3}


def profiled_collectives(engine: LLMEngine) -> float:
    """Microseconds of all-reduce and all-gather in one profiled step on rank 0."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    cuda = engine.runner.device.type == "cuda"
    if cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        engine.step()
        if cuda:
            torch.cuda.synchronize()
    total = 0.0
    for e in prof.key_averages():
        if any(n in e.key.lower().replace(":", "_") for n in COLLECTIVE_NAMES):
            total += e.device_time_total if cuda else e.cpu_time_total
    return total


def run(args) -> dict:
    rng = random.Random(0)
    vocab = 259 if args.quick else 150_000

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    one = [prompt(args.prompt_len)]
    ragged = [prompt(max(1, args.prompt_len * (i + 1) // 8)) for i in range(8)]
    sizes = {}
    for tp in (1, args.tp):
        engine = make_engine(args, tp)
        try:
            single = decode_steps(engine, one, args.output_len, profile=tp > 1)
            users = decode_steps(engine, ragged, args.output_len)
        finally:
            engine.close()
        sizes[str(tp)] = {"batch1": single, "ragged8": users}
    base, tp = sizes["1"], sizes[str(args.tp)]
    return {
        "meta": _common.run_meta(), "model": args.model, "kv_type": args.kv_type,
        "tp": args.tp, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "sizes": sizes,
        "batch1_step_ratio": tp["batch1"]["step_ms"] / base["batch1"]["step_ms"],
        "ragged8_throughput_ratio": (tp["ragged8"]["decode_tok_s"]
                                     / base["ragged8"]["decode_tok_s"]),
    }


def markdown(res: dict) -> str:
    n = res["tp"]
    lines = [f"# Tensor parallelism: TP={n} against TP=1", "",
             _common.meta_line(res["meta"]), "",
             f"{res['model']}, {res['kv_type']} K/V, prompts {res['prompt_len']} tokens "
             f"(8 users: 1/8 .. 8/8 of it), {res['output_len']} tokens each.", "",
             "| size | batch-1 step (ms) | 8 users decode tok/s | collectives per step (ms) |",
             "|---:|---:|---:|---:|"]
    for size, r in res["sizes"].items():
        c = r["batch1"]["collective_ms_per_step"]
        lines.append(f"| {size} | {r['batch1']['step_ms']:.2f} | "
                     f"{r['ragged8']['decode_tok_s']:.1f} | {'-' if c is None else f'{c:.2f}'} |")
    lines += ["", f"Batch-1 step at TP={n}: {res['batch1_step_ratio']:.2f}x TP=1 (target "
              f"<= 0.6x). 8-user throughput: {res['ragged8_throughput_ratio']:.2f}x "
              f"(target >= 1.6x).", ""]
    return "\n".join(lines)


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(res["sizes"])
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    axes[0].bar(sizes, [res["sizes"][s]["batch1"]["step_ms"] for s in sizes])
    axes[0].set(title="batch-1 decode step", xlabel="tensor-parallel size", ylabel="ms")
    axes[1].bar(sizes, [res["sizes"][s]["ragged8"]["decode_tok_s"] for s in sizes])
    axes[1].set(title="8 ragged users", xlabel="tensor-parallel size", ylabel="decode tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = _common.model_parser(__doc__, "the tiny random model on the CPU with gloo (a smoke "
                                       "test)")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=8192)
    args = ap.parse_args(argv)
    args.device = "cuda"
    if args.quick:
        args.device, args.kv_type, args.prompt_len, args.output_len = "cpu", "f16", 16, 6
        args.model, args.max_model_len = str(random_model_path()), 64
    elif torch.cuda.device_count() < args.tp:
        print(f"bench_tp needs {args.tp} CUDA GPUs (or --quick)", file=sys.stderr)
        return 2
    res = run(args)
    stem = "tp_quick" if args.quick else "tp"
    return _common.report(args.out, stem, res, markdown(res), lambda p: figure(res, p))


if __name__ == "__main__":
    sys.exit(main())
