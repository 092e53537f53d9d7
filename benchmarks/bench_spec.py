"""Speculative decoding's cost side (issue 39): what a verify step and the MTP drafts cost
against a plain decode step, on the Qwen3.5-27B shape.

One run on one GPU, random bf16 weights with a random one-layer MTP head (``--model
preset:qwen3.5-27b``). For each batch size B (1, 8, 16), every sequence with an 8K context
already in the K/V pool (its values are irrelevant: a step reads the same bytes whatever
they hold), timed side by side in one run:

- **decode**: one row per sequence through ``ModelRunner.execute``, the CUDA graph that
  plain decoding replays;
- **verify k**: k + 1 rows per sequence, eagerly (``forward_hidden``, then the head over
  every row), as ``engine/spec_step.py`` runs a verify step, for k = 1..4;
- **draft k**: k passes of the MTP head over one row per sequence, each through the
  drafter's head (``ModelRunner.draft_logits``: the shared lm_head, or its rows of a draft
  vocabulary with ``--draft-vocab-size``), as ``MTPDrafter.propose`` chains them.

Reported per (B, k): each step's ms, ``(draft + verify) / decode``, and the speed-up that
these costs predict at per-token acceptance a = 0.5, 0.7, 0.9: expected tokens per step
``(1 - a^(k+1)) / (1 - a)`` over the step's cost in decode steps. Two predictions: without
the rollback's cost (an upper bound), and with a rollback costed as one more verify step
whenever a draft is rejected (probability ``1 - a^k``; a lower bound on speed, since a
rollback runs only the Gated DeltaNet layers' conv and delta rule over the kept rows).
``bench_spec_e2e.py`` measures the end-to-end side.

``--quick`` runs the tests' tiny random model with a random MTP head on the CPU (a smoke test;
its numbers mean nothing). Writes ``spec.{md,json,png}`` (``spec_quick`` with
``--quick``; ``_draft{N}`` appended with ``--draft-vocab-size N``) to ``--out`` (default
``docs/benchmarks``; copies to ``$OUT``).
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch  # noqa: E402
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.model.loader import LoadedModel, load_model  # noqa: E402
from pagedserve.model.mtp import SUPPORTED_MTP_LAYERS  # noqa: E402
from pagedserve.model.random_checkpoint import random_model_path  # noqa: E402
from pagedserve.model.random_weights import random_model  # noqa: E402

ACCEPTANCE = (0.5, 0.7, 0.9)
MAX_K = 4


def expected_tokens(a: float, k: int) -> float:
    """Tokens a verify step of k drafts yields at per-token acceptance ``a``: the kept run
    plus the bonus token, ``sum_{i=0..k} a^i``."""
    return sum(a ** i for i in range(k + 1))


def predictions(decode_ms: float, verify_ms: float, draft_ms: float, k: int) -> dict:
    """Predicted speed-ups over plain decoding at each acceptance (module doc)."""
    out = {}
    for a in ACCEPTANCE:
        tokens = expected_tokens(a, k)
        step = draft_ms + verify_ms
        out[str(a)] = {
            "tokens_per_step": tokens,
            "speedup_no_replay": tokens * decode_ms / step,
            "speedup_with_replay": tokens * decode_ms / (step + (1 - a ** k) * verify_ms),
        }
    return out


def tiny_with_mtp() -> LoadedModel:
    """The tests' tiny random checkpoint with a seeded random MTP head."""
    base = load_model(random_model_path(), "cpu", torch.float32, progress=False)
    cfg = dataclasses.replace(base.config, mtp_num_hidden_layers=SUPPORTED_MTP_LAYERS)
    return dataclasses.replace(base, config=cfg,
                               model=random_model(cfg, torch.device("cpu"), torch.float32,
                                                  mtp=True))


class Sequences:
    """``n`` sequences of ``context`` tokens in the engine's pools, each with ``MAX_K + 1``
    more rows reserved; the batches of the timed steps over the first ``b`` of them."""

    def __init__(self, engine: LLMEngine, n: int, context: int) -> None:
        self.engine, self.context = engine, context
        kv, states = engine.kv, engine.runner.state_pool
        self.handles, self.slots = [], []
        for _ in range(n):
            h = kv.create()
            assert kv.append(h, context) and kv.reserve(h, MAX_K + 1)
            self.handles.append(h)
            self.slots.append(states.slot(states.acquire()))

    def batch(self, b: int, rows: int):
        chunks = [SeqChunk(h, s, tuple(range(1, rows + 1)), self.context)
                  for h, s in zip(self.handles[:b], self.slots[:b])]
        return build_forward_batch(chunks, self.engine.kv, self.engine.runner.device)


