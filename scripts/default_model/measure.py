"""pagedserve's figures on a trained default-model checkpoint, for its model card.

    python scripts/default_model/measure.py DIR [--write-card] [--draft-vocab-size N]
                                                [--speculation-only] [--device cuda]

On the CPU, float32:

- **K/V agreement**: f16's greedy tokens for a few prompts, then q8_0 and q4_0 K/V runs,
  teacher-forced on those tokens (each step's argmax against f16's: a per-token measure)
  and free-running (positions equal; after a first difference the texts part ways);
- **MTP speculation**: ``LLMEngine`` at batch 1, greedy, without speculation and with the
  checkpoint's MTP head drafting k = 1..3 tokens: tok/s, tokens per verify step, and the
  outputs, which must equal the plain run's. ``--draft-vocab-size N`` drafts over a
  vocabulary subset (``engine/draft_vocab.py``) instead of the whole vocabulary;
  ``--speculation-only`` skips the K/V agreement.

``--device cuda`` measures the speculation part on the GPU, in bfloat16, with the engine's
CUDA defaults (graphs, warm-up; async scheduling for the plain run). There a verify row and
a decode row may round apart, so the greedy outputs' agreement with the plain run is
reported (the share of equal tokens up to each output's first difference), not required.

``--write-card`` stores the figures in ``train_log.json`` (key ``pagedserve``) and renders
``MODEL_CARD.md`` again from it.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "model"))  # greedy_driver: a teacher-forcing loop
sys.path.insert(0, str(Path(__file__).resolve().parent))

import model_card  # noqa: E402
from greedy_driver import greedy  # noqa: E402

from pagedserve.config import CacheConfig  # noqa: E402
from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402
from pagedserve.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from pagedserve.model.loader import LoadedModel, load_model  # noqa: E402

PROMPTS = (
    "Once upon a time",
    "It is a truth universally acknowledged, that a single man",
    "And God said unto Moses,",
    "The Python interpreter reads",
    "Elizabeth looked at her sister and",
    "To open a file for reading,",
)


def kv_agreement(lm: LoadedModel, kv_types: tuple[str, ...], prompts: tuple[str, ...],
                 new_tokens: int) -> dict[str, dict[str, float]]:
    """Per K/V type, the share of f16's greedy tokens it agrees with over ``prompts``:
    teacher-forced on f16's tokens (each step's argmax) and free-running (positions)."""
    def runner(kv: str) -> ModelRunner:
        return ModelRunner(lm.model, CacheConfig(cache_type_k=kv, cache_type_v=kv),
                           RunnerConfig(max_model_len=512, max_num_seqs=1))

    tok = lm.require_tokenizer()
    hits = {kv: [0, 0] for kv in kv_types}  # teacher-forced, free-running
    total = 0
    for prompt in prompts:
        ids = tok(prompt).input_ids
        f16 = greedy(runner("f16"), ids, new_tokens).tokens
        total += len(f16)
        for kv in kv_types:
            forced = greedy(runner(kv), ids, new_tokens, forced=f16)
            hits[kv][0] += sum(int(r.argmax()) == t for r, t in zip(forced.step_logits, f16))
            free = greedy(runner(kv), ids, new_tokens).tokens
            hits[kv][1] += sum(a == b for a, b in zip(free, f16))
    return {kv: {"teacher_forced": h[0] / total, "free_running": h[1] / total}
            for kv, h in hits.items()}


def generate(engine: LLMEngine, prompts: list[str], n: int,
             logprobs: int | None = None) -> tuple[list[list[int]], float, list[list]]:
    """Each prompt alone (batch 1), greedy, ``n`` tokens; the outputs, tok/s and, with
    ``logprobs``, each output token's ``TokenLogprob``."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    outputs, scores, seconds = [], [], 0.0
    for i, prompt in enumerate(prompts):
        t0 = time.perf_counter()
        engine.add_request(str(i), prompt, params)
        ids: list[int] = []
        lps: list = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                ids += o.new_token_ids
                lps += o.new_logprobs
        seconds += time.perf_counter() - t0
        outputs.append(ids)
        scores.append(lps)
    return outputs, sum(map(len, outputs)) / seconds, scores


def divergence_gaps(got: list[list[int]], got_lp: list[list], ref: list[list[int]],
                    ref_lp: list[list]) -> list[float | None]:
    """Per prompt, at the first token where ``got`` and ``ref`` differ (``None``: they do
    not): how far either run's own choice scored above the other's, in nats, the larger of
    the two (``inf`` when one run did not list the other's token in its top logprobs).
    Rounding moves a score by far less than a nat: a small gap is a near tie of the two
    choices, a large one a wrong token."""
    def score(lp, token: int) -> float:
        listed = dict(lp.top)
        listed.setdefault(lp.token_id, lp.logprob)
        return listed.get(token, -math.inf)

    gaps: list[float | None] = []
    for g, gl, r, rl in zip(got, got_lp, ref, ref_lp):
        at = next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None)
        if at is None:
            gaps.append(None)
            continue
        a, b = g[at], r[at]
        gaps.append(max(score(gl[at], a) - score(gl[at], b),
                        score(rl[at], b) - score(rl[at], a)))
    return gaps


