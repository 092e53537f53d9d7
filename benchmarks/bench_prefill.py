"""Prefill benchmark: the paged prefill attention op, and whole-model time to first token.

Two parts, one GPU, one run:

- **op**: one 4K-row chunk of the 27B attention shape (Hq 24, Hkv 4, head_dim 256) over a
  cached prefix of 0, 8K, 32K and 128K rows: the paged prefill kernel reading bf16, q8_0
  and q4_0 K/V from a shuffled pool, in place and over a copy dequantized once, against
  ``F.scaled_dot_product_attention`` (flash) on contiguous bf16 K/V of the same shape with
  a lower-right causal mask. Graph replay, sides interleaved (``_common.time_sides``).
  TFLOP/s count causal FLOPs only (``4 * Hq * D * sum_i (ctx + i + 1)``).
- **ttft**: ``LLMEngine`` on the Qwen3.5-27B shape (random bf16 weights), one prompt at a
  time, from ``add_request`` to its first token, for the engine's default step sizes and
  any others asked for. Each engine warms up as it starts (its phases are reported); its
  first ten short requests show whether the first waits on anything the tenth does not. A
  ``torch.profiler`` pass splits one prompt's GPU time into GEMMs, full attention, GDN
  and the rest, each against its own floor.
- **hf**: transformers' Qwen3.5 (sdpa) on the same weights, the short prompt's TTFT.

    python benchmarks/bench_prefill.py [--parts op,ttft,hf] [--lengths 512,8192,32768,131072]
    python benchmarks/bench_prefill.py --quick      # CPU dry run, numbers meaningless

Writes ``docs/benchmarks/prefill.{md,json,png}`` (and copies to ``$OUT``).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from pagedserve import presets  # noqa: E402
from pagedserve.engine import warmup  # noqa: E402
from pagedserve.kernels import ops  # noqa: E402
from pagedserve.kv.formats import KVBlockStorage  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
K = 1024
PEAK_TFLOPS = 790.0  # H200 dense bf16 (docs/kernel-decisions.md); floors use it
CATEGORIES = ("gemm", "attention", "gdn", "other")


# ---- op ---------------------------------------------------------------------------------

def causal_flops(n: int, ctx: int, hq: int, d: int) -> float:
    return 4.0 * hq * d * (n * ctx + n * (n + 1) / 2)


def op_case(kv_type: str, n: int, ctx: int, hq: int, hkv: int, d: int, device: str,
            sweep: list[tuple[int, int, int, int]], block_size: int = 16) -> dict:
    """One chunk: the paged kernel in place and over a dequantized copy, on ``kv_type``,
    against SDPA on contiguous bf16. ``sweep``: more launch configurations of the kernel, timed
    side by side as ``kernel BM/BN/W/S``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from pagedserve.kernels import paged_prefill

    length = ctx + n
    num_blocks = -(-length // block_size)
    gen = torch.Generator(device=device).manual_seed(0)
    cache_k, cache_v = KVBlockStorage.allocate_pair(kv_type, kv_type, num_blocks, block_size,
                                                    hkv, d, device)
    rows = torch.randn(num_blocks * block_size, hkv, d, device=device, generator=gen,
                       dtype=torch.bfloat16)
    slots = torch.arange(num_blocks * block_size, device=device)
    ops.kv_write(cache_k, rows, slots)
    ops.kv_write(cache_v, rows.flip(0), slots)
    table = torch.randperm(num_blocks, device=device, generator=gen).int()[None]
    q = torch.randn(n, hq, d, device=device, dtype=torch.bfloat16, generator=gen)
    qsl = torch.tensor([0, n], dtype=torch.int32, device=device)
    lens = torch.tensor([length], dtype=torch.int32, device=device)
    out = torch.empty_like(q)
    scale = d ** -0.5
    default_config = paged_prefill.launch_config

    def method(name: str, config=None):
        def call() -> None:
            if config is not None:
                paged_prefill.launch_config = lambda *_: config
            try:
                ops.paged_prefill_attention(q, cache_k, cache_v, table, qsl, lens, scale,
                                            out=out, query_start_loc_cpu=[0, n],
                                            seq_lens_cpu=[length], method=name)
            finally:
                paged_prefill.launch_config = default_config
        return call

    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D]
    kc = rows[:length].transpose(0, 1)[None].contiguous()  # [1, Hkv, L, D]
    vc = rows.flip(0)[:length].transpose(0, 1)[None].contiguous()
    bias = causal_lower_right(n, length)

    def sdpa() -> None:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(qh, kc, vc, attn_mask=bias, scale=scale,
                                           enable_gqa=True)

    sides = {"kernel": [method("kernel")], "dequantized": [method("dequantized")],
             "sdpa": [sdpa]}
    for config in sweep:
        sides["kernel " + "/".join(map(str, config))] = [method("kernel", config)]
    us = _common.time_sides(sides, "graph" if device == "cuda" else "eager", min_rounds=5,
                            min_seconds=0.2)
    flops = causal_flops(n, ctx, hq, d)
    return {"kv_type": kv_type, "chunk": n, "prefix": ctx, "us": us,
            "tflops": {k: flops / v / 1e6 for k, v in us.items()},
            "ratio": us["sdpa"] / us["kernel"],
            "dequantized_ratio": us["sdpa"] / us["dequantized"]}


