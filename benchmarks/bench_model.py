"""Whole-model benchmark of issue 4: single-sequence decode and prefill, against transformers.

One run on one GPU, Qwen3.5-27B shape (``pagedserve/presets/qwen3.5-27b.json``) with random
bf16 weights created directly on the GPU (nothing on disk). transformers'
``Qwen3_5ForCausalLM`` is built on the meta device and its parameters are made *views of
pagedserve's tensors* (the fused projections are row-concatenations of the checkpoint's, so
every HF weight is a row slice of one of ours): both models run the same weights, and only
one copy (~54 GB) is held.

Measured, per context (default 512 and 8192 prompt tokens; the context is filled by a real
prefill of random token ids):

- prefill: wall time of the whole prompt in one forward (last-token logits only), after a
  warm-up prefill of the same length;
- decode: ms/step over N greedy steps, host loop included -- what a generating user waits
  per token. pagedserve runs one request through ``LLMEngine.step()``, with async
  scheduling (the default on CUDA) and, in the same run, without it;
- the weight-read floor: weight bytes / measured copy bandwidth.

    python benchmarks/bench_model.py [--quick] [--contexts 512,8192] [--decode-steps N]
        [--kv-type f16] [--no-graphs] [--skip-hf] [--out DIR]

Writes DIR/model.{md,json,png} (default docs/benchmarks), copies them to $OUT when set, and
prints a short table last. ``--device cpu --preset FILE`` runs a tiny preset on the CPU
(a smoke test of this script; no timings worth reporting).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from pagedserve.config import ModelConfig  # noqa: E402
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402
from pagedserve.model.loader import GenerationDefaults, LoadedModel  # noqa: E402
from pagedserve.model.qwen3_5 import Qwen3_5Model  # noqa: E402
from pagedserve.model.random_weights import random_model, set_param  # noqa: E402
from pagedserve.model.weights import packed_sources  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PRESET = ROOT / "pagedserve" / "presets" / "qwen3.5-27b.json"
HF_MS_PER_STEP_REFERENCE = 129.8  # shared/BENCHMARKS.md, H200, bs=1 after 512 tokens
TARGET_MS = 16.0


# ---- models sharing one set of weights ---------------------------------------------------


@torch.no_grad()
def hf_sharing_weights(model: Qwen3_5Model, raw_config: dict, device: torch.device):
    """transformers' Qwen3_5ForCausalLM whose every parameter is a view of ``model``'s."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

    keep = {k: v for k, v in raw_config.items() if k not in ("architectures", "torch_dtype")}
    hf_cfg = Qwen3_5TextConfig(**keep)
    hf_cfg._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = Qwen3_5ForCausalLM(hf_cfg)
    hf_params = dict(hf.named_parameters())
    ours = dict(model.named_parameters())
    assigned = set()
    for name, sources in packed_sources(model).items():
        row = 0
        for src in sources:
            hf_name = src if src == "lm_head.weight" else "model." + src
            shape = hf_params[hf_name].shape
            view = ours[name][row : row + shape[0]].view(shape)
            set_param(hf, hf_name, view)
            assigned.add(hf_name)
            row += shape[0]
    if model.lm_head is None:
        hf.lm_head.weight = hf.model.embed_tokens.weight
        assigned.add("lm_head.weight")
    missing = set(hf_params) - assigned
    if missing:
        raise RuntimeError(f"HF parameters without a pagedserve tensor: {sorted(missing)[:5]}")
    hf.model.rotary_emb = Qwen3_5TextRotaryEmbedding(config=hf_cfg).to(device)
    meta = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"HF tensors left on the meta device: {meta[:5]}")
    hf.generation_config.eos_token_id = None
    return hf.eval()


# ---- timing ------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_ours(engine: LLMEngine, prompt: list[int], steps: int, lookahead: bool) -> dict:
    """One greedy request through ``LLMEngine.step()``: the prompt in one prefill chunk,
    then ``steps`` decode steps, with async scheduling on (``lookahead``) or off."""
    engine.async_scheduling = lookahead
    req = engine.add_request(f"r{engine.stats.num_steps}", prompt, SamplingParams(
        max_tokens=steps + 1, temperature=0.0, ignore_eos=True))
    _sync(engine.runner.device)
    t0 = time.perf_counter()
    while not req.output_token_ids:
        engine.step()
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    _sync(engine.runner.device)
    decode_ms = (time.perf_counter() - t0) * 1e3 / max(steps, 1)
    return {"prefill_s": prefill_s, "decode_ms_per_step": decode_ms,
            "tokens": list(req.output_token_ids)}


