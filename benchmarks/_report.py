"""Turns ``bench_attention`` results into the target verdicts, markdown, a figure and a
short console table."""

from __future__ import annotations

from pathlib import Path

from _common import md_table

MiB, GiB = 1 << 20, 1 << 30


def _t(d: dict | None, method: str) -> float | None:
    return None if d is None else d.get(method)


def _ratio(num: float | None, den: float | None) -> float | None:
    return None if not num or not den else num / den


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "error" if x is None else format(x, spec)


def _opt(row: dict, key: str, m: str) -> float | None:
    """A timing that only some rows have; absent -> not applicable."""
    return _t(row.get(key), m)


def _cell(row: dict, key: str, value: float | None, spec: str = ".1f") -> str:
    return "-" if key not in row else _fmt(value, spec)


def _ctx(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def targets(res: dict) -> list[dict]:
    """Issue 3's targets, per timing method."""
    bw = res["copy_bandwidth_gbs"]
    out = []
    for m in res["methods"]:
        uni = res["uniform"]
        pc = [(_ratio(_t(r["contig_us"], m), _t(r["paged_us"], m)), r) for r in uni]
        sd = [(_ratio(_t(r.get("sdpa_us"), m), _t(r["paged_us"], m)), r)
              for r in uni if r["kv_type"] == "f16"]
        rag = {r["kv_type"]: r for r in res["ragged"]}
        q4 = rag.get("q4_0")
        f16 = rag.get("f16")

        def worst(pairs):
            vals = [(v if v is not None else 0.0, r) for v, r in pairs]
            v, r = min(vals, key=lambda x: x[0])
            return v, f"{r['kv_type']} n={r['n_seq']} ctx={r['ctx']}"

        v, where = worst(pc)
        out.append(dict(method=m, measure="paged / contiguous, every uniform point",
                        target=">= 0.97", value=f"min {v:.3f} ({where})", ok=v >= 0.97))
        q4_us = _t(q4["paged_us"], m) if q4 else None
        frac = q4["live_bytes"] / (q4_us * 1e-6) / 1e9 / bw if q4_us else 0.0
        out.append(dict(method=m, measure="ragged q4_0, fraction of copy bandwidth",
                        target=">= 0.75", value=f"{frac:.2f} ({_fmt(q4_us)} us)",
                        ok=frac >= 0.75))
        v, where = worst(sd)
        out.append(dict(method=m, measure="f16 paged vs SDPA, every uniform point",
                        target=">= 1.0x", value=f"min {v:.2f}x ({where})", ok=v >= 1.0))
        r = _ratio(_t(f16.get("sdpa_mask_us"), m), _t(f16["paged_us"], m)) if f16 else None
        out.append(dict(method=m, measure="f16 paged vs SDPA padded with a mask, ragged",
                        target=">= 5x", value=f"{_fmt(r, '.2f')}x", ok=bool(r and r >= 5)))
    return out


def _uniform_rows(res: dict, m: str) -> list[list[str]]:
    bw = res["copy_bandwidth_gbs"]
    rows = []
    for r in res["uniform"]:
        p, c, s = _t(r["paged_us"], m), _t(r["contig_us"], m), _opt(r, "sdpa_us", m)
        gbs = r["live_bytes"] / (p * 1e-6) / 1e9 if p else None
        errs = [r.get(k) for k in ("paged_err", "contig_err", "sdpa_err") if k in r]
        ok = all(e is not None and e <= res["check_bound"] for e in errs)
        rows.append([
            r["kv_type"], r["n_seq"], _ctx(r["ctx"]), f"{r['live_bytes'] / 1e6:.1f}",
            _fmt(p), _fmt(c), _fmt(_ratio(c, p), ".3f"), _fmt(gbs, ".0f"),
            _fmt(gbs / bw if gbs else None, ".2f"), _cell(r, "sdpa_us", s),
            _cell(r, "sdpa_us", _ratio(s, p), ".2f"),
            f"{max(e for e in errs if e is not None):.1e}" + ("" if ok else " FAIL"),
        ])
    return rows


def markdown(res: dict) -> str:
    meta, bw = res["meta"], res["copy_bandwidth_gbs"]
    parts = [
        "# Attention-op benchmark (issue 3)\n",
        f"- date: {meta['date']}\n- GPU: {meta['gpu']} ({meta['sm_count']} SMs)\n"
        f"- commit: {meta['commit']}\n- torch {meta['torch']}, triton {meta['triton']}, "
        f"python {meta['python']}\n"
        f"- shape: D={res['shape']['D']}, Hq={res['shape']['Hq']}, Hkv={res['shape']['Hkv']}, "
        f"block {res['shape']['block_size']}; q float16\n"
        f"- device copy bandwidth: **{bw:.0f} GB/s** (read + written)\n"
        f"- outputs checked against the torch reference: max error / max |ref| <= "
        f"{res['check_bound']}\n"
        f"- run time: {res['elapsed_s']:.0f} s\n",
        "Timing (`benchmarks/_common.py`): medians of CUDA-event times per call over rounds "
        "of calls on rotating input copies (each round reads >= 4x L2). **graph**: rounds "
        "replayed from a CUDA graph (no host launch overhead; the engine's decode path). "
        "**eager**: rounds issued from Python. The same method times every side.\n",
        "## Targets\n",
        md_table(["method", "measure", "target", "result", "met"],
                 [[t["method"], t["measure"], t["target"], t["value"],
                   "yes" if t["ok"] else "**no**"] for t in res["targets"]]),
        "## Launch configuration (" + ("the sweep's winners" if res["sweep"] else
                                        "the library's defaults") + ")\n",
        md_table(["K/V type", "config"], [[f, str(c)] for f, c in res["launch"].items()]),
    ]
    header = ["K/V", "n", "ctx", "live MB", "paged us", "contig us", "paged / contig",
              "GB/s live", "of copy BW", "SDPA us", "paged vs SDPA", "max err"]
    for m in res["methods"]:
        parts += [f"## Uniform batches ({m})\n", md_table(header, _uniform_rows(res, m))]
    parts.append("## Ragged 128K + 7 x 8K (shuffled blocks)\n")
    parts.append("The contiguous kernel reads only live rows of the padded layout (it is "
                 "length-aware), so paged / contiguous isolates addressing cost here too; the "
                 "padded layout's cost is memory (capacity table below).\n")
    rows = []
    for r in res["ragged"]:
        for m in res["methods"]:
            p, c = _t(r["paged_us"], m), _t(r["contig_us"], m)
            gbs = r["live_bytes"] / (p * 1e-6) / 1e9 if p else None
            sm, ss = _opt(r, "sdpa_mask_us", m), _opt(r, "sdpa_per_seq_us", m)
            rows.append([r["kv_type"], m, f"{r['live_bytes'] / 1e6:.0f}", _fmt(p), _fmt(c),
                         _fmt(_ratio(c, p), ".3f"), _fmt(gbs, ".0f"),
                         _fmt(gbs / bw if gbs else None, ".2f"), _cell(r, "sdpa_mask_us", sm),
                         _cell(r, "sdpa_mask_us", _ratio(sm, p), ".2f"),
                         _cell(r, "sdpa_per_seq_us", ss),
                         _cell(r, "sdpa_per_seq_us", _ratio(ss, p), ".2f")])
    parts.append(md_table(["K/V", "method", "live MB", "paged us", "contig us",
                           "paged / contig", "GB/s live", "of copy BW", "SDPA+mask us",
                           "paged vs SDPA+mask", "SDPA per seq us", "paged vs per seq"], rows))
    errs = [[r["kv_type"]] + [f"{r[k]:.1e}" if r.get(k) is not None else "-" for k in
                              ("paged_err", "contig_err", "sdpa_mask_err", "sdpa_per_seq_err")]
            for r in res["ragged"]]
    parts.append(md_table(["K/V", "paged err", "contig err", "SDPA+mask err",
                           "SDPA per seq err"], errs))
    cap = res["capacity"]
    parts += [
        "## K/V capacity, 128K + 7 x 8K, q4_0 (16 full-attention layers)\n",
        md_table(["layout", "one layer", "16 layers"], [
            ["padded contiguous", f"{cap['padded_bytes_per_layer'] / MiB:.0f} MiB",
             f"{cap['padded_bytes'] / GiB:.3f} GiB"],
            ["paged", f"{cap['paged_bytes_per_layer'] / MiB:.0f} MiB",
             f"{cap['paged_bytes'] / GiB:.3f} GiB"],
        ]),
        f"Paged uses {cap['ratio']:.2f}x less ({100 * cap['saving']:.2f}% saving); live "
        f"tokens {cap['live_tokens']}, padded slots {cap['padded_tokens']}. Allocated in "
        "this run (one layer, K+V): paged pool "
        + ", ".join(f"{r['kv_type']} {r['paged_pool_bytes'] / MiB:.0f} MiB vs padded "
                    f"{r['contig_bytes'] / MiB:.0f} MiB" for r in res["ragged"]) + ".\n",
    ]
    if res["sweep"]:
        parts.append(f"## Tuning sweep ({res['methods'][0]} timing; geometric mean over the "
                     "sweep cases; inf = failed or missed the error bound)\n")
        keys = ["type", "block_n", "num_warps", "num_stages", "quant_dot", "min_partition",
                "maxnreg", "table_read", "table_ahead", "occupancy", "geomean_us", "max_err"]
        parts.append(md_table(keys, [[_fmt(s[k], ".2e") if k == "max_err" and s[k] is not None
                                      else (f"{s[k]:.1f}" if k == "geomean_us" else s[k])
                                      for k in keys] for s in res["sweep"]]))
    return "\n".join(parts)


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bw, m = res["copy_bandwidth_gbs"], res["methods"][0]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    styles = {"q4_0": "tab:blue", "q8_0": "tab:orange", "f16": "tab:green"}
    for r_type, color in styles.items():
        for n, marker in zip((1, 2, 4, 8), "os^D"):
            pts = [r for r in res["uniform"] if r["kv_type"] == r_type and r["n_seq"] == n]
            if not pts:
                continue
            ctx = [r["ctx"] / 1024 for r in pts]
            frac = [r["live_bytes"] / (_t(r["paged_us"], m) or 1e9) / 1e3 / bw for r in pts]
            ratio = [_ratio(_t(r["contig_us"], m), _t(r["paged_us"], m)) or 0 for r in pts]
            label = f"{r_type} n={n}"
            axes[0, 0].plot(ctx, frac, marker=marker, color=color, label=label)
            axes[0, 1].plot(ctx, ratio, marker=marker, color=color, label=label)
            if r_type == "f16":
                sp = [_ratio(_t(r.get("sdpa_us"), m), _t(r["paged_us"], m)) or 0 for r in pts]
                axes[1, 0].plot(ctx, sp, marker=marker, color=color, label=label)
    axes[0, 0].set(title="paged: fraction of copy bandwidth (live K/V)", xscale="log",
                   xlabel="context (K tokens)")
    axes[0, 1].axhline(0.97, color="k", ls="--", lw=1)
    axes[0, 1].set(title="paged / contiguous throughput", xscale="log",
                   xlabel="context (K tokens)")
    axes[1, 0].axhline(1.0, color="k", ls="--", lw=1)
    axes[1, 0].set(title="f16: paged speed-up over torch SDPA", xscale="log",
                   xlabel="context (K tokens)")
    labels, vals = [], []
    for r in res["ragged"]:
        for key, name in (("paged_us", "paged"), ("contig_us", "contig"),
                          ("sdpa_mask_us", "SDPA+mask"), ("sdpa_per_seq_us", "SDPA/seq")):
            v = _t(r.get(key), m)
            if v:
                labels.append(f"{r['kv_type']}\n{name}")
                vals.append(v)
    axes[1, 1].bar(range(len(vals)), vals, color="tab:gray")
    axes[1, 1].set_xticks(range(len(vals)), labels, fontsize=8)
    axes[1, 1].set(title=f"ragged 128K + 7x8K: step time (us, {m})", yscale="log")
    for ax in axes.flat[:3]:
        ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
    meta = res["meta"]
    fig.suptitle(f"pagedserve attention op - {meta['gpu']} - {meta['date']} - "
                 f"{meta['commit']} - {m} timing")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def short_table(res: dict) -> str:
    lines = ["", "method  measure                                        target   result"]
    for t in res["targets"]:
        lines.append(f"{t['method']:6s}  {t['measure']:45s}  {t['target']:7s}  {t['value']}"
                     f"  {'OK' if t['ok'] else 'MISSED'}")
    m = res["methods"][0]
    for r in res["ragged"]:
        lines.append(f"ragged {r['kv_type']:5s} paged {_fmt(_t(r['paged_us'], m))} us  contig "
                     f"{_fmt(_t(r['contig_us'], m))} us ({m})")
    lines.append(f"copy bandwidth {res['copy_bandwidth_gbs']:.0f} GB/s; launch "
                 f"{res['launch']}")
    return "\n".join(lines)