def run_op(args, device: str) -> list[dict]:
    if args.quick:
        shape, cases = (4, 2, 64), [(64, 0), (64, 128)]
    else:
        shape = (24, 4, 256)
        cases = [tuple(int(v) for v in c.split("x")) for c in args.op_cases.split(",")]
    rows = []
    for kv_type in args.op_types.split(","):
        for n, ctx in cases:
            sweep = args.sweep if (n, ctx) in args.sweep_cases else []
            r = op_case(kv_type, n, ctx, *shape, device, sweep)
            rows.append(r)
            sides = "  ".join(f"{k} {v:.1f} us ({r['tflops'][k]:.0f})" for k, v in
                              r["us"].items())
            print(f"op {kv_type:5s} chunk {n} over {ctx:6d}: {sides}", flush=True)
    return rows


# ---- ttft -------------------------------------------------------------------------------

def category(kernel: str) -> str:
    name = kernel.lower()
    # Attention first: flash kernels' names carry "cutlass" too.
    if any(s in name for s in ("paged_prefill", "paged_decode", "fragment", "flash", "fmha",
                               "decode_merge", "gather_rows", "sdpa", "cudnn")):
        return "attention"
    if any(s in name for s in ("nvjet", "gemm", "cutlass", "xmma", "cublas", "splitk",
                               "gemv")):
        return "gemm"
    if any(s in name for s in ("chunk", "conv", "l2norm", "solve_tril", "wy", "recompute",
                               "kkt", "rule", "gated_delta", "cumsum")):
        return "gdn"
    return "other"


def first_token_seconds(engine, prompt_len: int, rid: str) -> float:
    from pagedserve.engine.request import SamplingParams

    prompt = torch.randint(0, engine.vocab_size, (prompt_len,)).tolist()
    _sync()
    t = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t