@torch.inference_mode()
def run_hf(hf, prompt: list[int], steps: int, device: torch.device) -> dict:
    from transformers import DynamicCache

    cache = DynamicCache(config=hf.config)
    ids = torch.tensor([prompt], device=device)
    _sync(device)
    t0 = time.perf_counter()
    out = hf(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    tok = int(out.logits[0, -1].argmax())
    _sync(device)
    prefill_s = time.perf_counter() - t0
    tokens = [tok]
    t0 = time.perf_counter()
    for _ in range(steps):
        out = hf(input_ids=torch.tensor([[tok]], device=device), past_key_values=cache,
                 use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        tokens.append(tok)
    _sync(device)
    decode_ms = (time.perf_counter() - t0) * 1e3 / max(steps, 1)
    return {"prefill_s": prefill_s, "decode_ms_per_step": decode_ms, "tokens": tokens}


def _prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


# ---- report ------------------------------------------------------------------------------


def _same_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def report(results: dict) -> str:
    floor = results.get("floor_ms")
    rows = []
    for r in results["contexts"]:
        ours, hf = r["ours"], r.get("hf") or {}
        hf_ms = hf.get("decode_ms_per_step")
        rows.append([
            r["context"], f"{ours['decode_ms_per_step']:.2f}",
            f"{ours['sync_decode_ms_per_step']:.2f}",
            f"{hf_ms:.1f}" if hf_ms else "-",
            f"{hf_ms / ours['decode_ms_per_step']:.1f}x" if hf_ms else "-",
            f"{floor / ours['decode_ms_per_step']:.0%}" if floor else "-",
            f"{ours['prefill_s']:.3f}", f"{hf['prefill_s']:.3f}" if hf else "-",
            r.get("greedy_same_prefix", "-"),
        ])
    header = ["context", "ours ms/step", "ours ms/step, sync", "HF ms/step", "speed-up",
              "floor / ours", "ours prefill s", "HF prefill s", "same greedy prefix"]
    meta = results["meta"]
    lines = [
        "# Whole-model benchmark (issue 4)", "",
        f"{meta.get('date')}, {meta.get('gpu')}, commit {meta.get('commit')}, "
        f"torch {meta.get('torch')}.", "",
        f"Qwen3.5-27B shape, random bf16 weights shared by both models "
        f"({results['weights_gb']:.1f} GB), batch size 1, K/V {results['kv_type']} "
        f"({results['layout']}), compiled elementwise ops: {results['compile']}, "
        f"CUDA graphs: {results['cuda_graphs']}.",
        f"Weight-read floor: {floor:.2f} ms/step at {results['copy_gbs']:.0f} GB/s copy "
        f"bandwidth. Target: <= {TARGET_MS} ms/step and prefill no slower than HF." if floor
        else "", "",
        _common.md_table(header, rows), "",
        "ours: one greedy request through `LLMEngine.step()` (scheduler, batch build, "
        "CUDA-graph forward, argmax, read-back), wall time per decode step. 'sync' turns "
        "async scheduling off: each step's token is read back before the next step is "
        "launched. Prefill: the whole prompt in one chunk, to the first token. Contexts are "
        "filled by a real prefill.",
        "",
    ]
    return "\n".join(lines)


def figure(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ctx = [str(r["context"]) for r in results["contexts"]]
    ours = [r["ours"]["decode_ms_per_step"] for r in results["contexts"]]
    hf = [(r.get("hf") or {}).get("decode_ms_per_step", 0) for r in results["contexts"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    x = range(len(ctx))
    a.bar([i - 0.2 for i in x], ours, 0.4, label="pagedserve")
    a.bar([i + 0.2 for i in x], hf, 0.4, label="transformers")
    if results.get("floor_ms"):
        a.axhline(results["floor_ms"], color="k", ls="--", lw=1, label="weight-read floor")
    a.axhline(TARGET_MS, color="r", ls=":", lw=1, label="target")
    a.set_xticks(list(x), ctx)
    a.set_xlabel("prompt tokens")
    a.set_ylabel("decode ms/step (bs=1)")
    a.set_yscale("log")
    a.legend()
    b.bar([i - 0.2 for i in x], [r["ours"]["prefill_s"] for r in results["contexts"]], 0.4,
          label="pagedserve")
    b.bar([i + 0.2 for i in x], [(r.get("hf") or {}).get("prefill_s", 0)
                                 for r in results["contexts"]], 0.4, label="transformers")
    b.set_xticks(list(x), ctx)
    b.set_xlabel("prompt tokens")
    b.set_ylabel("prefill s")
    b.legend()
    fig.suptitle(f"Qwen3.5-27B shape, {results['meta'].get('gpu')}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---- main --------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer decode steps (<= 8 min)")
    p.add_argument("--contexts", default="512,8192")
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--hf-decode-steps", type=int, default=None)
    p.add_argument("--kv-type", default="f16")
    p.add_argument("--layout", default="paged", choices=["paged", "contiguous"])
    p.add_argument("--no-graphs", action="store_true")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--preset", type=Path, default=PRESET)
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = p.parse_args(argv)
    steps = args.decode_steps or (32 if args.quick else 128)
    hf_steps = args.hf_decode_steps or (12 if args.quick else 48)
    contexts = [int(c) for c in args.contexts.split(",")]
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    raw = json.loads(args.preset.read_text())
    cfg = ModelConfig.from_hf_dict(raw)
    cuda = device.type == "cuda"
    meta = _common.run_meta() if cuda else {"gpu": "cpu (smoke test)", "commit": "-"}
    copy_gbs = _common.copy_bandwidth_gbs() if cuda else None

    t0 = time.perf_counter()
    model = random_model(cfg, device, dtype)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    print(f"random weights: {weights / 1e9:.1f} GB in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    loaded = LoadedModel(args.preset.parent, cfg, model, None, GenerationDefaults(), weights,
                         device, dtype)
    longest = max(contexts)
    engine = LLMEngine(EngineConfig(
        device=str(device), cache_type_k=args.kv_type, cache_type_v=args.kv_type,
        kv_layout=args.layout, max_model_len=longest + steps + 64, max_num_seqs=1,
        max_num_batched_tokens=longest, prefill_chunk=longest,
        cuda_graphs=not args.no_graphs, progress=False), loaded=loaded)
    graphs = engine.runner.graphs is not None
    print(f"engine ready in {time.perf_counter() - t0:.1f} s (graphs: {graphs})")
    hf = None if args.skip_hf else hf_sharing_weights(model, raw, device)

    results = {
        "meta": meta, "weights_gb": weights / 1e9, "kv_type": args.kv_type,
        "layout": args.layout, "compile": cuda,
        "cuda_graphs": graphs, "copy_gbs": copy_gbs,
        "floor_ms": weights / (copy_gbs * 1e9) * 1e3 if copy_gbs else None,
        "decode_steps": steps, "hf_decode_steps": hf_steps, "contexts": [],
    }
    for i, length in enumerate(contexts):
        prompt = _prompt(length, cfg.vocab_size, seed=i)
        run_ours(engine, prompt, 4, lookahead=True)  # warm-up: compiles, autotunes
        ours = run_ours(engine, prompt, steps, lookahead=True)
        ours["sync_decode_ms_per_step"] = run_ours(
            engine, prompt, steps, lookahead=False)["decode_ms_per_step"]
        entry = {"context": length, "ours": ours}
        print(f"ctx {length}: ours prefill {ours['prefill_s']:.3f} s, decode "
              f"{ours['decode_ms_per_step']:.2f} ms/step "
              f"({ours['sync_decode_ms_per_step']:.2f} without async scheduling)")
        if hf is not None:
            run_hf(hf, prompt, 2, device)
            entry["hf"] = run_hf(hf, prompt, hf_steps, device)
            entry["greedy_same_prefix"] = _same_prefix(ours["tokens"], entry["hf"]["tokens"])
            print(f"ctx {length}: HF prefill {entry['hf']['prefill_s']:.3f} s, "
                  f"decode {entry['hf']['decode_ms_per_step']:.1f} ms/step")
        results["contexts"].append(entry)
        # Written after every context, so a run cut short still leaves its numbers.
        _common.write_outputs(args.out, "model", results, report(results),
                              lambda path: figure(results, path))
        if cuda:
            torch.cuda.empty_cache()

    markdown = report(results)
    _common.write_outputs(args.out, "model", results, markdown,
                          lambda path: figure(results, path))
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
