"""Prefix caching through the server: multi-turn chat and an agent loop, with caching on
and off side by side in one run. Writes ``OUT/prefix.{md,json,png}``.

    python benchmarks/bench_prefix.py --model preset:qwen3.5-27b --device cuda \\
        --cache-type-k q4_0 --cache-type-v q4_0 --max-model-len 40960 --scale 0.5
    python benchmarks/bench_prefix.py --quick          # CPU, the tiny random model

Workloads (token-id prompts of random tokens; every request streams, EOS ignored):

* chat: ``--conversations`` conversations of ``--turns`` turns, each turn adding
  ``--user-tokens`` new tokens to the whole history (earlier prompts and the generated
  tokens, read back with ``return_token_ids``) and generating ``--chat-output`` tokens;
  ``--concurrency`` conversations in flight;
* agent: ``--agents`` agents sharing a ``--system-tokens`` system prompt, ``--steps`` steps
  each, every step appending a tool result of ``--tool-tokens`` (a range) and generating
  ``--agent-output`` tokens; all agents in flight.

Reported: the hit rate over reusable tokens (a prompt's longest common prefix with the
history the client has seen finish, less its last token), TTFT p50/p99 by turn index,
throughput, checkpoint-pool use, the hit rate of the agent loop against the checkpoint
budget (``--sweep-checkpoints``, one server each, and the default budget's run: a plot),
and the ratio of a hit's TTFT to the TTFT of a cold prompt made of only
its uncached tokens (both sent alone, in the same run). ``--scale`` multiplies every
token count (not the numbers of conversations, turns, agents or steps).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pagedserve.model.random_checkpoint import random_model_path
from pagedserve.server.info import source_commit
from pagedserve.server.launcher import ServerProcess


@dataclass
class Result:
    group: int  # conversation or agent
    turn: int
    prompt_len: int
    reusable: int
    cached: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    output: list[int] = field(default_factory=list)


async def send(client: httpx.AsyncClient, model: str, prompt: list[int], n: int) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True,
            "temperature": 0.0, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    r = Result(0, 0, len(prompt), 0)
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                details = chunk["usage"].get("prompt_tokens_details") or {}
                r.cached = details.get("cached_tokens", 0)
            for choice in chunk.get("choices", []):
                if not r.output:
                    r.ttft = time.perf_counter() - start
                r.output.extend(choice.get("token_ids") or [])
    r.e2e = time.perf_counter() - start
    return r


def lcp(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Workload:
    """Sessions (conversations or agents) whose requests depend on earlier outputs."""

    def __init__(self, args: argparse.Namespace, kind: str, vocab: int, seed: int) -> None:
        self.kind, self.vocab, s = kind, vocab, args.scale
        self.rng = random.Random(seed)
        if kind == "chat":
            self.groups, self.turns = args.conversations, args.turns
            self.output = max(1, int(args.chat_output * s))
            self.system: list[int] = []
        else:
            self.groups, self.turns = args.agents, args.steps
            self.output = max(1, int(args.agent_output * s))
            self.system = self.tokens(int(args.system_tokens * s))
        self.args = args
        # What finished requests computed: prompt + output but its last token (never fed).
        self.seen: list[list[int]] = []

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.vocab) for _ in range(max(1, n))]

    def new_tokens(self) -> list[int]:
        s = self.args.scale
        if self.kind == "chat":
            return self.tokens(int(self.args.user_tokens * s))
        lo, hi = (int(x) for x in self.args.tool_tokens.split("-"))
        return self.tokens(int(self.rng.randint(lo, hi) * s))

    def reusable(self, prompt: list[int]) -> int:
        best = max([lcp(prompt, h) for h in self.seen[-64:]], default=0)
        return min(best, len(prompt) - 1)

    async def run(self, url: str, model: str, concurrency: int) -> tuple[list[Result], float]:
        results: list[Result] = []
        gate = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency + 4)
        async with httpx.AsyncClient(base_url=url, timeout=None, limits=limits) as client:

            async def session(g: int) -> None:
                async with gate:
                    history = self.system + self.tokens(int(self.args.task_tokens
                                                            * self.args.scale))
                    for t in range(self.turns):
                        prompt = history + (self.new_tokens() if t else [])
                        reusable = self.reusable(prompt)
                        r = await send(client, model, prompt, self.output)
                        r.group, r.turn, r.reusable = g, t, reusable
                        results.append(r)
                        history = prompt + r.output
                        self.seen.append(history[:-1])

            start = time.perf_counter()
            await asyncio.gather(*(session(g) for g in range(self.groups)))
        return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


def summarize(results: list[Result], seconds: float) -> dict:
    turns = sorted({r.turn for r in results})
    by_turn = {t: [r.ttft * 1e3 for r in results if r.turn == t] for t in turns}
    reusable = sum(r.reusable for r in results)
    return {
        "requests": len(results),
        "seconds": seconds,
        "prompt_tokens": sum(r.prompt_len for r in results),
        "output_tokens": sum(len(r.output) for r in results),
        "reusable_tokens": reusable,
        "cached_tokens": sum(r.cached for r in results),
        "hit_rate": sum(min(r.cached, r.reusable) for r in results) / reusable
        if reusable else None,
        "tokens_per_s": sum(r.prompt_len + len(r.output) for r in results) / seconds,
        "output_tokens_per_s": sum(len(r.output) for r in results) / seconds,
        "ttft_ms_by_turn": {t: {"p50": pct(v, 50), "p99": pct(v, 99)}
                            for t, v in by_turn.items()},
        "ttft_ms_p50_from_turn_5": pct([r.ttft * 1e3 for r in results if r.turn >= 5], 50),
    }


def metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for name in ("prefix_cache_hits_total", "prefix_cache_queries_total", "prefix_checkpoints",
                 "prefix_checkpoint_usage_perc", "kv_cache_usage_perc"):
        m = re.search(rf"^pagedserve:{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else None
    return out


async def cold_check(url: str, model: str, vocab: int, args: argparse.Namespace) -> list[dict]:
    """Hits against cold prompts of their uncached tokens only, each sent alone."""
    rng = random.Random(99)
    s = args.scale
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        for _ in range(args.cold_probes):
            history = [rng.randrange(vocab) for _t in range(int(args.probe_history * s))]
            warm = await send(client, model, history, 2)
            new = [rng.randrange(vocab) for _t in range(int(args.user_tokens * s))]
            hit = await send(client, model, history + warm.output + new, 2)
            uncached = hit.prompt_len - hit.cached
            cold = await send(client, model, [rng.randrange(vocab) for _t in range(uncached)], 2)
            out.append({"prompt": hit.prompt_len, "cached": hit.cached, "uncached": uncached,
                        "hit_ttft_ms": hit.ttft * 1e3, "cold_ttft_ms": cold.ttft * 1e3,
                        "ratio": hit.ttft / cold.ttft})
    return out


def serve(flags: list[str], log: Path) -> ServerProcess:
    server = ServerProcess(["--no-access-log", *flags], log, startup_timeout=900)
    print(f"starting: pagedserve serve {' '.join(server.args)}", file=sys.stderr)
    server.start()
    return server


def run_server(args: argparse.Namespace, flags: list[str], logs: Path, caching: bool) -> dict:
    name = "on" if caching else "off"
    server = serve(flags + ["--enable-prefix-caching" if caching else
                            "--no-enable-prefix-caching"], logs / f"serve-{name}.log")
    try:
        url = server.url or ""
        info = httpx.get(url + "/server_info", timeout=30).json()
        model, vocab = info["model"], info["vocab_size"]
        out: dict = {"server": info, "chat": {}, "agent": None}
        for c in args.concurrency:
            res, sec = asyncio.run(Workload(args, "chat", vocab, c).run(url, model, c))
            out["chat"][c] = summarize(res, sec)
            print(f"[{name}] chat c={c}: {sec:.1f} s", file=sys.stderr)
        res, sec = asyncio.run(Workload(args, "agent", vocab, 1).run(url, model, args.agents))
        out["agent"] = summarize(res, sec)
        print(f"[{name}] agent: {sec:.1f} s", file=sys.stderr)
        out["metrics"] = metrics(url)
        if caching:
            out["cold_check"] = asyncio.run(cold_check(url, model, vocab, args))
        return out
    finally:
        server.stop()


def budget_sweep(args: argparse.Namespace, flags: list[str], logs: Path,
                 per_checkpoint: int) -> list[dict]:
    points = []
    for count in args.sweep_checkpoints:
        server = serve(flags + ["--prefix-checkpoint-memory", str(count * per_checkpoint)],
                       logs / f"serve-sweep-{count}.log")
        try:
            url = server.url or ""
            info = httpx.get(url + "/server_info", timeout=30).json()
            res, sec = asyncio.run(Workload(args, "agent", info["vocab_size"], 1).run(
                url, info["model"], args.agents))
            s = summarize(res, sec)
            points.append({"checkpoints": count, "hit_rate": s["hit_rate"],
                           "seconds": sec, "metrics": metrics(url)})
            print(f"[sweep] {count} checkpoints: hit rate {s['hit_rate']}", file=sys.stderr)
        finally:
            server.stop()
    return points


def targets(on: dict, off: dict) -> list[dict]:
    hit = [on["chat"][c]["hit_rate"] for c in on["chat"]] + [on["agent"]["hit_rate"]]
    cold = on.get("cold_check") or []
    worst = max((c["ratio"] for c in cold), default=None)
    a_on, a_off = on["agent"]["ttft_ms_p50_from_turn_5"], off["agent"]["ttft_ms_p50_from_turn_5"]
    speed = a_off / a_on if a_on and a_off else None
    tput = on["agent"]["tokens_per_s"] / off["agent"]["tokens_per_s"]

    def row(measure: str, target: str, value: str, ok: bool | None) -> dict:
        return {"measure": measure, "target": target, "value": value, "ok": ok}

    return [
        row("hit rate over reusable tokens (each workload)", ">= 95%",
            ", ".join("-" if h is None else f"{100 * h:.1f}%" for h in hit),
            all(h is not None and h >= 0.95 for h in hit)),
        row("hit TTFT / TTFT of a cold prompt of its uncached tokens", "<= 1.3x",
            "-" if worst is None else f"worst {worst:.2f}x of {len(cold)}",
            None if worst is None else worst <= 1.3),
        row("agent loop TTFT p50 from step 5, off / on", ">= 8x",
            "-" if speed is None else f"{speed:.1f}x", None if speed is None else speed >= 8),
        row(f"agent loop throughput (concurrency {on['server_agents']}), on / off", ">= 2x",
            f"{tput:.2f}x", tput >= 2),
    ]


def write_markdown(path: Path, report: dict) -> None:
    on, off = report["on"], report["off"]
    lines = [
        "# Prefix caching benchmark", "",
        f"Generated by `{report['command']}` on {report['date']} ({report['gpu']}, commit "
        f"{report['commit']}). Caching on and off side by side, through the server.", "",
        "## Targets", "", "| measure | target | value | ok |", "|---|---|---|---|",
        *(f"| {t['measure']} | {t['target']} | {t['value']} | "
          f"{'-' if t['ok'] is None else ('yes' if t['ok'] else 'NO')} |"
          for t in report["targets"]),
        "", "## Workloads", "",
        "| workload | caching | requests | hit rate | cached / reusable tokens | tok/s | "
        "out tok/s | wall s |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for label, side in (("on", on), ("off", off)):
        for name, s in [(f"chat c={c}", v) for c, v in side["chat"].items()] + \
                [(f"agent c={report['on']['server_agents']}", side["agent"])]:
            hit = "-" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%"
            lines.append(f"| {name} | {label} | {s['requests']} | {hit} | {s['cached_tokens']} / "
                         f"{s['reusable_tokens']} | {s['tokens_per_s']:.0f} | "
                         f"{s['output_tokens_per_s']:.1f} | {s['seconds']:.1f} |")
    lines += ["", "## TTFT by turn (ms, p50 / p99)", ""]
    def sides(c: int | None) -> tuple[dict, dict]:
        return (on["agent"], off["agent"]) if c is None else (on["chat"][c], off["chat"][c])

    for name, c in [(f"chat c={c}", c) for c in on["chat"]] + [("agent", None)]:
        a_side, b_side = sides(c)
        lines += [f"**{name}**", "", "| turn | on p50 | on p99 | off p50 | off p99 |",
                  "|---:|---:|---:|---:|---:|"]
        for t, a in a_side["ttft_ms_by_turn"].items():
            b = b_side["ttft_ms_by_turn"].get(t, {})
            lines.append(f"| {t} | {a['p50']:.1f} | {a['p99']:.1f} | "
                         f"{b.get('p50', 0):.1f} | {b.get('p99', 0):.1f} |")
        lines.append("")
    m = on["metrics"]
    use = 100 * (m["prefix_checkpoint_usage_perc"] or 0)
    lines += ["## Checkpoint pool", "",
              f"{on['server']['prefix_checkpoints']} checkpoints of "
              f"{on['server']['prefix_checkpoint_bytes'] / 2**20:.1f} MiB; at the end "
              f"{m['prefix_checkpoints']:.0f} held ({use:.0f}%"
              f"); server counters: {m['prefix_cache_hits_total']:.0f} hit of "
              f"{m['prefix_cache_queries_total']:.0f} queried tokens.", "",
              "| checkpoints | agent hit rate |", "|---:|---:|",
              *(f"| {p['checkpoints']} | {100 * (p['hit_rate'] or 0):.1f}% |"
                for p in report["budget_sweep"]),
              "", "## Hit vs cold TTFT (alone)", "",
              "| prompt | cached | uncached | hit ms | cold ms | ratio |",
              "|---:|---:|---:|---:|---:|---:|",
              *(f"| {c['prompt']} | {c['cached']} | {c['uncached']} | {c['hit_ttft_ms']:.1f} | "
                f"{c['cold_ttft_ms']:.1f} | {c['ratio']:.2f} |" for c in on["cold_check"]),
              "", f"![prefix caching]({path.stem}.png)", ""]
    path.write_text("\n".join(lines))


def write_plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for label, side, style in (("on", report["on"], "-o"), ("off", report["off"], "--x")):
        for name, s in [(f"chat c={c}", v) for c, v in side["chat"].items()] + \
                [("agent", side["agent"])]:
            turns = sorted(s["ttft_ms_by_turn"], key=int)
            ax = axes[1] if name == "agent" else axes[0]
            ax.plot([int(t) for t in turns], [s["ttft_ms_by_turn"][t]["p50"] for t in turns],
                    style, label=f"{name} {label}")
    for ax, title in ((axes[0], "chat: TTFT p50 by turn"), (axes[1], "agent: TTFT p50 by step")):
        ax.set_title(title)
        ax.set_xlabel("turn")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    sweep = report["budget_sweep"]
    axes[2].plot([p["checkpoints"] for p in sweep], [100 * (p["hit_rate"] or 0) for p in sweep],
                 "-o")
    axes[2].set_title("agent loop: hit rate vs checkpoint budget")
    axes[2].set_xlabel("checkpoints")
    axes[2].set_ylabel("% of reusable tokens hit")
    axes[2].grid(True, alpha=0.3)
    fig.suptitle(f"prefix caching: {report['on']['server']['model']} on {report['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny CPU run with the tiny random model")
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--server-args", default="",
                   help="more `pagedserve serve` flags, e.g. '--cache-type-k q4_0 ...'")
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every token count")
    p.add_argument("--concurrency", default="8,16", help="chat: conversations in flight")
    p.add_argument("--conversations", type=int, default=32)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=1000)
    p.add_argument("--chat-output", type=int, default=200)
    p.add_argument("--agents", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--system-tokens", type=int, default=8192)
    p.add_argument("--task-tokens", type=int, default=200)
    p.add_argument("--tool-tokens", default="500-2000")
    p.add_argument("--agent-output", type=int, default=100)
    p.add_argument("--cold-probes", type=int, default=4)
    p.add_argument("--probe-history", type=int, default=8192)
    p.add_argument("--sweep-checkpoints", default="4,16,64",
                   help="checkpoint budgets (counts) of the agent-loop sweep; '' for none")
    p.add_argument("--out", default="docs/benchmarks")
    p.add_argument("--name", default=None, help="file stem (default prefix, quick: prefix_quick)")
    p.add_argument("--server-logs", default=None,
                   help="keep the servers' logs in DIR as serve-*.log (never the tree)")
    if p.parse_args(argv).quick:  # smaller defaults; explicit flags still win
        p.set_defaults(concurrency="2", conversations=3, turns=3, user_tokens=24,
                       chat_output=4, agents=3, steps=6, system_tokens=64, task_tokens=8,
                       tool_tokens="8-20", agent_output=3, cold_probes=1, probe_history=48,
                       sweep_checkpoints="2,8", model=str(random_model_path()))
    args = p.parse_args(argv)
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    args.sweep_checkpoints = [int(c) for c in str(args.sweep_checkpoints).split(",") if c]
    args.name = args.name or ("prefix_quick" if args.quick else "prefix")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = ["--device", args.device, *args.server_args.split()]
    if args.model:
        flags += ["--model", args.model]
    with tempfile.TemporaryDirectory(prefix="bench-prefix-") as tmp:
        # The servers' logs go to --server-logs as they are written (a run cut short
        # keeps them), else to the temporary directory.
        logs = Path(args.server_logs or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        on = run_server(args, flags, logs, caching=True)
        off = run_server(args, flags, logs, caching=False)
        sweep = budget_sweep(args, flags, logs, on["server"]["prefix_checkpoint_bytes"])
    # The caching-on run is the sweep's point at the default budget.
    sweep.append({"checkpoints": on["server"]["prefix_checkpoints"],
                  "hit_rate": on["agent"]["hit_rate"], "seconds": on["agent"]["seconds"],
                  "metrics": on["metrics"]})
    sweep.sort(key=lambda p: p["checkpoints"])
    on["server_agents"] = off["server_agents"] = args.agents
    gpu = on["server"].get("device_name") or args.device
    report = {"date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "gpu": gpu,
              "commit": source_commit(), "command": " ".join(["bench_prefix.py", *sys.argv[1:]]),
              "settings": {k: v for k, v in vars(args).items()}, "on": on, "off": off,
              "budget_sweep": sweep}
    report["targets"] = targets(on, off)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    write_plot(out / f"{args.name}.png", report)
    write_markdown(out / f"{args.name}.md", report)
    for t in report["targets"]:
        print(f"{t['measure']:<62} {t['target']:>8}  {t['value']}  "
              f"{'-' if t['ok'] is None else ('ok' if t['ok'] else 'MISSED')}")
    print("wrote " + ", ".join(str(out / f"{args.name}.{e}") for e in ("md", "json", "png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