def agreement(got: list[list[int]], ref: list[list[int]]) -> float:
    """The share of ``ref``'s tokens that ``got`` repeats before their first difference."""
    same = 0
    for g, r in zip(got, ref):
        for a, b in zip(g, r):
            if a != b:
                break
            same += 1
    return same / max(1, sum(map(len, ref)))


def speculation(path: Path, lm: LoadedModel, n: int, draft_vocab_size: int | None = None,
                device: str = "cpu") -> dict[str, Any]:
    exact = device == "cpu"  # float32 on the CPU: speculation must not change a token
    base = dict(model=str(path), device=device, dtype="float32" if exact else "bfloat16",
                max_model_len=512, max_num_seqs=1, progress=False)
    logprobs = None if exact else 5  # on the GPU: how near a tie each divergence is
    plain_engine = LLMEngine(EngineConfig(**base), loaded=lm)
    generate(plain_engine, list(PROMPTS[:1]), 8)  # the first request's own costs, untimed
    plain, plain_rate, plain_lp = generate(plain_engine, list(PROMPTS), n, logprobs)
    del plain_engine
    out: dict[str, Any] = {"plain_tok_s": plain_rate, "mtp": {}}
    if draft_vocab_size is not None:
        out["draft_vocab_size"] = draft_vocab_size
    for k in (1, 2, 3):
        spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": k}
        if draft_vocab_size is not None:
            spec["draft_vocab_size"] = draft_vocab_size
        engine = LLMEngine(EngineConfig(**base, speculative_config=spec), loaded=lm)
        generate(engine, list(PROMPTS[:1]), 8)
        assert engine.spec is not None
        engine.spec.reset_stats()
        got, rate, got_lp = generate(engine, list(PROMPTS), n, logprobs)
        out["mtp"][str(k)] = {"tok_s": rate,
                              "mean_acceptance_length": engine.spec.stats.mean_acceptance_length,
                              "identical_to_plain": got == plain}
        if not exact:
            out["mtp"][str(k)]["agreement_with_plain"] = agreement(got, plain)
            out["mtp"][str(k)]["divergence_gaps_nats"] = divergence_gaps(
                got, got_lp, plain, plain_lp)
        print(f"k={k}: {out['mtp'][str(k)]} (plain {plain_rate:.1f} tok/s)", flush=True)
        del engine
        if exact and got != plain:
            raise SystemExit(f"k={k}: speculative greedy output differs from plain decoding")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--kv-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, default=96)
    ap.add_argument("--write-card", action="store_true")
    ap.add_argument("--draft-vocab-size", type=int, default=None,
                    help="draft over the first N ids and the special ones")
    ap.add_argument("--speculation-only", action="store_true",
                    help="skip the K/V agreement (not with --write-card)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where the speculation part runs (cuda: bfloat16; implies "
                         "--speculation-only)")
    args = ap.parse_args(argv)
    if args.write_card and (args.speculation_only or args.draft_vocab_size is not None
                            or args.device != "cpu"):
        ap.error("--write-card stores the card's figures: the whole vocabulary, the K/V "
                 "agreement, the CPU")
    torch.manual_seed(0)
    cuda = args.device == "cuda"
    lm = load_model(args.checkpoint, device=args.device,
                    dtype=torch.bfloat16 if cuda else torch.float32, progress=False, mtp=True)
    figures: dict[str, Any] = {
        "device": (f"{torch.cuda.get_device_name()}, bfloat16" if cuda else
                   f"CPU ({platform.processor() or platform.machine()}, "
                   f"{torch.get_num_threads()} threads)") + f", torch {torch.__version__}",
    }
    if not args.speculation_only and not cuda:
        figures["kv_agreement"] = kv_agreement(lm, ("q8_0", "q4_0"), PROMPTS, args.kv_tokens)
        figures.update(kv_tokens=args.kv_tokens, kv_prompts=len(PROMPTS))
    figures["speculative"] = speculation(args.checkpoint, lm, args.spec_tokens,
                                         args.draft_vocab_size, args.device)
    figures["spec_tokens"] = args.spec_tokens
    print(json.dumps(figures, indent=2))
    if args.write_card:
        log_path = args.checkpoint / "train_log.json"
        info = json.loads(log_path.read_text())
        info["pagedserve"] = figures
        log_path.write_text(json.dumps(info, indent=2))
        (args.checkpoint / "MODEL_CARD.md").write_text(model_card.render(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
