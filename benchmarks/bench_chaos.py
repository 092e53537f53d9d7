"""Chaos run (issue 32): a real ``pagedserve serve`` overloaded by mixed traffic, with
clients that walk away, must leak nothing, answer no 5xx, and leave the outputs of the
requests it finished unchanged.

The server: ``--model preset:qwen3.5-27b`` (random bf16 weights of the 27B shape) on the
GPU, q4_0 K and V, and a K/V pool of ``--pool-factor`` times the longest request (1.5 by
default), so that a few concurrent long prompts cannot all fit and running sequences are
preempted. The client sends ``--num-requests`` completions (token-id prompts, greedy,
``ignore_eos``, ``logprobs``) at ``--concurrency`` in flight, more than ``--max-num-seqs``:

- prompt lengths: lognormal around ``--short-len`` tokens, and a ``--long-fraction`` of
  long ones, uniform in [``--max-prompt-len`` / 4, ``--max-prompt-len``], sent in bursts
  of ``--long-burst`` so that long prompts run concurrently;
- four kinds, in equal shares: ``stream`` (read to the end), ``stream_cut`` (closed after
  a random number of tokens), ``whole`` (non-streaming), ``whole_timeout`` (non-streaming,
  abandoned by a client timeout; it counts as complete if it answered in time).

Checks, each a line of the report; the script exits 1 if any fails:

1. ``workload_sent``: every request was sent and ended within ``--chaos-budget-s``
   (past it, the client abandons whatever is still in flight -- one more disconnect storm
   for the leak check -- and this check fails: the run did not do what it was asked).
2. ``no_5xx``: no HTTP status >= 500 and no error event inside a stream.
3. ``no_unexpected_errors``: every answer is 200 (or 429, which is counted), and no
   connection failed except those the client cut on purpose.
4. ``no_leaks``: once the client is done, /metrics reads 0 requests running, waiting and
   admitted, 0 K/V blocks owned, 0 state slots leased and 0 live sequences (after the
   chaos phase and again at the end).
5. ``preempted``: the server counted at least one preemption.
6. ``outputs_match``: up to ``--num-verify`` complete requests (an eighth of them long
   where there are enough) are sent again, one at a time, to the idle server; each must
   generate the same tokens as in the chaos phase, up to near-ties (criterion below).
7. ``clean_exit``: /health answers 200 at the end, the server exits 0 on SIGTERM, and its
   log holds no traceback.

Near-ties: random weights give logits with no meaning, and a different batch shape
changes the floating-point rounding of every GEMM, so two greedy runs can pick different
tokens where the top two logits are within rounding of each other. At the first position
where the chaos and the solo run differ (the prefixes are equal, so both runs saw the same
context), let ``a`` be the token the chaos run chose and ``b`` the solo run's. The gap is
``max(lp_solo(b) - lp_solo(a), lp_chaos(a) - lp_chaos(b))`` from each run's
``top_logprobs``; a token outside the other run's top ``--logprobs`` has a gap of at
least the chosen logprob minus the smallest one listed. A divergence with gap <=
``--tie-tolerance`` nats is a near-tie (counted, not a failure); a larger one is a
failure. Why this separates rounding from corruption: the preset's logits are a normal(0,
0.02) head applied to a unit-RMS hidden state of width 5120, so they spread with a standard
deviation near 1.4 nats, and the top few of 248K such values lie about 0.3 nats apart. A
sequence that read another's K/V, or a stale state slot, sees different logits altogether:
its choice sits typically a nat or more below the clean run's (often outside its top
``--logprobs``). Rounding only swaps tokens whose gap is within the noise, which the report
measures as the drift: the largest difference of the chosen tokens' logprobs over the equal
prefix. The tolerance must stand well above the drift; a single corrupted position can still
land on a near-tie by chance (about tolerance / 0.3 of the time), so one request proves
little, but dozens are a sharp test. The default, 0.5 nats, rests on a 27B-shape run on an
H200 (q4_0 K/V): the drift's p99 was 0.31 nats and its largest value 0.34, the logprobs
sit on a grid of 1/32 nat (the logits are bf16 at magnitudes of 4 to 8), and no divergence
exceeded 0.41 nats; a corrupted read sits a nat or more below.

Defaults: 500 requests, prompts up to 32K tokens (4% long, the rest around 256), up to 24
output tokens, concurrency 96 against max-num-seqs 32, 64 solo reruns; the chaos phase is
cut at 240 s (on an H200, 110 s left 141 of the 500 unsent or in flight) and the solo
reruns at 45 s (``benchmarks/gpu_run.sh`` stage ``bench-chaos``).
``--quick``: the tiny random model on the CPU, 40 requests of up to 96 tokens on an
11-block pool with prefill chunks of 16 tokens (so that prompts grow into the pool chunk by
chunk and preempt each other), in well under a minute (CI runs it:
tests/server/test_bench_chaos_quick.py).

Writes ``chaos.{md,json,png}`` (``--quick``: ``chaos_quick``) to ``--out-dir`` (default
``docs/benchmarks``; copies to ``$OUT``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import shlex
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _chaos_report  # noqa: E402
import _common  # noqa: E402
from _chaos_client import (  # noqa: E402
    LEAK_GAUGES,
    Outcome,
    Spec,
    chaos_phase,
    make_specs,
    outcome_of,
    send,
    wait_idle,
)

from pagedserve.model.random_checkpoint import random_model_path  # noqa: E402
from pagedserve.server.info import cpu_name, source_commit  # noqa: E402
from pagedserve.server.launcher import ServerProcess  # noqa: E402


# ---- the solo reruns and their comparison -----------------------------------------------
def compare(chaos: Outcome, solo: Outcome, tolerance: float) -> dict[str, Any]:
    """The near-tie criterion of the module docstring, for one request."""
    n = min(len(chaos.tokens), len(solo.tokens))
    first = next((i for i in range(n) if chaos.tokens[i] != solo.tokens[i]), None)
    prefix = n if first is None else first
    drift = max((abs(chaos.token_logprobs[i] - solo.token_logprobs[i]) for i in range(prefix)),
                default=0.0)
    row: dict[str, Any] = {"index": chaos.index, "prompt_len": chaos.prompt_len,
                           "long": chaos.long, "num_tokens": len(chaos.tokens),
                           "drift": round(drift, 6)}
    if first is None and len(chaos.tokens) == len(solo.tokens):
        return {**row, "verdict": "exact"}
    if first is None:
        return {**row, "verdict": "failed", "position": n, "gap": None,
                "note": f"lengths differ: {len(chaos.tokens)} vs {len(solo.tokens)}"}
    a, b = chaos.tokens[first], solo.tokens[first]
    gap_solo, solo_bound = _gap(solo, first, b, a)
    gap_chaos, chaos_bound = _gap(chaos, first, a, b)
    gap = max(gap_solo, gap_chaos)
    bounded = (gap_solo == gap and solo_bound) or (gap_chaos == gap and chaos_bound)
    verdict = "near_tie" if gap <= tolerance else "failed"
    return {**row, "verdict": verdict, "position": first, "chaos_token": a, "solo_token": b,
            "gap": round(gap, 6), "gap_is_lower_bound": bool(bounded)}


def _gap(run: Outcome, i: int, chosen: str, other: str) -> tuple[float, bool]:
    """``run``'s logprob of ``chosen`` minus that of ``other`` at position ``i``, and
    whether it is only a lower bound (``other`` outside the listed top logprobs)."""
    top = run.top_logprobs[i] or {}
    if other in top:
        return run.token_logprobs[i] - top[other], False
    floor = min(top.values()) if top else run.token_logprobs[i]
    return run.token_logprobs[i] - floor, True


def pick_verify(outcomes: list[Outcome], num: int, seed: int) -> list[Outcome]:
    """Up to ``num`` complete requests, an eighth of them long when there are enough (a
    long one costs a solo run seconds of prefill)."""
    rng = random.Random(seed + 1)
    complete = [o for o in outcomes if o.result == "complete"]
    longs = [o for o in complete if o.long]
    shorts = [o for o in complete if not o.long]
    rng.shuffle(longs)
    rng.shuffle(shorts)
    chosen = longs[:max(num // 8, num - len(shorts))]
    chosen += shorts[:num - len(chosen)]
    return sorted(chosen, key=lambda o: o.index)


async def solo_phase(url: str, model: str, specs: list[Spec], picked: list[Outcome],
                     args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """Each picked request again, alone, non-streaming; stops at ``args.verify_budget_s``."""
    rows = []
    t0 = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None)) as http:
        for chaos in picked:
            if time.perf_counter() - t0 > args.verify_budget_s:
                break
            spec = specs[chaos.index]
            solo = await send(http, spec, outcome_of(spec), model, args.logprobs, t0,
                              stream=False)
            if solo.result != "complete":
                rows.append({"index": chaos.index, "verdict": "failed", "gap": None,
                             "note": f"solo run {solo.result}: {solo.error}"})
            else:
                rows.append(compare(chaos, solo, args.tie_tolerance))
    return rows, time.perf_counter() - t0


# ---- the checks ----------------------------------------------------------------------------
def checks(outcomes: list[Outcome], after_chaos: dict[str, Any], after_all: dict[str, Any],
           matches: list[dict[str, Any]], num_picked: int, num_verify: int,
           exit_info: dict[str, Any]) -> list[dict[str, Any]]:
    """Each check of the module docstring: ``{"check", "passed", "detail"}``."""
    statuses = Counter(o.status for o in outcomes if o.status is not None)
    five = {s: c for s, c in statuses.items() if s >= 500}
    in_stream = [o for o in outcomes if o.error and o.error.startswith("in stream")]
    unexpected = [o for o in outcomes if o.result == "error"
                  or (o.result == "refused" and o.status != 429)]
    leaks: dict[str, Any] = {}
    for when, values in (("after chaos", after_chaos), ("at the end", after_all)):
        if "unreachable" in values:
            leaks[when] = "server unreachable"
        else:
            leaks.update({f"{when}: {g}": values.get(g) for g in LEAK_GAUGES
                          if values.get(g) != 0})
    failed = [m for m in matches if m["verdict"] == "failed"]
    unsent = Counter(o.result for o in outcomes if o.result in ("not_sent", "cut_at_deadline"))
    out = [
        ("workload_sent", not unsent,
         f"all {len(outcomes)} requests sent and finished within the chaos budget"
         if not unsent else f"past --chaos-budget-s: {unsent['not_sent']} never sent, "
         f"{unsent['cut_at_deadline']} abandoned in flight; raise the budget or lower "
         "--num-requests / --max-prompt-len"),
        ("no_5xx", not five and not in_stream,
         f"statuses {dict(sorted(statuses.items()))}; {len(in_stream)} error events in "
         "streams"),
        ("no_unexpected_errors", not unexpected,
         f"{len(unexpected)} unexpected: " + "; ".join(
             f"#{o.index} {o.kind} {o.status}: {(o.error or '')[:160]}" for o in unexpected[:5])),
        ("no_leaks", not leaks, "every leak gauge 0 after the chaos phase and at the end"
         if not leaks else f"nonzero: {leaks}"),
        ("preempted", (after_chaos.get("num_preemptions") or 0) > 0,
         f"{after_chaos.get('num_preemptions')} preemptions"),
        ("outputs_match", not failed and (bool(matches) or num_verify == 0),
         f"{len(matches)} of {num_picked} picked compared: "
         f"{sum(m['verdict'] == 'exact' for m in matches)} exact, "
         f"{sum(m['verdict'] == 'near_tie' for m in matches)} near-ties, {len(failed)} failed"),
        ("clean_exit", exit_info["health"] == 200 and exit_info["exit_status"] == 0
         and not exit_info["tracebacks"],
         f"/health {exit_info['health']}, exit status {exit_info['exit_status']}, "
         f"{exit_info['tracebacks']} tracebacks in the log"),
    ]
    return [{"check": name, "passed": bool(ok), "detail": detail} for name, ok, detail in out]


# ---- the run -------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model on the CPU, seconds")
    p.add_argument("--model", default=None, help="default preset:qwen3.5-27b (--quick: the "
                   "tiny random model)")
    p.add_argument("--device", default=None, help="default cuda (--quick: cpu)")
    p.add_argument("--kv-type", default="q4_0", help="K and V storage type (default q4_0)")
    p.add_argument("--num-requests", type=int, default=None, help="default 500 (quick 40)")
    p.add_argument("--concurrency", type=int, default=None, help="default 96 (quick 12)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default 32 (quick 4)")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="longest prompt (default 32768; quick 96)")
    p.add_argument("--short-len", type=int, default=None,
                   help="median short prompt (default 256; quick 12)")
    p.add_argument("--long-fraction", type=float, default=None,
                   help="share of long prompts (default 0.04; quick 0.2)")
    p.add_argument("--long-burst", type=int, default=4, help="long prompts sent together")
    p.add_argument("--output-len", type=int, default=None,
                   help="most tokens a request generates (default 24; quick 16)")
    p.add_argument("--pool-factor", type=float, default=1.5,
                   help="K/V pool size in longest requests (default 1.5)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="K/V pool blocks (default: from --pool-factor)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens per step and sequence (default: the server's, 512; "
                        "quick 16, so that long prompts grow into the pool chunk by chunk)")
    p.add_argument("--timeout-range", type=float, nargs=2, default=None,
                   metavar=("LO", "HI"), help="whole_timeout patience in seconds "
                   "(default 0.5 8; quick 0.05 3)")
    p.add_argument("--num-verify", type=int, default=None,
                   help="complete requests rerun alone (default 64; quick: all)")
    p.add_argument("--chaos-budget-s", type=float, default=None,
                   help="cut the chaos phase after this long: every request still in "
                        "flight is abandoned, and the workload_sent check fails (default "
                        "240; quick: none)")
    p.add_argument("--verify-budget-s", type=float, default=45.0,
                   help="start no solo rerun after this long (default 45)")
    p.add_argument("--logprobs", type=int, default=10, help="top logprobs per token (10)")
    p.add_argument("--tie-tolerance", type=float, default=0.5,
                   help="largest logprob gap (nats) of a near-tie (default 0.5)")
    p.add_argument("--poll-s", type=float, default=None, help="/metrics period (1; quick 0.2)")
    p.add_argument("--server-args", default="",
                   help="more `pagedserve serve` flags, one string")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="docs/benchmarks")
    p.add_argument("--name", default=None, help="output stem (default chaos; quick chaos_quick)")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {
        "model": str(random_model_path()) if q else "preset:qwen3.5-27b",
        "device": "cpu" if q else "cuda",
        "num_requests": 40 if q else 500, "concurrency": 12 if q else 96,
        "max_num_seqs": 4 if q else 32, "max_prompt_len": 96 if q else 32768,
        "short_len": 12 if q else 256, "long_fraction": 0.2 if q else 0.04,
        "output_len": 16 if q else 24, "prefill_chunk": 16 if q else None,
        "timeout_range": [0.05, 3.0] if q else [0.5, 8.0],
        "num_verify": 10**9 if q else 64, "poll_s": 0.2 if q else 1.0,
        "chaos_budget_s": None if q else 240.0,
        "name": "chaos_quick" if q else "chaos",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("num_requests", "concurrency", "max_num_seqs", "max_prompt_len", "short_len",
                "long_burst", "block_size", "logprobs"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.output_len < 2:
        raise SystemExit(f"--output-len must be >= 2, got {args.output_len}")
    if not 0.0 <= args.long_fraction <= 1.0:
        raise SystemExit(f"--long-fraction must be in [0, 1], got {args.long_fraction}")
    if args.pool_factor < 1.0:
        raise SystemExit(f"--pool-factor must be >= 1 (the longest request must fit), got "
                         f"{args.pool_factor}")
    args.max_model_len = args.max_prompt_len + args.output_len
    if args.num_blocks is None:
        args.num_blocks = math.ceil(args.pool_factor * args.max_model_len / args.block_size)
    return args


def server_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--no-access-log", "--device", args.device, "--cache-type-k", args.kv_type,
             "--cache-type-v", args.kv_type, "--max-num-seqs", str(args.max_num_seqs),
             "--max-model-len", str(args.max_model_len), "--num-blocks", str(args.num_blocks),
             "--block-size", str(args.block_size)]
    if args.model:
        flags += ["--model", args.model]
    if args.prefill_chunk:
        flags += ["--prefill-chunk", str(args.prefill_chunk)]
    return flags + shlex.split(args.server_args)


def run(args: argparse.Namespace, url: str, server: ServerProcess) -> dict[str, Any]:
    info = httpx.get(url + "/server_info", timeout=30).json()
    specs = make_specs(args, info["vocab_size"])
    print(f"chaos: {len(specs)} requests at concurrency {args.concurrency}", file=sys.stderr)
    outcomes, timeline, duration = asyncio.run(chaos_phase(url, info["model"], specs, args))
    after_chaos = wait_idle(url, timeout=60)
    picked = pick_verify(outcomes, args.num_verify, args.seed)
    print(f"chaos phase {duration:.1f} s; rerunning {len(picked)} alone", file=sys.stderr)
    matches, verify_s = asyncio.run(solo_phase(url, info["model"], specs, picked, args))
    after_all = wait_idle(url, timeout=30)
    try:
        health: int | None = httpx.get(url + "/health", timeout=30).status_code
    except httpx.HTTPError:
        health = None
    exit_status = server.stop(timeout=60)
    exit_info = {"health": health, "exit_status": exit_status,
                 "tracebacks": server.log_text().count("Traceback")}
    results = checks(outcomes, after_chaos, after_all, matches, len(picked), args.num_verify,
                     exit_info)
    records = [{k: v for k, v in asdict(o).items()
                if k not in ("tokens", "token_logprobs", "top_logprobs")} for o in outcomes]
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python benchmarks/bench_chaos.py " + shlex.join(sys.argv[1:]),
        "gpu": info.get("device_name"),
        "client_cpu": cpu_name(),
        "commit": info.get("commit") or source_commit(),
        "server": info,
        "server_flags": server_flags(args),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out_dir",)},
        "passed": all(c["passed"] for c in results),
        "checks": results,
        "statuses": {str(k): v for k, v in sorted(Counter(
            o.status for o in outcomes if o.status is not None).items())},
        "results": dict(Counter(f"{o.kind}:{o.result}" for o in outcomes)),
        "chaos_s": round(duration, 2),
        "verify_s": round(verify_s, 2),
        "metrics_after_chaos": after_chaos,
        "metrics_after_all": after_all,
        "exit": exit_info,
        "matches": matches,
        "timeline": timeline,
        "requests": records,
        "server_log_tail": server.log_tail(30) if exit_status != 0 else None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # A stage's time limit sends SIGTERM: unwind, so the server is stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="pagedserve-chaos-") as tmp:
        server = ServerProcess(server_flags(args), Path(tmp) / "serve.log")
        print(f"starting: pagedserve serve {shlex.join(server.args)}", file=sys.stderr)
        url = server.start()
        try:
            report = run(args, url, server)
        except BaseException:
            print(f"server log tail:\n{server.log_tail()}", file=sys.stderr)
            raise
        finally:
            server.stop(timeout=60)
    paths = _common.write_outputs(Path(args.out_dir), args.name, report,
                                  _chaos_report.markdown(report),
                                  lambda png: _chaos_report.figure(report, png))
    print(_chaos_report.summary(report))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = [c["check"] for c in report["checks"] if not c["passed"]]
    print("chaos: " + (f"failed ({', '.join(failed)})" if failed else "passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
