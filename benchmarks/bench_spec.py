"""Speculative decoding's cost side (issue 39): what a verify step and the MTP drafts cost
against a plain decode step, on the Qwen3.5-27B shape.

One run on one GPU, random bf16 weights with a random one-layer MTP head (``--model
preset:qwen3.5-27b``). For each batch size B (1, 8, 16), every sequence with an 8K context
already in the K/V pool (its values are irrelevant: a step reads the same bytes whatever
they hold), timed side by side in one run:

- **decode**: one row per sequence through ``ModelRunner.execute``, the CUDA graph that
  plain decoding replays;
- **verify**: k + 1 rows per sequence through the runner's verify graph (``runner.verify``),
  as a steady speculative step replays it;
- **rollback**: the rollback graph after that replay, every sequence keeping k rows (the
  longest re-advance of the Gated DeltaNet states);
- **draft**: the drafter's graphs as a step chains them: the observe pass over the k + 1
  verified rows (its tails' draft logits give the first draft), then k - 1 propose passes
  of the MTP head, each through the drafter's head (the shared lm_head, or its rows of a
  draft vocabulary with ``--draft-vocab-size``).

One engine per k (its graphs are captured for k + 1 rows), the sides of each (B, k) timed
side by side. Reported per (B, k): each side's GPU ms, ``(verify + draft) / decode``, and
the speed-up these times predict at per-token acceptance a = 0.5, 0.7, 0.9: expected
tokens per step ``(1 - a^(k+1)) / (1 - a)`` over the step's time in decode steps, with the
rollback counted whenever some sequence of the batch rejects a draft (probability
``1 - a^(kB)``). The host's work between the replays is not counted; ``bench_spec_e2e.py``
measures the end-to-end side.

``--quick`` runs the tests' tiny random model with a random MTP head on the CPU (a smoke test;
its numbers mean nothing). Writes ``spec.{md,json,png}`` (``spec_quick`` with
``--quick``; ``_draft{N}`` appended with ``--draft-vocab-size N``) to ``--out`` (default
``docs/benchmarks``; copies to ``$OUT``).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from pagedserve.engine.batch_builder import SeqChunk, build_forward_batch  # noqa: E402
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.model.forward_batch import ForwardBatch  # noqa: E402
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


def predictions(decode_ms: float, verify_ms: float, draft_ms: float, rollback_ms: float,
                k: int, batch: int) -> dict:
    """Predicted speed-ups over plain decoding at each acceptance (module doc)."""
    out = {}
    for a in ACCEPTANCE:
        tokens = expected_tokens(a, k)
        any_rejects = 1 - a ** (k * batch)
        step = verify_ms + draft_ms + any_rejects * rollback_ms
        out[str(a)] = {"tokens_per_step": tokens, "step_ms": step,
                       "speedup": tokens * decode_ms / step}
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

    def batch(self, b: int, rows: int) -> ForwardBatch:
        chunks = [SeqChunk(h, s, tuple(range(1, rows + 1)), self.context)
                  for h, s in zip(self.handles[:b], self.slots[:b])]
        return build_forward_batch(chunks, self.engine.kv, self.engine.runner.device)


def step_sides(engine: LLMEngine, seqs: Sequences, b: int, k: int,
               hidden_size: int) -> dict[str, list]:
    """The timed calls at batch ``b`` with ``k`` drafts, as a speculative step makes them:
    through the runner's verify, rollback and draft graphs where they are captured (CUDA),
    else eagerly (the CPU's quick run, which has no rollback side)."""
    runner, kv = engine.runner, engine.kv
    decode, verify = seqs.batch(b, 1), seqs.batch(b, k + 1)
    dtype = next(runner.model.parameters()).dtype
    rows_hidden = torch.zeros(b * (k + 1), hidden_size, dtype=dtype,
                              device=runner.device)  # [b (k + 1), H]
    sides: dict[str, list] = {"decode": [lambda: runner.execute(decode)]}
    graphs = runner.draft_graphs
    if runner.verify_graphs is not None and runner.verify_graphs.fits(verify) \
            and graphs is not None:
        def verify_graphed() -> None:
            runner.verify(verify)

        def roll_back() -> None:
            runner.roll_back_verify([k] * b)  # k kept rows: the longest re-advance

        kv_rows = [[seqs.context + j for j in range(k - 1)] for _ in range(b)]
        kv_slots = [[kv.slot_of(h, r) for r in rs] for h, rs in zip(seqs.handles, kv_rows)]

        def draft_graphed() -> None:
            tail_hidden, tail_logits = graphs.observe.run(verify, rows_hidden)
            if graphs.propose is not None:
                size = graphs.propose.load(tail_hidden, tail_logits, kv_rows, kv_slots,
                                           verify.block_tables)
                for j in range(1, k):
                    graphs.propose.replay(size, j)

        runner.verify(verify)  # the replay the rollback graph reads
        sides.update(verify=[verify_graphed], rollback=[roll_back], draft=[draft_graphed])
        return sides
    ends = [q - 1 for q in verify.query_start_loc_cpu[1:]]

    def draft_eager() -> None:
        tails = runner.mtp_forward(verify, rows_hidden)[ends]  # [b, H]
        runner.draft_logits(tails)
        for _ in range(k - 1):
            tails = runner.mtp_forward(decode, tails)
            runner.draft_logits(tails)

    sides.update(verify=[lambda: runner.compute_logits(runner.forward_hidden(verify))],
                 draft=[draft_eager])
    return sides


def run(args: argparse.Namespace) -> dict:
    meta = _common.run_meta()
    if args.quick:
        loaded, device = tiny_with_mtp(), "cpu"
    else:
        loaded = load_model(args.model, "cuda", torch.bfloat16, progress=False, mtp=True)
        device = "cuda"
    hidden_size = loaded.config.hidden_size
    results = {"meta": meta, "model": "tiny random + random MTP (CPU quick run)"
               if args.quick else args.model, "context": args.context,
               "kv_type": args.kv_type, "vocab_size": loaded.config.vocab_size,
               "points": []}
    points = {b: {"batch": b, "k": {}} for b in args.batches}
    for k in range(1, MAX_K + 1):
        spec = {"method": "mtp", "num_speculative_tokens": k}
        if args.draft_vocab_size is not None:
            spec["draft_vocab_size"] = args.draft_vocab_size
        engine = LLMEngine(EngineConfig(
            model=args.model, device=device, max_model_len=args.context + 64,
            max_num_seqs=max(args.batches), cache_type_k=args.kv_type,
            cache_type_v=args.kv_type, speculative_config=spec, warm_up=False,
            progress=False), loaded=loaded)
        assert engine.runner.draft_head is not None
        results["draft_vocab_rows"] = engine.runner.draft_head.num_rows
        results["graphs"] = engine.runner.verify_graphs is not None
        seqs = Sequences(engine, max(args.batches), args.context)
        for b in args.batches:
            us = _common.time_sides(step_sides(engine, seqs, b, k, hidden_size), "eager")
            ms = {name: t / 1e3 for name, t in us.items()}
            rollback = ms.get("rollback", 0.0)
            points[b]["k"][str(k)] = {
                "decode_ms": ms["decode"], "verify_ms": ms["verify"], "draft_ms": ms["draft"],
                "rollback_ms": ms.get("rollback"),
                "cost_in_decode_steps": (ms["verify"] + ms["draft"]) / ms["decode"],
                "predicted": predictions(ms["decode"], ms["verify"], ms["draft"], rollback,
                                         k, b)}
            print(f"B={b:2d} k={k}: decode {ms['decode']:.2f} ms, verify {ms['verify']:.2f}"
                  f" ms, draft {ms['draft']:.2f} ms, rollback {rollback:.2f} ms", flush=True)
        del engine, seqs
        _common.free_device_memory()
    results["points"] = list(points.values())
    return results


def markdown(res: dict) -> str:
    m = res["meta"]
    how = ("verify, rollback and draft: the CUDA graphs a steady speculative step replays"
           if res["graphs"] else "verify and draft: eager (no graphs on the CPU)")
    lines = [
        "# Speculative decoding: the cost side", "",
        _common.meta_line(m), "",
        f"Model {res['model']}, K/V {res['kv_type']}, every sequence at a "
        f"{res['context']}-token context; drafts over {res['draft_vocab_rows']} of "
        f"{res['vocab_size']} token ids. Decode: the CUDA graph of a plain step; {how} "
        "(see the script's docstring). Rollback: k kept rows, the longest re-advance. "
        "Speed-ups are predicted from these GPU times, not measured end to end "
        "(`bench_spec_e2e.py` does): tokens per step over (verify + draft + rollback "
        "whenever a sequence of the batch rejects a draft), in decode steps.", "",
        "| B | k | decode ms | verify ms | draft ms | rollback ms | (verify + draft) / decode | "
        + " | ".join(f"a={a}" for a in ACCEPTANCE) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(ACCEPTANCE),
    ]
    for p in res["points"]:
        for k, r in p["k"].items():
            pred = " | ".join(f"{r['predicted'][str(a)]['speedup']:.2f}x" for a in ACCEPTANCE)
            rollback = "-" if r["rollback_ms"] is None else f"{r['rollback_ms']:.2f}"
            lines.append(f"| {p['batch']} | {k} | {r['decode_ms']:.2f} | {r['verify_ms']:.2f}"
                         f" | {r['draft_ms']:.2f} | {rollback} | "
                         f"{r['cost_in_decode_steps']:.2f} | {pred} |")
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