def profile_prompt(engine, prompt_len: int) -> dict:
    """GPU milliseconds by category for one prompt (kernel time summed, no overlap). On
    CUDA only the GPU's activity is recorded: a long prompt's host events take minutes to
    parse."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if on_gpu else ProfilerActivity.CPU]) as prof:
        wall = first_token_seconds(engine, prompt_len, f"profile-{prompt_len}")
        _sync()
    by_cat = dict.fromkeys(CATEGORIES, 0.0)
    launches = 0
    kernels = []
    for evt in prof.key_averages():
        dev = getattr(evt, "self_device_time_total", 0.0)
        if evt.device_type == torch.autograd.DeviceType.CUDA and dev > 0:
            by_cat[category(evt.key)] += dev / 1e3
            launches += evt.count
            kernels.append((dev / 1e3, evt.count, evt.key[:100]))
    top = [{"ms": ms, "calls": n, "name": name} for ms, n, name in sorted(kernels)[::-1][:15]]
    for k in top:
        print(f"      {k['ms']:8.2f} ms  x{k['calls']:<5d} {k['name']}")
    return {"wall_ms_profiled": 1e3 * wall, "gpu_ms": by_cat, "launches": launches,
            "top_kernels": top}


def model_floors(cfg, prompt_len: int) -> dict:
    """Milliseconds at PEAK_TFLOPS: linear layers (2 FLOPs per weight per token, the LM
    head once) and causal attention of the full-attention layers."""
    params = 0
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    for layer_type in cfg.layer_types:
        if layer_type == "full_attention":
            d, hq, hkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
            params += hidden * (2 * hq * d + 2 * hkv * d) + hq * d * hidden
        else:
            conv, value = cfg.conv_dim, cfg.linear_value_dim
            hv = cfg.linear_num_value_heads
            params += hidden * (conv + value + 2 * hv) + value * hidden
        params += 3 * hidden * inter
    gemm = 2.0 * params * prompt_len + 2.0 * hidden * cfg.vocab_size
    attn = cfg.num_full_attention_layers * causal_flops(
        prompt_len, 0, cfg.num_attention_heads, cfg.head_dim)
    return {"gemm": gemm / PEAK_TFLOPS / 1e9, "attention": attn / PEAK_TFLOPS / 1e9}


def run_ttft(args, device: str, loaded) -> dict:
    from pagedserve.engine.llm_engine import EngineConfig, LLMEngine

    max_len = max(args.lengths) + 64
    results = {"configs": []}
    for config in args.configs:
        chunk, idle, budget = config or (None, None, None)
        cfg = EngineConfig(device=device, dtype=None if args.quick else "bfloat16",
                           cache_type_k=args.kv_type, cache_type_v=args.kv_type,
                           max_model_len=max_len, max_num_seqs=args.max_num_seqs,
                           prefill_chunk=chunk, idle_prefill_chunk=idle,
                           max_num_batched_tokens=budget, gpu_memory_utilization=0.92,
                           quantization=args.quantization, warm_up=True, progress=False)
        t = time.perf_counter()
        engine = LLMEngine(cfg, loaded=loaded)
        ready = time.perf_counter() - t
        sched = engine.scheduler.config
        entry = {"label": "defaults" if config is None else "set",
                 "prefill_chunk": sched.prefill_chunk,
                 "idle_prefill_chunk": sched.idle_prefill_chunk,
                 "max_num_batched_tokens": sched.max_num_batched_tokens,
                 "engine_ready_s": ready, "startup_s": dict(engine.startup_seconds),
                 "ttft_s": {}, "profile": {}, "floors_ms": {}}
        # The first requests after ready, one after another: the first must not wait on
        # any compile that the tenth does not.
        short = min(args.first_len, max_len - 8)
        series = [first_token_seconds(engine, short, f"first-{i}") for i in range(10)]
        entry["first_vs_tenth"] = {"prompt": short, "seconds": series,
                                   "ratio": series[0] / series[9]}
        print(f"{_label(entry)}: ready {ready:.1f} s ({_phases(entry['startup_s'])}); "
              f"{short}-token TTFT first {series[0]:.3f} s, tenth {series[9]:.3f} s "
              f"({series[0] / series[9]:.2f}x)", flush=True)
        lengths = [n for n in args.lengths
                   if n <= args.max_length_for.get(sched.idle_prefill_chunk, n)]
        for n in lengths:
            entry["floors_ms"][n] = model_floors(loaded.config, n)
            if args.long_chunk_methods:
                continue  # timed by method below
            entry["ttft_s"][n] = first_token_seconds(engine, n, f"ttft-{n}")
            print(f"  TTFT {n:7d}: {entry['ttft_s'][n]:8.3f} s", flush=True)
            if n in args.profile_lengths:
                entry["profile"][n] = p = profile_prompt(engine, n)
                cats = "  ".join(f"{c} {p['gpu_ms'][c]:.1f}" for c in CATEGORIES)
                print(f"    GPU ms: {cats}  ({p['launches']} launches)", flush=True)
        if args.long_chunk_methods:
            entry["ttft_by_method"] = methods = by_method(
                engine, args.long_chunk_methods, lengths, args.profile_lengths)
            # The floors' table and the plot show the library's default method.
            shown = methods.get(ops.LONG_CHUNK_METHOD) or methods[args.long_chunk_methods[-1]]
            entry["ttft_s"], entry["profile"] = shown["ttft_s"], shown["profile"]
        if args.checkpoint_intervals and engine.prefix is not None:
            entry["ttft_by_checkpoint_interval"] = by_checkpoint_interval(
                engine, args.checkpoint_intervals, lengths)
        results["configs"].append(entry)
        del engine
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def by_method(engine, methods: list[str], lengths: list[int],
              profile_lengths: set[int]) -> dict:
    """The same engine's TTFT with each method for long chunks (``ops.LONG_CHUNK_METHOD``),
    lengths in turn, methods alternating; each method first builds its cuDNN plans (for
    ``"cudnn"``) and runs one untimed prompt of two long chunks (its kernels' first
    launches). The last method is profiled at
    ``profile_lengths``."""
    default = ops.LONG_CHUNK_METHOD
    res: dict = {m: {"ttft_s": {}, "profile": {}} for m in methods}
    try:
        for m in methods:
            ops.LONG_CHUNK_METHOD = m
            warmup.build_long_chunk_plans(engine)  # the warm-up's, for the default only
            warm = min(2 * ops.LONG_CHUNK_MIN_ROWS + 16, engine.max_model_len - 8)
            first_token_seconds(engine, warm, f"warm-{m}")
        for n in lengths:
            for m in methods:
                ops.LONG_CHUNK_METHOD = m
                res[m]["ttft_s"][n] = first_token_seconds(engine, n, f"ttft-{m}-{n}")
                print(f"  long chunks by {m:12s} TTFT {n:7d}: {res[m]['ttft_s'][n]:8.3f} s",
                      flush=True)
                if n in profile_lengths and m == methods[-1]:
                    res[m]["profile"][n] = p = profile_prompt(engine, n)
                    cats = "  ".join(f"{c} {p['gpu_ms'][c]:.1f}" for c in CATEGORIES)
                    print(f"    GPU ms: {cats}  ({p['launches']} launches)", flush=True)
    finally:
        ops.LONG_CHUNK_METHOD = default
    return res


def by_checkpoint_interval(engine, intervals: list[str], lengths: list[int]) -> dict:
    """The same engine's TTFT with prefix-cache checkpoints every ``INTERVAL`` tokens of a
    prompt, modes alternating: ``INTERVAL`` takes the states inside a chunk from state
    taps, ``INTERVAL:cut`` ends a prefill chunk at each checkpoint instead (no tap slots)."""
    prefix = engine.prefix
    default = prefix.checkpoint_interval, prefix.num_tap_slots
    res: dict = {iv: {} for iv in intervals}
    try:
        for n in lengths:
            for iv in intervals:
                every, _, how = iv.partition(":")
                prefix.checkpoint_interval = int(every)
                prefix.num_tap_slots = 0 if how == "cut" else default[1]
                res[iv][n] = first_token_seconds(engine, n, f"interval-{every}{how}-{n}")
                print(f"  checkpoints every {iv:>10} tokens: TTFT {n:7d}: {res[iv][n]:8.3f} s",
                      flush=True)
    finally:
        prefix.checkpoint_interval, prefix.num_tap_slots = default
    return res


def _interval_label(iv: str) -> str:
    every, _, how = iv.partition(":")
    return f"every {every} tokens, {'chunks cut' if how == 'cut' else 'tapped'}: TTFT s"


def _by_method_section(c: dict) -> list[str]:
    """The report's tables of one config's TTFT by long-chunk method (none if not run)."""
    methods = c.get("ttft_by_method")
    if not methods:
        return []
    names = list(methods)
    lengths = list(methods[names[0]]["ttft_s"])
    out = [f"\n### Long chunks by method ({_label(c)}; the same engine, methods "
           "alternating)\n\n",
           _common.md_table(
               ["prompt", *(f"{m} TTFT s" for m in names),
                *(f"{names[0]} / {m}" for m in names[1:])],
               [[n, *(f"{methods[m]['ttft_s'][n]:.3f}" for m in names),
                 *(f"{methods[names[0]]['ttft_s'][n] / methods[m]['ttft_s'][n]:.2f}x"
                   for m in names[1:])] for n in lengths])]
    rows = [[m, n, f"{p['wall_ms_profiled']:.1f}",
             *(f"{p['gpu_ms'][cat]:.1f}" for cat in CATEGORIES), p["launches"]]
            for m in names for n, p in methods[m]["profile"].items()]
    if rows:
        out += ["\n", _common.md_table(
            ["method", "prompt", "wall ms", *(f"{cat} ms" for cat in CATEGORIES),
             "launches"], rows)]
    return out


def _by_interval_section(c: dict) -> list[str]:
    """The report's table of one config's TTFT by checkpoint interval (none if not run)."""
    by_iv = c.get("ttft_by_checkpoint_interval")
    if not by_iv:
        return []
    ivs = list(by_iv)
    return [f"\n### Prefix-cache checkpoints ({_label(c)}; state taps inside whole chunks, "
            "or chunks cut at each checkpoint; the same engine, modes alternating)\n\n",
            _common.md_table(["prompt", *(_interval_label(iv) for iv in ivs)],
                             [[n, *(f"{by_iv[iv][n]:.3f}" for iv in ivs)]
                              for n in by_iv[ivs[0]]])]


def run_hf(args, device: str, loaded) -> dict:
    """transformers' Qwen3.5 on the same weights (views of ``loaded``'s): time to the
    first token of one ``first_len``-token prompt, the median of five after two."""
    import json

    from bench_model import hf_sharing_weights

    raw = json.loads((loaded.path / "config.json").read_text()) if args.quick else \
        json.loads(presets.config_path("qwen3.5-27b").read_text())
    hf = hf_sharing_weights(loaded.model, raw.get("text_config", raw), torch.device(device))
    prompt = torch.randint(0, loaded.config.vocab_size, (1, args.first_len), device=device)
    times = []
    with torch.inference_mode():
        for _ in range(7):
            _sync()
            t = time.perf_counter()
            out = hf(input_ids=prompt, use_cache=False, logits_to_keep=1)
            int(out.logits[0, -1].argmax())
            times.append(time.perf_counter() - t)
    del hf
    gc.collect()
    ttft = sorted(times[2:])[len(times[2:]) // 2]
    print(f"transformers: {args.first_len}-token TTFT {ttft:.3f} s (median of 5)", flush=True)
    return {"prompt": args.first_len, "ttft_s": ttft, "attn_implementation": "sdpa"}


def _label(entry: dict) -> str:
    return (f"{entry['label']}: chunk {entry['prefill_chunk']} / idle "
            f"{entry['idle_prefill_chunk']} / budget {entry['max_num_batched_tokens']}")


def _phases(seconds: dict) -> str:
    return ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


# ---- report -----------------------------------------------------------------------------

def markdown(res: dict) -> str:
    meta = res["meta"]
    out = [f"# Prefill benchmark\n\n{meta['date']}, {meta['gpu']}, commit {meta['commit']}, "
           f"torch {meta['torch']}, triton {meta['triton']}.\n"]
    if res.get("op"):
        out.append("\n## Paged prefill attention vs SDPA flash (contiguous bf16)\n\n"
                   "One chunk of the 27B attention shape over a cached prefix; graph "
                   "replay, sides interleaved. TFLOP/s of causal FLOPs.\n\n")
        out.append(_common.md_table(
            ["K/V", "chunk", "prefix", "kernel in place us (TFLOP/s)",
             "dequantized, then kernel us (TFLOP/s)", "SDPA us (TFLOP/s)", "SDPA / in place",
             "SDPA / dequantized"],
            [[r["kv_type"], r["chunk"], r["prefix"],
              f"{r['us']['kernel']:.1f} ({r['tflops']['kernel']:.0f})",
              f"{r['us']['dequantized']:.1f} ({r['tflops']['dequantized']:.0f})",
              f"{r['us']['sdpa']:.1f} ({r['tflops']['sdpa']:.0f})",
              f"{r['ratio']:.2f}x", f"{r['dequantized_ratio']:.2f}x"] for r in res["op"]]))
        swept = [r for r in res["op"] if len(r["us"]) > 3]
        if swept:
            out.append("\nKernel launch configurations (BLOCK_M/BLOCK_N/warps/stages), us:\n\n")
            names = [k for k in swept[0]["us"] if k.startswith("kernel")]
            out.append(_common.md_table(["K/V", "chunk", "prefix", *names],
                                        [[r["kv_type"], r["chunk"], r["prefix"],
                                          *(f"{r['us'][k]:.1f}" for k in names)]
                                         for r in swept]))
    ttft = res.get("ttft")
    if ttft:
        weights = "FP8 weights quantized while loading, " if ttft.get("quantization") else ""
        out.append(f"\n## Time to first token, one prompt ({weights}{ttft['kv_type']} K/V)\n\n"
                   "Each engine warms up before it is ready; its first ten "
                   f"{ttft['configs'][0]['first_vs_tenth']['prompt']}-token requests "
                   "then run one after another.\n\n")
        out.append(_common.md_table(
            ["step sizes (chunk / idle chunk / budget)", "ready s (phases)",
             "first / tenth TTFT s", "first / tenth"],
            [[_label(c), f"{c['engine_ready_s']:.1f} ({_phases(c['startup_s'])})",
              f"{c['first_vs_tenth']['seconds'][0]:.3f} / "
              f"{c['first_vs_tenth']['seconds'][9]:.3f}",
              f"{c['first_vs_tenth']['ratio']:.2f}x"] for c in ttft["configs"]]))
        hf = res.get("hf")
        if hf:
            ours = min(c["first_vs_tenth"]["seconds"][9] for c in ttft["configs"])
            out.append(f"\ntransformers (sdpa, same weights), {hf['prompt']}-token prompt: "
                       f"{hf['ttft_s']:.3f} s; pagedserve (tenth request): {ours:.3f} s "
                       f"({hf['ttft_s'] / ours:.2f}x faster).\n")
        out.append("\n")
        rows = []
        for c in ttft["configs"]:
            for n, s in c["ttft_s"].items():
                f = c["floors_ms"][n]
                floor = (f["gemm"] + f["attention"]) / 1e3
                rows.append([_label(c), n, f"{s:.3f}", f"{floor:.3f}", f"{floor / s:.0%}"])
        out.append(_common.md_table(
            ["step sizes", "prompt", "TTFT s", "compute floor s", "of floor"], rows))
        out.append("\n### GPU time by part (profiled; kernel time summed)\n\n")
        rows = []
        for c in ttft["configs"]:
            for n, p in c["profile"].items():
                f = c["floors_ms"][n]
                g = p["gpu_ms"]
                rows.append([_label(c), n, f"{p['wall_ms_profiled']:.1f}",
                             f"{g['gemm']:.1f} ({f['gemm']:.1f})",
                             f"{g['attention']:.1f} ({f['attention']:.1f})",
                             f"{g['gdn']:.1f}", f"{g['other']:.1f}", p["launches"]])
        out.append(_common.md_table(
            ["step sizes", "prompt", "wall ms", "GEMM ms (floor)", "attention ms (floor)",
             "GDN ms", "other ms", "launches"], rows))
        for c in ttft["configs"]:
            out += _by_method_section(c) + _by_interval_section(c)
    return "".join(out)


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for c in res.get("ttft", {}).get("configs", []):
        xs = sorted(int(n) for n in c["ttft_s"])
        ax.plot(xs, [c["ttft_s"][n] for n in xs], marker="o",
                label=_label(c))
        floor = [(c["floors_ms"][n]["gemm"] + c["floors_ms"][n]["attention"]) / 1e3
                 for n in xs]
    if res.get("ttft", {}).get("configs"):
        ax.plot(xs, floor, linestyle="--", color="grey", label="compute floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("TTFT (s)")
    ax.legend()
    ax.set_title(f"Prefill TTFT, {res['meta']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_configs(text: str) -> list[tuple[int, int, int] | None]:
    """``defaults`` (the engine's own step sizes) or CHUNK/IDLE/BUDGET, comma-separated."""
    return [None if item == "defaults" else tuple(int(v) for v in item.split("/"))
            for item in text.split(",")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="op,ttft,hf")
    ap.add_argument("--quick", action="store_true", help="CPU dry run on the tiny random model")
    ap.add_argument("--kv-type", default="q8_0")
    ap.add_argument("--quantization", choices=["fp8"], default=None,
                    help="ttft: quantize the weights while loading (the engine's flag)")
    ap.add_argument("--lengths", default="512,8192,32768,131072")
    ap.add_argument("--configs", default="defaults,512/16384/16384",
                    help="'defaults' or PREFILL_CHUNK/IDLE_PREFILL_CHUNK/BUDGET, comma-separated")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--first-len", type=int, default=512,
                    help="prompt of the first-vs-tenth requests and of transformers")
    ap.add_argument("--profile-lengths", default="512,8192")
    ap.add_argument("--max-length-for", default="",
                    help="IDLE_CHUNK:LONGEST, the longest prompt timed with that idle chunk")
    ap.add_argument("--long-chunk-methods", default="",
                    help="ttft: also time each of these methods for long chunks "
                         "(e.g. dequantized,cudnn) in each engine, alternating")
    ap.add_argument("--checkpoint-intervals", default="",
                    help="e.g. 2048:cut,2048,8192: TTFT with each prefix-cache checkpoint "
                         "interval, the states inside a chunk from state taps (':cut': "
                         "chunks end at each checkpoint instead)")
    ap.add_argument("--op-types", default="bf16,q8_0,q4_0")
    ap.add_argument("--op-cases", default="4096x0,4096x8192,4096x32768,4096x131072",
                    help="CHUNKxPREFIX of the op part")
    ap.add_argument("--sweep", default="",
                    help="more kernel launch configs BM/BN/WARPS/STAGES, ';'-separated")
    ap.add_argument("--sweep-cases", default="4096x32768,512x0")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args(argv)
    args.lengths = [int(v) for v in args.lengths.split(",")]
    args.profile_lengths = {int(v) for v in args.profile_lengths.split(",") if v}
    args.long_chunk_methods = [m for m in args.long_chunk_methods.split(",") if m]
    args.checkpoint_intervals = [v for v in args.checkpoint_intervals.split(",") if v]
    args.configs = parse_configs(args.configs)
    args.sweep = [tuple(int(v) for v in c.split("/")) for c in args.sweep.split(";") if c]
    args.sweep_cases = {tuple(int(v) for v in c.split("x")) for c in args.sweep_cases.split(",")}
    args.max_length_for = dict(tuple(int(v) for v in item.split(":"))
                               for item in args.max_length_for.split(",") if item)
    device = "cuda" if torch.cuda.is_available() and not args.quick else "cpu"
    if args.quick:
        args.lengths, args.configs = [16, 48], [None, (16, 32, 32)]
        args.profile_lengths, args.first_len, args.max_num_seqs = {48}, 24, 4
    parts = set(args.parts.split(","))
    res = {"meta": _common.run_meta()}
    if "op" in parts:
        res["op"] = run_op(args, device)
    if parts & {"ttft", "hf"}:
        from pagedserve.model.loader import load_model
        from pagedserve.model.random_checkpoint import random_model_path

        model = random_model_path() if args.quick else "preset:qwen3.5-27b"
        loaded = load_model(model, device, None if args.quick else "bfloat16", progress=False,
                            quantization=args.quantization)
    if "ttft" in parts:
        res["ttft"] = run_ttft(args, device, loaded) | {
            "kv_type": args.kv_type, "quantization": args.quantization}
    if "hf" in parts:
        res["hf"] = run_hf(args, device, loaded)
    paths = _common.write_outputs(args.out, "prefill", res, markdown(res),
                                  lambda p: figure(res, p))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
