"""Structured-output decode benchmark: what a grammar costs a decode step at batch 8.

One run on one GPU, random bf16 weights of the Qwen3.5-27B shape (``--model
preset:qwen3.5-27b``). A preset has no tokenizer, so the run builds a synthetic byte-level
BPE vocabulary of the model's full size (256 bytes, random multi-byte tokens of letters,
digits, JSON punctuation and leading spaces, and ``<|im_end|>`` as EOS): xgrammar's mask
work depends on the vocabulary's size and spread, which this reproduces, not on what the
tokens mean.

Every figure is a p50 over timed ``LLMEngine.step()`` calls with 8 requests decoding
(scheduler, batch build, CUDA-graph forward, bitmask fill on the host, its copy, the mask
applied in the sampler, reading the tokens back). Cases:

- ``unconstrained (async)``: 8 free requests, async scheduling on (the CUDA default).
- ``unconstrained (sync)``: the same, each step read back before the next is launched
  (what a constrained step always does: its mask needs the previous token).
- ``json x8``: 8 requests under one JSON schema (an array of at least 64 objects, so no
  request can finish inside the timed window); ``json x4 + free x4``: a mixed batch.
- ``tool call x8``: 8 requests forced into Qwen3.5's XML call syntax (``tool_choice``
  required over a tool with an array parameter).

The target (issue 36): ``json x8`` costs at most 10% more per step than
``unconstrained (async)``. ``--quick`` runs the embedded default model on the CPU with a few
steps (a smoke test; its numbers mean nothing).

Writes ``structured.{md,json,png}`` to ``--out`` (default ``docs/benchmarks``; copies to
``$OUT``).
"""

from __future__ import annotations

import dataclasses
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
from pagedserve.engine.structured import GrammarSpec  # noqa: E402
from pagedserve.model.loader import LoadedModel, load_model  # noqa: E402
from pagedserve.server.constraints import json_format, tool_call_format  # noqa: E402

BATCH = 8
PROMPT_LEN = 64
TARGET = 1.10
ITEM = {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "name", "tags"]}
SCHEMA = {"type": "array", "items": ITEM, "minItems": 64}
TOOL = {"type": "object", "properties": {"rows": SCHEMA, "note": {"type": "string"}},
        "required": ["rows"]}
# Qwen3.5's recommended sampling for thinking mode: every row takes the sampled path.
SAMPLING = dict(temperature=0.6, top_p=0.95, top_k=20, ignore_eos=True)


def synthetic_tokenizer(vocab_size: int, seed: int = 0):
    """A byte-level BPE tokenizer with ``vocab_size`` ids (the last one ``<|im_end|>``)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from pagedserve.model.byte_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    vocab = {ch: b for b, ch in byte_chars.items()}
    rng = random.Random(seed)
    alphabet = "etaoinshrdlucmfwypvbgkqjxz" * 4 + "ETAOINS0123456789" + '{}[]":,._-/\\\n'
    space = byte_chars[ord(" ")]
    while len(vocab) < vocab_size - 1:
        word = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 10)))
        token = "".join(byte_chars[b] for b in word.encode())
        vocab.setdefault(space + token if rng.random() < 0.5 else token, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|im_end|>", special=True, normalized=False)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def with_tokenizer(loaded: LoadedModel) -> LoadedModel:
    if loaded.tokenizer is not None:
        return loaded
    tok = synthetic_tokenizer(loaded.config.vocab_size)
    generation = dataclasses.replace(loaded.generation, eos_token_ids=(tok.eos_token_id,))
    return dataclasses.replace(loaded, tokenizer=tok, generation=generation)


class FillTimer:
    """Host seconds spent filling bitmasks, per call (wraps ``fill_bitmask``)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.times: list[float] = []
        structured = engine.structured
        inner = structured.fill_bitmask

        def timed(grammars):
            t = time.perf_counter()
            out = inner(grammars)
            self.times.append(time.perf_counter() - t)
            return out

        structured.fill_bitmask = timed  # type: ignore[method-assign]


def run_case(engine: LLMEngine, specs: list[GrammarSpec | None], steps: int,
             warmup: int, sync: bool) -> dict:
    engine.async_scheduling = not sync
    for i, spec in enumerate(specs):
        prompt = torch.randint(0, 256, (PROMPT_LEN,)).tolist()
        engine.add_request(f"r{i}", prompt, SamplingParams(
            max_tokens=steps + warmup + 64, seed=i, structured=spec, **SAMPLING))
    while len(engine.step()) < len(specs):  # prefill until every request decodes
        pass
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t)
        if len(outs) != len(specs) or any(o.finished for o in outs):
            raise RuntimeError("a request left the batch inside the timed window")
    for rid in list(engine.requests):
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    ms = sorted(1e3 * t for t in times)
    return {"ms_per_step_p50": statistics.median(ms), "ms_per_step_mean": statistics.fmean(ms),
            "ms_per_step_p90": ms[min(len(ms) - 1, int(0.9 * len(ms)))], "steps": steps}


