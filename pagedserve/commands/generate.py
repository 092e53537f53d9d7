"""``pagedserve generate``: complete one or more prompts through the engine.

With ``--json`` each prompt's result is one JSON line
``{"token_ids": [...], "text": "...", "finish_reason": "stop" | "length"}``; with a single
prompt that is the last line of stdout.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import TYPE_CHECKING

from pagedserve.commands.engine_args import add_engine_arguments, engine_config

if TYPE_CHECKING:
    from pagedserve.engine.request import SamplingParams
    from pagedserve.model.generation_defaults import GenerationDefaults

HELP = "generate text for one or more prompts"


def add_arguments(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", help="prompt text (repeat for several)")
    src.add_argument("--prompt-token-ids", action="append",
                     help="comma-separated token ids, e.g. 1,2,3 (repeat for several)")
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the checkpoint's generation_config, else 0)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    add_engine_arguments(p)


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-token-ids {text!r} is not a comma-separated list of "
                         "integers") from None
    if not ids:
        raise ValueError("--prompt-token-ids is empty")
    return ids


def check_sampling_flags(args: argparse.Namespace) -> None:
    """``ValueError`` naming the first sampling flag out of range (before the model loads).
    As at the API, a ``--top-k`` at or beyond the vocabulary means no top-k."""
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    t = args.temperature
    if t is not None and not (math.isfinite(t) and 0.0 <= t <= 100.0):
        raise ValueError(f"--temperature must be in [0, 100], got {t}")
    if args.top_p is not None and not 0.0 < args.top_p <= 1.0:
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.top_k is not None and args.top_k < -1:
        raise ValueError(f"--top-k must be -1 or 0 (no top-k) or a positive integer, got "
                         f"{args.top_k}")
    if args.seed is not None and not -(2**63) <= args.seed < 2**64:
        raise ValueError(f"--seed must be a 64-bit integer, in [-2**63, 2**64), got "
                         f"{args.seed}")


def sampling_params(args: argparse.Namespace, defaults: GenerationDefaults) -> SamplingParams:
    from pagedserve.engine.request import SEED_RANGE, SamplingParams

    greedy_default = defaults.do_sample is not True
    temperature = args.temperature
    if temperature is None:
        temperature = 0.0 if greedy_default else (defaults.temperature or 1.0)
    return SamplingParams(
        max_tokens=args.max_tokens, temperature=temperature,
        top_p=args.top_p if args.top_p is not None else (defaults.top_p or 1.0),
        top_k=args.top_k if args.top_k is not None else (defaults.top_k or 0),
        seed=None if args.seed is None else args.seed % SEED_RANGE,
    )


def run(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm import LLM

    # Checked before the model loads, so a bad flag fails at start-up.
    check_sampling_flags(args)
    prompts = args.prompt or [_parse_ids(t) for t in args.prompt_token_ids]
    llm = LLM(**vars(engine_config(args, progress=not args.json)))
    params = sampling_params(args, llm.engine.loaded.generation)
    outputs = llm.generate(prompts, params)
    for out in outputs:
        if args.json:
            print(json.dumps({"token_ids": out.token_ids, "text": out.text,
                              "finish_reason": out.finish_reason}))
        else:
            sys.stdout.write(out.text + "\n")
            print(f"[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]",
                  file=sys.stderr)
    return 0
