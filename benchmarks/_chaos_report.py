"""Turns a ``bench_chaos`` report into markdown, a figure and a console summary."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path

from _common import md_table

_SERVER_FIELDS = ("model", "device_name", "dtype", "kv_layout", "cache_type_k", "cache_type_v",
                  "block_size", "num_blocks", "num_state_slots", "max_num_seqs",
                  "max_num_batched_tokens", "max_model_len", "max_queue", "cuda_graphs",
                  "commit", "torch_version")
_RESULT_COLORS = {"complete": "tab:green", "cut": "tab:orange", "timed_out": "tab:purple",
                  "refused": "tab:gray", "error": "tab:red", "cut_at_deadline": "tab:brown"}

CRITERION = """\
**Output criterion.** Every request is greedy (temperature 0, `ignore_eos`, `logprobs`
{logprobs}). After the chaos phase, {num_verify} requests that completed are sent again,
one at a time, to the idle server, and their tokens are compared with the chaos run's.
Random weights give logits with no meaning, and a different batch shape changes the
rounding of every GEMM, so two greedy runs may pick different tokens where the top two
logits lie within rounding of each other. At the first differing position (the prefixes are
equal, so both runs saw the same context), with `a` the chaos run's token and `b` the solo
run's, the gap is `max(lp_solo(b) - lp_solo(a), lp_chaos(a) - lp_chaos(b))` from each run's
top logprobs (a token missing from them counts the chosen logprob minus the smallest one
listed: a lower bound). A gap <= {tol} nats is a **near-tie** (reported, not a failure); a
larger one **fails**. The preset's logits spread with a standard deviation near 1.4 nats
(a normal(0, 0.02) head on a unit-RMS hidden state of width 5120), and the top few of its
248K tokens lie about 0.3 nats apart: a sequence that read another's K/V or a stale state
slot picks a token typically a nat or more below the clean run's choice, while rounding
swaps only tokens within the noise. The **drift** is that noise: the largest difference of
the chosen tokens' logprobs over the equal prefix; the tolerance must stand well above it.
A single corrupted position can still land on a near-tie by chance (about tolerance / 0.3
of the time), so one request proves little, but many are a sharp test.
"""


def _drift_stats(matches: list[dict]) -> str:
    drifts = [m["drift"] for m in matches if m.get("drift") is not None]
    if not drifts:
        return "no comparisons"
    drifts.sort()
    p99 = drifts[min(len(drifts) - 1, round(0.99 * (len(drifts) - 1)))]
    return (f"median {statistics.median(drifts):.2e}, p99 {p99:.2e}, max {drifts[-1]:.2e} "
            "nats")


def markdown(res: dict) -> str:
    s, server = res["settings"], res["server"]
    verdict = "**passed**" if res["passed"] else "**FAILED**"
    matches = res["matches"]
    kinds = Counter(r["kind"] for r in res["requests"])
    longs = sum(r["long"] for r in res["requests"])
    parts = [
        "# Chaos run (issue 32)\n",
        f"- date: {res['date']}\n- GPU: {res['gpu']}\n- commit: {res['commit']}\n"
        f"- client CPU: {res['client_cpu']}\n- command: `{res['command']}`\n"
        f"- server flags: `{' '.join(res['server_flags'])}`\n"
        f"- verdict: {verdict} (chaos phase {res['chaos_s']:.1f} s, solo reruns "
        f"{res['verify_s']:.1f} s)\n",
        f"Workload: {s['num_requests']} completions with token-id prompts at concurrency "
        f"{s['concurrency']} against max-num-seqs {s['max_num_seqs']} and a K/V pool of "
        f"{server.get('num_blocks')} blocks of {server.get('block_size')} tokens "
        f"({s['pool_factor']}x the longest request, {s['max_model_len']} tokens). Short "
        f"prompts lognormal around {s['short_len']} tokens; {longs} long ones, uniform in "
        f"[{s['max_prompt_len'] // 4}, {s['max_prompt_len']}], sent in bursts of "
        f"{s['long_burst']}. Up to {s['output_len']} output tokens each. Kinds: "
        + ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
        + f" (`stream_cut` closes the stream after a random number of tokens; "
        f"`whole_timeout` is a non-streaming request abandoned after a random "
        f"{s['timeout_range'][0]}-{s['timeout_range'][1]} s).\n",
        "## Checks\n",
        md_table(["check", "result", "detail"],
                 [[c["check"], "pass" if c["passed"] else "**FAIL**", c["detail"]]
                  for c in res["checks"]]),
        "## Outcomes\n",
        md_table(["kind:result", "requests"], sorted(res["results"].items())),
        md_table(["HTTP status", "responses"], sorted(res["statuses"].items())),
        "## Outputs against solo reruns\n",
        CRITERION.format(logprobs=s["logprobs"], num_verify=f"up to {s['num_verify']}"
                         if s["num_verify"] < 10**9 else "all", tol=s["tie_tolerance"]),
        f"Compared {len(matches)} requests ({sum(bool(m.get('long')) for m in matches)} "
        f"long): " + ", ".join(f"{v} {n}" for v, n in sorted(
            Counter(m["verdict"] for m in matches).items()))
        + f". Prefix logprob drift: {_drift_stats(matches)}.\n",
    ]
    drifts = [m["drift"] for m in matches if m.get("drift") is not None]
    if drifts and max(drifts) > s["tie_tolerance"] / 2:
        parts.append(f"**Note:** the largest drift ({max(drifts):.3f} nats) is more than "
                     f"half the tolerance ({s['tie_tolerance']}): rounding noise alone may "
                     "produce gaps above it here, so a failed comparison needs a look at "
                     "its gap against the drift before it is called corruption.\n")
    diverged = [m for m in matches if m["verdict"] != "exact"]
    if diverged:
        parts.append(md_table(
            ["request", "prompt", "verdict", "position", "chaos token", "solo token", "gap",
             "drift", "note"],
            [[m["index"], m.get("prompt_len", "-"), m["verdict"], m.get("position", "-"),
              m.get("chaos_token", "-"), m.get("solo_token", "-"),
              "-" if m.get("gap") is None else
              (">= " if m.get("gap_is_lower_bound") else "") + f"{m['gap']:.4f}",
              m.get("drift", "-"), m.get("note", "")] for m in diverged]))
    after = res["metrics_after_chaos"]
    parts += [
        "## Server metrics after the chaos phase\n",
        md_table(["metric", "value"], [[k, v] for k, v in sorted(after.items())
                                       if not k.endswith("_created")]),
        "![requests and pool over time](" + res["settings"]["name"] + ".png)\n",
        "## Server configuration\n",
        md_table(["setting", "value"], [[k, server.get(k)] for k in _SERVER_FIELDS
                                        if k in server]),
    ]
    errors = [r for r in res["requests"] if r["result"] == "error" or r["error"]
              and r["result"] != "refused"]
    if errors:
        parts += ["## Errors (first 10)\n",
                  "\n".join(f"- #{r['index']} {r['kind']} status {r['status']}: "
                            f"{(r['error'] or '')[:300]}" for r in errors[:10]) + "\n"]
    if res.get("server_log_tail"):
        parts += ["## Server log tail\n", "```\n" + res["server_log_tail"] + "\n```\n"]
    return "\n".join(parts)


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(12, 11), sharex=True)
    ax = axes[0]
    for result, color in _RESULT_COLORS.items():
        rows = [r for r in res["requests"] if r["result"] == result]
        if rows:
            ax.scatter([r["start_s"] for r in rows], [r["end_s"] - r["start_s"] for r in rows],
                       s=[12 + 60 * r["prompt_len"] / res["settings"]["max_prompt_len"]
                          for r in rows], c=color, alpha=0.6, label=f"{result} ({len(rows)})")
    ax.set(ylabel="latency (s)", title="requests: start time against latency (size: prompt "
           "length)")
    ax.legend(fontsize=8)
    timeline = [t for t in res["timeline"] if "error" not in t]
    ts = [t["t"] for t in timeline]
    for key, label in (("num_requests_running", "running"), ("num_requests_waiting",
                                                              "waiting")):
        axes[1].plot(ts, [t[key] for t in timeline], label=label)
    axes[1].set(ylabel="requests", title="server: running and waiting requests")
    axes[1].legend(fontsize=8)
    num_blocks = res["server"].get("num_blocks") or 1
    axes[2].plot(ts, [100 * (t["kv_cache_used_blocks"] or 0) / num_blocks for t in timeline],
                 label="K/V blocks used (%)")
    twin = axes[2].twinx()
    twin.plot(ts, [t["num_preemptions"] for t in timeline], color="tab:red",
              label="preemptions (cumulative)")
    axes[2].set(xlabel="seconds since the first request", ylabel="pool used (%)",
                title="server: K/V pool and preemptions")
    twin.set_ylabel("preemptions")
    axes[2].legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    for a in axes:
        a.grid(alpha=0.3)
    fig.suptitle(f"pagedserve chaos run - {res['gpu']} - {res['date']} - {res['commit']} - "
                 + ("passed" if res["passed"] else "FAILED"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summary(res: dict) -> str:
    lines = [f"{'check':22s} result  detail"]
    lines += [f"{c['check']:22s} {'pass' if c['passed'] else 'FAIL':6s}  {c['detail']}"
              for c in res["checks"]]
    return "\n".join(lines)