def run(args) -> dict:
    meta = _common.run_meta()
    device = "cpu" if args.quick else "cuda"
    model = None if args.quick else args.model
    loaded = with_tokenizer(load_model(model, device, None if args.quick else "bfloat16",
                                       progress=False))
    cfg = EngineConfig(model=model, device=device, max_model_len=4096, max_num_seqs=BATCH,
                       cache_type_k=args.kv_type, cache_type_v=args.kv_type, progress=False)
    engine = LLMEngine(cfg, loaded=loaded)
    if not args.quick:
        engine.warm_up()  # every kernel compiled before anything is timed
    json_spec = GrammarSpec.of_format(json_format(SCHEMA))
    tool_spec = GrammarSpec.of_format(tool_call_format({"fill_rows": TOOL}, None, True))
    compile_ms = {}
    for name, spec in (("json", json_spec), ("tool call", tool_spec)):
        t = time.perf_counter()
        engine.structured.compile(spec)
        compile_ms[name] = 1e3 * (time.perf_counter() - t)
    fills = FillTimer(engine)
    cases = {
        "unconstrained (async)": ([None] * BATCH, False),
        "unconstrained (sync)": ([None] * BATCH, True),
        "json x8": ([json_spec] * BATCH, False),
        "json x4 + free x4": ([json_spec, None] * (BATCH // 2), False),
        "tool call x8": ([tool_spec] * BATCH, False),
    }
    results = {"meta": meta, "model": model or "embedded default (CPU quick run)",
               "vocab_size": engine.vocab_size, "kv_type": args.kv_type,
               "compile_ms": compile_ms, "cases": {}}
    for name, (specs, sync) in cases.items():
        fills.times.clear()
        r = run_case(engine, specs, args.steps, args.warmup, sync)
        if fills.times:
            r["fill_ms_p50"] = 1e3 * statistics.median(fills.times)
        results["cases"][name] = r
        print(f"{name:24s} {r['ms_per_step_p50']:8.2f} ms/step"
              + (f"  (bitmask fill {r['fill_ms_p50']:.3f} ms)" if "fill_ms_p50" in r else ""))
    base = results["cases"]["unconstrained (async)"]["ms_per_step_p50"]
    results["ratios"] = {n: c["ms_per_step_p50"] / base for n, c in results["cases"].items()}
    results["target_met"] = results["ratios"]["json x8"] <= TARGET
    return results


def markdown(res: dict) -> str:
    m = res["meta"]
    lines = [
        "# Structured outputs: decode step cost at batch 8", "",
        _common.meta_line(m), "",
        f"Model {res['model']} (vocabulary {res['vocab_size']}), K/V {res['kv_type']}; "
        "p50 over timed `LLMEngine.step()` calls with 8 requests decoding; see the script's "
        "docstring for the cases.", "",
    ]
    rows = [[n, f"{c['ms_per_step_p50']:.2f}", f"{c['ms_per_step_p90']:.2f}",
             f"{res['ratios'][n]:.3f}",
             f"{c['fill_ms_p50']:.3f}" if "fill_ms_p50" in c else "-"]
            for n, c in res["cases"].items()]
    lines.append(_common.md_table(["case", "ms/step p50", "ms/step p90",
                                   "vs unconstrained (async)", "bitmask fill ms p50"], rows))
    ratio = res["ratios"]["json x8"]
    lines += ["", f"Target: `json x8` at most {TARGET:.2f}x `unconstrained (async)`: "
              f"{ratio:.3f}x, **{'met' if res['target_met'] else 'missed'}**.", "",
              "Grammar compile (first use; later uses hit the cache): " + ", ".join(
                  f"{k} {v:.0f} ms" for k, v in res["compile_ms"].items()) + "."]
    return "\n".join(lines) + "\n"


def figure(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res["cases"])
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, [res["cases"][n]["ms_per_step_p50"] for n in names], color="tab:blue")
    base = res["cases"]["unconstrained (async)"]["ms_per_step_p50"]
    ax.axhline(base * TARGET, color="k", ls="--", lw=1, label=f"{TARGET:.2f}x unconstrained")
    ax.set_ylabel("ms per decode step (p50)")
    ax.set_title(f"structured outputs at batch 8 - {res['meta']['gpu']} - {res['meta']['date']}")
    ax.tick_params(axis="x", labelsize=8, rotation=15)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = _common.model_parser(
        __doc__, "the embedded default model on the CPU, few steps (a smoke test)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    args = ap.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 40)
    args.warmup = args.warmup or (1 if args.quick else 5)
    if args.quick:
        args.kv_type = "f16"
    elif not torch.cuda.is_available():
        print("bench_structured needs a CUDA GPU (or --quick)", file=sys.stderr)
        return 2
    res = run(args)
    return _common.report(args.out, "structured", res, markdown(res), lambda p: figure(res, p))


if __name__ == "__main__":
    sys.exit(main())