def run(args) -> dict:
    meta = _common.run_meta()
    if args.quick:
        loaded, device = tiny_with_mtp(), "cpu"
    else:
        loaded = load_model(args.model, "cuda", torch.bfloat16, progress=False, mtp=True)
        device = "cuda"
    spec = {"method": "mtp", "num_speculative_tokens": MAX_K}
    if args.draft_vocab_size is not None:
        spec["draft_vocab_size"] = args.draft_vocab_size
    engine = LLMEngine(EngineConfig(
        model=args.model, device=device, max_model_len=args.context + 64,
        max_num_seqs=max(args.batches), cache_type_k=args.kv_type, cache_type_v=args.kv_type,
        speculative_config=spec, warm_up=False, progress=False), loaded=loaded)
    runner = engine.runner
    assert runner.draft_head is not None
    seqs = Sequences(engine, max(args.batches), args.context)
    hidden_size = loaded.config.hidden_size
    results = {"meta": meta, "model": "tiny random + random MTP (CPU quick run)"
               if args.quick else args.model, "context": args.context,
               "kv_type": args.kv_type, "draft_vocab_rows": runner.draft_head.num_rows,
               "vocab_size": loaded.config.vocab_size, "points": []}
    for b in args.batches:
        decode = seqs.batch(b, 1)
        hidden = torch.zeros(b, hidden_size, dtype=next(loaded.model.parameters()).dtype,
                             device=runner.device)
        sides = {"decode": [lambda d=decode: runner.execute(d)]}
        for k in range(1, MAX_K + 1):
            verify = seqs.batch(b, k + 1)
            sides[f"verify {k}"] = [
                lambda v=verify: runner.compute_logits(runner.forward_hidden(v))]
            sides[f"draft {k}"] = [
                lambda n=k, d=decode, h=hidden: [
                    runner.draft_logits(runner.mtp_forward(d, h)) for _ in range(n)]]
        us = _common.time_sides(sides, "eager")
        ms = {name: t / 1e3 for name, t in us.items()}
        point = {"batch": b, "decode_ms": ms["decode"], "k": {}}
        for k in range(1, MAX_K + 1):
            v, d = ms[f"verify {k}"], ms[f"draft {k}"]
            point["k"][str(k)] = {"verify_ms": v, "draft_ms": d,
                                  "cost_in_decode_steps": (v + d) / ms["decode"],
                                  "predicted": predictions(ms["decode"], v, d, k)}
        results["points"].append(point)
        print(f"B={b:2d} decode {ms['decode']:.2f} ms; " + "; ".join(
            f"k={k}: verify {ms[f'verify {k}']:.2f} + draft {ms[f'draft {k}']:.2f} ms"
            for k in range(1, MAX_K + 1)))
    return results


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        "# Speculative decoding: the cost side", "",
        _common.meta_line(m), "",
        f"Model {res['model']}, K/V {res['kv_type']}, every sequence at a "
        f"{res['context']}-token context; drafts over {res['draft_vocab_rows']} of "
        f"{res['vocab_size']} token ids. Decode: the CUDA graph of a plain step; verify "
        "and draft: eager, as speculative steps run (see the script's docstring). "
        "Speed-ups are predicted from these costs, not measured end to end: without the "
        "rollback's cost (upper bound) / with a rollback costed as one more verify step "
        "after any rejection (lower bound).", "",
        "| B | k | decode ms | verify ms | draft ms | (verify + draft) / decode | "
        + " | ".join(f"a={a}" for a in ACCEPTANCE) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(ACCEPTANCE),
    ]
    for p in res["points"]:
        for k, r in p["k"].items():
            pred = " | ".join(f"{r['predicted'][str(a)]['speedup_no_replay']:.2f}x / "
                              f"{r['predicted'][str(a)]['speedup_with_replay']:.2f}x"
                              for a in ACCEPTANCE)
            lines.append(f"| {p['batch']} | {k} | {p['decode_ms']:.2f} | {r['verify_ms']:.2f}"
                         f" | {r['draft_ms']:.2f} | {r['cost_in_decode_steps']:.2f} | {pred} |")
    lines += ["", "Target (issue 39, k = 3, a = 0.7, measured end to end): >= 2.0x at "
              "batch 1, >= 1.3x at batch 8.", ""]
    return "\n".join(lines)


def figure(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for p in res["points"]:
        ks = [int(k) for k in p["k"]]
        ax.plot(ks, [p["k"][str(k)]["cost_in_decode_steps"] for k in ks], marker="o",
                label=f"B={p['batch']}")
    ax.set_xlabel("draft tokens k")
    ax.set_ylabel("(verify + draft) / decode step")
    ax.set_title("speculative step cost, in plain decode steps")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = _common.model_parser(__doc__, "the tiny random model on the CPU (a smoke test)")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="draft over a vocabulary subset (speculative-config draft_vocab_size)")
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in str(args.batches).split(",") if b]
    if args.quick:
        args.kv_type, args.context, args.batches, args.model = "f16", 40, [1, 2], None
    elif not torch.cuda.is_available():
        print("bench_spec needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    res = run(args)
    stem = "spec_quick" if args.quick else "spec"
    if args.draft_vocab_size is not None:
        stem += f"_draft{args.draft_vocab_size}"
    return _common.report(args.out, stem, res, markdown(res), lambda p: figure(res, p))


if __name__ == "__main__":
    sys.exit(main())
