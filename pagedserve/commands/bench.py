"""``pagedserve bench serve``: the serving benchmark, in the style of ``vllm bench serve``.

Against a running server (``--url``), or one it starts itself from the engine flags, it
sweeps concurrency levels (default 1, 4, 8, 16) with ragged random-token prompts and fixed
output lengths, and reports request throughput, output tokens/s, and TTFT, TPOT and ITL
at p50 and p99, measured client-side from SSE chunk arrivals. It writes ``NAME.md``,
``NAME.json`` and ``NAME.png`` to ``--out-dir`` and prints a table. ``--quick`` is a small
run that finishes in seconds on a CPU with the embedded model.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pagedserve.commands.engine_args import add_engine_arguments

HELP = "benchmarks (`bench serve`: the HTTP server under a concurrency sweep)"
SERVE_MAX_NUM_SEQS = 16  # the started server's default, as `pagedserve serve`'s


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="benchmark", metavar="BENCHMARK", required=True)
    s = sub.add_parser("serve", help="serving throughput and latency against concurrency",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--url", default=None,
                   help="base URL of a running server (default: start one with the engine "
                        "flags below and stop it afterwards)")
    s.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"))
    s.add_argument("--concurrency", default="1,4,8,16", help="levels, comma-separated")
    s.add_argument("--num-prompts", type=int, default=None,
                   help="requests per level (default 8 x concurrency, at least 16; --quick: "
                        "2 x concurrency, at least 4)")
    s.add_argument("--input-len", type=int, default=None,
                   help="typical prompt length in tokens (default 512; --quick: 32)")
    s.add_argument("--input-dist", default="uniform", choices=("fixed", "uniform", "lognormal"),
                   help="prompt length distribution (default uniform)")
    s.add_argument("--input-spread", type=float, default=0.5,
                   help="uniform: +- fraction of --input-len; lognormal: sigma (default 0.5)")
    s.add_argument("--output-len", type=int, default=None,
                   help="generated tokens per request, EOS ignored (default 128; --quick: 8)")
    s.add_argument("--temperature", type=float, default=0.0)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--warmup", type=int, default=2, help="unmeasured requests first")
    s.add_argument("--quick", action="store_true", help="small CPU-friendly run")
    s.add_argument("--out-dir", default="docs/benchmarks")
    s.add_argument("--name", default=None,
                   help="output file stem (default 'serve'; --quick: 'serve_quick')")
    s.add_argument("--server-log", default=None,
                   help="keep the started server's log at this path (with --server-log-level "
                        "debug it times every engine step)")
    s.add_argument("--server-log-level", default="info",
                   choices=("critical", "error", "warning", "info", "debug"))
    add_engine_arguments(s, default_max_num_seqs=SERVE_MAX_NUM_SEQS)


def run(args: argparse.Namespace) -> int:
    benchmarks = {"serve": run_serve}
    return benchmarks[args.benchmark](args)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags of ``args`` that differ from their defaults, as command-line words
    for the server this command starts."""
    reference = argparse.ArgumentParser(add_help=False)
    add_engine_arguments(reference, default_max_num_seqs=SERVE_MAX_NUM_SEQS)
    words: list[str] = []
    for action in reference._actions:
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            words += [flag if value else action.option_strings[1]]
        else:
            words += [flag] if isinstance(action, argparse._StoreTrueAction) \
                else [flag, str(value)]
    return words


def _settings(args: argparse.Namespace) -> dict[str, Any]:
    try:
        levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {args.concurrency!r} is not a comma-separated list "
                         "of integers") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency levels must be >= 1, got {args.concurrency!r}")
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    quick = args.quick
    return {
        "levels": levels,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len or (32 if quick else 512),
        "output_len": args.output_len or (8 if quick else 128),
        "name": args.name or ("serve_quick" if quick else "serve"),
    }


def _num_prompts(settings: dict[str, Any], concurrency: int, quick: bool) -> int:
    if settings["num_prompts"] is not None:
        return settings["num_prompts"]
    return max(4, 2 * concurrency) if quick else max(16, 8 * concurrency)


def run_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.url is not None:
        if engine_flags(args):
            raise ValueError(f"engine flags {engine_flags(args)} only apply to a server this "
                             "command starts; with --url, the running server's own are used")
        if args.server_log or args.server_log_level != "info":
            raise ValueError("--server-log and --server-log-level apply to a server this "
                             "command starts, not to one at --url")
        return _benchmark(args.url.rstrip("/"), args, settings)
    from pagedserve.server.launcher import ServerProcess

    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        log_path = Path(args.server_log) if args.server_log else Path(tmp) / "serve.log"
        server = ServerProcess(["--no-access-log", "--log-level", args.server_log_level,
                                *engine_flags(args)], log_path,
                               env={"PAGEDSERVE_API_KEY": args.api_key} if args.api_key else None)
        print(f"starting: pagedserve serve {shlex.join(server.args)}", file=sys.stderr)
        url = server.start()
        try:
            return _benchmark(url, args, settings)
        finally:
            status = server.stop()
            if status != 0:
                print(f"the server exited with {status}:\n{server.log_tail()}", file=sys.stderr)


def _benchmark(url: str, args: argparse.Namespace, settings: dict[str, Any]) -> int:
    import asyncio

    from pagedserve.bench.client import LevelRun, get_json, run_level
    from pagedserve.bench.report import results_table, write_report
    from pagedserve.bench.stats import summarize
    from pagedserve.bench.workload import LengthDistribution, Workload
    from pagedserve.server.info import cpu_name, source_commit

    info = get_json(url, "/server_info", args.api_key)
    workload = Workload(LengthDistribution(args.input_dist, settings["input_len"],
                                           args.input_spread),
                        settings["output_len"], info["vocab_size"], info["max_model_len"],
                        args.seed)

    def level(concurrency: int, num: int, seed_key: int) -> LevelRun:
        prompts = workload.prompts(seed_key, num)
        return asyncio.run(run_level(url, info["model"], prompts, workload.output_len,
                                     concurrency, args.temperature, args.api_key))

    if args.warmup:
        level(1, args.warmup, 0)
    levels = []
    for c in settings["levels"]:
        num = _num_prompts(settings, c, args.quick)
        summary = summarize(level(c, num, c))
        levels.append(summary)
        print(f"concurrency {c}: {summary['completed']}/{num} ok in "
              f"{summary['duration_s']:.1f} s", file=sys.stderr)
    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "pagedserve " + shlex.join(sys.argv[1:]),
        "client_cpu": cpu_name(),
        "client_commit": source_commit(),
        "url": url,
        "server": info,
        "workload": {
            "num_prompts": ("fixed " + str(settings["num_prompts"])
                            if settings["num_prompts"] else
                            ("2 x concurrency (min 4)" if args.quick
                             else "8 x concurrency (min 16)")),
            "input_dist": args.input_dist, "input_len": settings["input_len"],
            "input_spread": args.input_spread, "output_len": settings["output_len"],
            "temperature": args.temperature, "seed": args.seed, "warmup": args.warmup,
        },
        "levels": levels,
    }
    paths = write_report(Path(args.out_dir), settings["name"], report)
    print(results_table(levels))
    print("wrote " + ", ".join(str(p) for p in paths))
    failed = sum(lv["failed"] for lv in levels)
    mismatched = sum(lv["chunk_count_mismatches"] for lv in levels)
    if failed or mismatched:
        print(f"{failed} requests failed, {mismatched} streams had a chunk per token "
              "mismatch", file=sys.stderr)
        return 1
    return 0
