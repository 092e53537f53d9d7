"""FP8 linear-layer benchmark (issue 37): the Triton FP8 kernels against bf16, side by side.

The linear layers of the Qwen3.5-27B shape (random weights; FP8 where ``--quantization
fp8`` converts, in bf16 elsewhere: ``lm_head`` and the GDN ``in_proj_b``/``in_proj_a``),
one GPU, one run:

- **decode**: each distinct projection at 1 row (and any ``--decode-rows``): the FP8 op
  (``ops.fp8_linear``, the method the rule picks) against ``F.linear`` on a bf16 weight of
  the same shape. A step's time is the sum over the model's layers; its floor is the bytes
  a step reads (FP8 data and scales plus the bf16 rest, or all bf16) over the measured
  copy bandwidth (bytes read + written, ``_common.copy_bandwidth_gbs``).
- **prefill**: the same projections at 8192 rows: w8a8 (activations quantized per 1x128
  group, FP8 GEMM), the weight-only kernel, and bf16; TFLOP/s and the linear layers'
  tokens/s for the whole model.
- **crossover**: the FP8 methods and bf16 from 1 to 512 rows on two shapes: the
  measurement that sets ``fp8_matmul.W8A8_GEMV_MIN_ROWS`` and ``W8A8_MIN_ROWS``.
- ``--gemv-sweep`` / ``--gemm-sweep``: more launch configurations, timed as extra sides.

Graph replay, sides interleaved (``_common.time_sides``); each call reads its own copy of
the weight, enough copies that a round does not run from L2. Every FP8 output is checked
against the bf16 matmul of the dequantized weight (max error / max |ref| <= 2e-2 for
weight-only, 6e-2 for w8a8, whose activations are rounded to e4m3), so a wrong-but-fast
kernel cannot pass.

    python benchmarks/bench_fp8.py [--parts decode,prefill,crossover] [--out DIR]
    python benchmarks/bench_fp8.py --quick     # CPU dry run: tiny shapes, numbers meaningless

``--quick`` runs the Triton kernels under ``TRITON_INTERPRET=1`` when it is set (about a
minute), else (or with ``--backend reference``) the torch reference. Writes
``DIR/fp8.{md,json,png}`` (default docs/benchmarks), and copies to ``$OUT``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

from pagedserve import presets  # noqa: E402
from pagedserve.config import ModelConfig  # noqa: E402
from pagedserve.kernels import fp8_matmul, ops  # noqa: E402
from pagedserve.kernels.fp8_activations import quantize_activations  # noqa: E402
from pagedserve.kernels.fp8_gemm import GemmConfig  # noqa: E402
from pagedserve.kernels.fp8_gemv import GemvConfig, launch_config  # noqa: E402
from pagedserve.model.fp8_weights import packed_linears, runs_of  # noqa: E402
from pagedserve.model.qwen3_5 import Qwen3_5Model  # noqa: E402
from pagedserve.quant import fp8  # noqa: E402
from pagedserve.quant.config import ONLINE_NOT_CONVERTED, Fp8Config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PEAK_TFLOPS = {"bf16": 790.0, "fp8": 1580.0}  # H200 dense (docs/kernel-decisions.md)
ERROR_BOUND = {"weight_only": 2e-2, "w8a8_gemv": 6e-2, "w8a8": 6e-2, "w8a8_scaled_mm": 6e-2}
DECODE_METHODS = ("weight_only", "w8a8_gemv")
CROSSOVER_SHAPES = ("mlp.gate_up_proj", "mlp.down_proj")
# A toy hybrid for --quick: ragged blocks (hidden 200), fused parts off the block grid.
QUICK_CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text",
    "vocab_size": 300, "hidden_size": 200, "intermediate_size": 136,
    "num_hidden_layers": 4, "full_attention_interval": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 64, "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                        "partial_rotary_factor": 0.25},
    "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 64,
    "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "tie_word_embeddings": False,
    "max_position_embeddings": 4096, "hidden_act": "silu", "torch_dtype": "bfloat16",
}


@dataclass(frozen=True)
class Linear:
    """One distinct projection of the model: its fused parts, K, how many the model has,
    and whether ``--quantization fp8`` stores it in FP8."""

    name: str
    parts: tuple[int, ...]
    k: int
    count: int
    fp8: bool

    @property
    def n(self) -> int:
        return sum(self.parts)

    def bytes(self, quantized: bool) -> int:
        if quantized and self.fp8:
            nb = sum(fp8.num_blocks(p) for p in self.parts)
            return self.n * self.k + nb * fp8.num_blocks(self.k) * 4
        return self.n * self.k * 2


def linear_shapes(cfg: ModelConfig) -> list[Linear]:
    """The model's linear layers as ``--quantization fp8`` holds them: each fused weight
    split into its runs of FP8 and bf16 parts (as ``RowConcatLinear`` runs them), grouped
    by name without the layer index."""
    quant = Fp8Config(False, ONLINE_NOT_CONVERTED)
    with torch.device("meta"):
        model = Qwen3_5Model(cfg)
    counts: Counter[tuple[str, tuple[int, ...], int, bool]] = Counter()
    for linear in packed_linears(model, cfg.weight_prefix, quant):
        short = ".".join(p for p in linear.name.split(".") if not p.isdigit()
                         and p != "layers")
        for is_fp8, first, end in runs_of(linear.converted):
            label = short if end - first == len(linear.sources) else \
                f"{short}[{','.join(s.rsplit('.', 2)[-2] for s in linear.sources[first:end])}]"
            counts[(label, tuple(linear.rows[first:end]), linear.module.in_features,
                    is_fp8)] += 1
    return [Linear(name, parts, k, count, is_fp8)
            for (name, parts, k, is_fp8), count in counts.items()]


# ---- one shape ----------------------------------------------------------------------------


def copies_for(nbytes: int, l2_bytes: int, quick: bool) -> int:
    """Copies of a weight so that a round reads at least 4x the L2 (at least 2)."""
    return 1 if quick else max(2, -(-4 * l2_bytes // max(nbytes, 1)))


class Shape:
    """A projection's weights on the device: FP8 copies, bf16 copies, and one bf16
    reference (the dequantized FP8 weight) for the output check."""

    def __init__(self, lin: Linear, device: str, l2_bytes: int, quick: bool, seed: int = 0):
        gen = torch.Generator(device=device).manual_seed(seed)
        w = torch.randn(lin.n, lin.k, device=device, generator=gen) * 0.02
        self.lin = lin
        if lin.fp8:
            pieces = [fp8.quantize(p) for p in w.split(lin.parts)]
            data = torch.cat([q for q, _ in pieces])
            scale = torch.cat([s for _, s in pieces])
            self.reference = fp8.dequantize(data, scale, lin.parts, torch.bfloat16)
            copies = copies_for(lin.bytes(True), l2_bytes, quick)
            self.fp8 = [(data.clone(), scale.clone(), ops.fp8_counters(lin.n, device))
                        for _ in range(copies)]
        else:
            self.reference = w.bfloat16()
            self.fp8 = []
        copies = copies_for(lin.bytes(False), l2_bytes, quick)
        self.bf16 = [self.reference.clone() for _ in range(copies)]
        del w

    def activations(self, m: int, device: str) -> torch.Tensor:
        gen = torch.Generator(device=device).manual_seed(m)
        return torch.randn(m, self.lin.k, device=device, generator=gen).bfloat16()

    def fp8_calls(self, x: torch.Tensor, backend: str | None, method: str | None = None,
                  gemv: GemvConfig | None = None, gemm: GemmConfig | None = None) -> list:
        def call(data, scale, counters):
            if gemv is None and gemm is None:
                return lambda: ops.fp8_linear(x, data, scale, self.lin.parts, counters=counters,
                                              method=method, backend=backend)
            return lambda: fp8_matmul.fp8_linear(x, data, scale, self.lin.parts, counters,
                                                 method, gemv, gemm)
        return [call(*c) for c in self.fp8]

    def bf16_calls(self, x: torch.Tensor) -> list:
        return [(lambda w=w: F.linear(x, w)) for w in self.bf16]

    def error(self, x: torch.Tensor, call) -> float:
        ref = F.linear(x.float(), self.reference.float())
        out = call().float()
        return float((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def time_shape(shape: Shape, m: int, device: str, backend: str | None, methods: list[str],
               extra: dict[str, list] | None = None) -> dict:
    """Microseconds per call of each side at ``m`` rows, and each FP8 side's error."""
    x = shape.activations(m, device)
    sides: dict[str, list] = {"bf16": shape.bf16_calls(x)}
    errors = {}
    if shape.lin.fp8:
        data = shape.fp8[0][0]
        for method in methods:
            if method == "w8a8_scaled_mm" and not fp8_matmul.scaled_mm_applies(
                    data, shape.lin.parts, x.dtype):
                continue  # cuBLAS's block-scaled GEMM does not take it here
            sides[method] = shape.fp8_calls(x, backend, method)
            errors[method] = shape.error(x, sides[method][0])
            if errors[method] > ERROR_BOUND[method]:
                raise RuntimeError(f"{shape.lin.name} at {m} rows, {method}: error "
                                   f"{errors[method]:.3g} > {ERROR_BOUND[method]}")
        for label, calls in (extra or {}).items():
            sides[label] = calls(x)
    method = "graph" if device == "cuda" else "eager"
    us = _common.time_sides(sides, method, min_rounds=5 if m > 1024 else 15,
                            min_seconds=0.1 if m > 1024 else 0.15)
    return {"name": shape.lin.name, "rows": m, "us": us, "errors": errors}


def _free(device: str) -> None:
    if device == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---- parts --------------------------------------------------------------------------------


def run_decode(args, shapes: list[Linear], device: str, backend, l2: int, bw: float) -> dict:
    rows_out = []
    for lin in shapes:
        shape = Shape(lin, device, l2, args.quick)
        for m in args.decode_rows:
            extra = {}
            if args.gemv_sweep:
                extra = {f"gemv {spec}": _gemv_side(shape, spec, m, device)
                         for spec in args.gemv_sweep if _sweeps_rows(spec, m)}
            rule = fp8_matmul.method_for(m)
            # Several rows: both decode-kernel methods beside the rule's, whichever it is
            # (what rounding the rows to e4m3 buys).
            methods = [rule] + [d for d in DECODE_METHODS if d != rule and m > 1]
            r = time_shape(shape, m, device, backend, methods, extra)
            r["count"] = lin.count
            r["fp8"] = lin.fp8
            r["bytes"] = {"fp8": lin.bytes(True), "bf16": lin.bytes(False)}
            if lin.fp8:
                r["config"] = asdict(launch_config(m, lin.n, lin.k, _sms(device),
                                                   rule == "w8a8_gemv"))
            rows_out.append(r)
            print(f"decode {lin.name:40s} x{lin.count:<3d} rows {m:3d}: " + "  ".join(
                f"{k} {v:8.1f} us" for k, v in r["us"].items()), flush=True)
        del shape
        _free(device)
    steps = {}
    for m in args.decode_rows:
        pts = [r for r in rows_out if r["rows"] == m]
        fp8_us = sum(r["count"] * (r["us"][fp8_matmul.method_for(m)] if r["fp8"]
                                   else r["us"]["bf16"]) for r in pts)
        bf16_us = sum(r["count"] * r["us"]["bf16"] for r in pts)
        fp8_bytes = sum(r["count"] * r["bytes"]["fp8"] for r in pts)
        bf16_bytes = sum(r["count"] * r["bytes"]["bf16"] for r in pts)
        steps[m] = {"fp8_ms": fp8_us / 1e3, "bf16_ms": bf16_us / 1e3,
                    "fp8_floor_ms": fp8_bytes / (bw * 1e9) * 1e3,
                    "bf16_floor_ms": bf16_bytes / (bw * 1e9) * 1e3,
                    "fp8_bytes": fp8_bytes, "bf16_bytes": bf16_bytes}
        s = steps[m]
        print(f"step at {m} rows: FP8 {s['fp8_ms']:.2f} ms (floor {s['fp8_floor_ms']:.2f}), "
              f"bf16 {s['bf16_ms']:.2f} ms (floor {s['bf16_floor_ms']:.2f})", flush=True)
    return {"points": rows_out, "steps": steps}


def run_prefill(args, shapes: list[Linear], device: str, backend, l2: int) -> dict:
    m = args.prefill_rows
    rows_out = []
    for lin in shapes:
        shape = Shape(lin, device, l2, args.quick)
        extra = {f"gemm {spec}": _gemm_side(shape, spec) for spec in args.gemm_sweep}
        if lin.fp8 and fp8_matmul.scaled_mm_applies(shape.fp8[0][0], lin.parts,
                                                    torch.bfloat16):
            extra.update(_scaled_mm_pieces(shape))
        r = time_shape(shape, m, device, backend, ["w8a8_scaled_mm", "w8a8", "weight_only"],
                       extra)
        r["count"] = lin.count
        r["fp8"] = lin.fp8
        flops = 2.0 * m * lin.n * lin.k
        r["tflops"] = {k: flops / v / 1e6 for k, v in r["us"].items()}
        rows_out.append(r)
        print(f"prefill {lin.name:40s} x{lin.count:<3d} rows {m}: " + "  ".join(
            f"{k} {v:9.1f} us ({r['tflops'][k]:.0f} TFLOP/s)" for k, v in r["us"].items()),
            flush=True)
        del shape
        _free(device)
    totals = {}
    sides = ["w8a8", "weight_only", "bf16"]
    if any("w8a8_scaled_mm" in r["us"] for r in rows_out):
        sides.insert(0, "w8a8_scaled_mm")  # where it does not apply, the Triton w8a8
    for side in sides:
        us = sum(r["count"] * (r["us"].get(side, r["us"].get("w8a8")) if r["fp8"]
                               else r["us"]["bf16"]) for r in rows_out)
        totals[side] = {"ms": us / 1e3, "tokens_per_s": m / (us * 1e-6)}
    print("prefill linears: " + "  ".join(f"{k} {v['ms']:.1f} ms ({v['tokens_per_s']:.0f} tok/s)"
                                          for k, v in totals.items()), flush=True)
    return {"rows": m, "points": rows_out, "totals": totals}


def run_crossover(args, shapes: list[Linear], device: str, backend, l2: int) -> list[dict]:
    out: list[dict] = []
    for lin in shapes:
        if not lin.fp8 or (lin.name not in CROSSOVER_SHAPES and not args.quick):
            continue
        if args.quick and out:
            break  # one shape is enough to exercise the part
        shape = Shape(lin, device, l2, args.quick)
        for m in args.crossover_rows:
            r = time_shape(shape, m, device, backend,
                           ["weight_only", "w8a8_gemv", "w8a8", "w8a8_scaled_mm"])
            out.append(r)
            print(f"crossover {lin.name:30s} rows {m:4d}: " + "  ".join(
                f"{k} {v:8.1f} us" for k, v in r["us"].items()), flush=True)
        del shape
        _free(device)
    return out


def _sms(device: str) -> int:
    from pagedserve.kernels.decode_plan import device_num_sms

    return device_num_sms(torch.device(device))


def _form_of(spec: str) -> str:
    """The FORM field of a ``--gemv-sweep`` launch (``dot`` when left out)."""
    fields = spec.split("/")
    return fields[4] if len(fields) > 4 else "dot"


def _sweeps_rows(spec: str, m: int) -> bool:
    """Whether the launch ``spec`` takes ``m`` rows: fma one, dot and e4m3 any."""
    return _form_of(spec) != "fma" or m == 1


def _gemv_side(shape: Shape, spec: str, m: int, device: str):
    """``BLOCK_N/WARPS/STAGES/SPLITS[/FORM]`` at ``m`` rows (SPLITS 0: the rule's split
    for that block; FORM one of ``fp8_gemv.FORMS``, default ``dot``; the rows tile is the
    rule's)."""
    bn, warps, stages, splits = (int(v) for v in spec.split("/")[:4])
    form = _form_of(spec)
    lin = shape.lin
    rule = launch_config(m, lin.n, lin.k, _sms(device))
    splits = splits or rule.splits
    config = GemvConfig(rule.block_m, bn, splits, warps, stages, form)
    method = "w8a8_gemv" if form == "e4m3" else "weight_only"
    counters = [torch.zeros(-(-lin.n // bn), dtype=torch.int32, device=device)
                for _ in shape.fp8]

    def calls(x):
        return [(lambda d=d, s=s, c=c: fp8_matmul.fp8_linear(x, d, s, lin.parts, c,
                                                              method, config))
                for (d, s, _), c in zip(shape.fp8, counters)]
    return calls


def _scaled_mm_pieces(shape: Shape) -> dict:
    """``w8a8_scaled_mm``'s two launches as sides of their own: the activations'
    quantization, and cuBLAS's GEMM on activations quantized beforehand."""
    def quantize(x):
        return [lambda: quantize_activations(x, scales_row_contiguous=True)] * len(shape.fp8)

    def gemm(x):
        xq, xs = quantize_activations(x, scales_row_contiguous=True)
        return [(lambda d=d, s=s: torch._scaled_mm(xq, d.t(), scale_a=xs, scale_b=s.t(),
                                                   out_dtype=x.dtype))
                for d, s, _ in shape.fp8]
    return {"quantize only": quantize, "cuBLAS GEMM only": gemm}


def _gemm_side(shape: Shape, spec: str):
    """``BLOCK_M/BLOCK_N/GROUP_M/WARPS/STAGES``."""
    bm, bn, group, warps, stages = (int(v) for v in spec.split("/"))
    config = GemmConfig(bm, bn, group, warps, stages)
    return lambda x: shape.fp8_calls(x, None, "w8a8", gemm=config)


# ---- report -------------------------------------------------------------------------------


def markdown(res: dict) -> str:
    meta = res["meta"]
    out = [f"# FP8 linear layers\n\n{meta['date']}, {meta['gpu']}, commit {meta['commit']}, "
           f"torch {meta['torch']}, triton {meta['triton']}; backend {res['backend']}; "
           f"copy bandwidth {res['copy_gbs']:.0f} GB/s (read + written).\n"]
    dec = res.get("decode")
    if dec:
        out.append("\n## Decode: the model's linear layers per step\n\n"
                   "Sum over the layers of each projection's time (graph replay, FP8 and bf16 "
                   "side by side); floor: the bytes a step's linears read over the copy "
                   "bandwidth.\n\n")
        out.append(_common.md_table(
            ["rows", "FP8 ms", "FP8 floor ms", "bf16 ms", "bf16 floor ms", "bf16 / FP8"],
            [[m, f"{s['fp8_ms']:.2f}", f"{s['fp8_floor_ms']:.2f}", f"{s['bf16_ms']:.2f}",
              f"{s['bf16_floor_ms']:.2f}", f"{s['bf16_ms'] / s['fp8_ms']:.2f}x"]
             for m, s in dec["steps"].items()]))
        out.append("\nPer projection (us per call; GB/s of its weight bytes, FP8 side):\n\n")
        rows = []
        for r in dec["points"]:
            method = fp8_matmul.method_for(r["rows"])
            f = r["us"].get(method)
            gbs = f"{r['bytes']['fp8'] / (f * 1e3):.0f}" if f else "-"
            cfg = r.get("config")
            launch = f"{cfg['block_m']}x{cfg['block_n']}, split {cfg['splits']}" if cfg else "-"
            rows.append([r["name"], r["count"], r["rows"], method if f else "bf16",
                         f"{f:.1f}" if f else "-",
                         *(f"{r['us'][d]:.1f}" if d in r["us"] else "-" for d in DECODE_METHODS),
                         f"{r['us']['bf16']:.1f}", gbs, launch,
                         f"{r['errors'].get(method, 0):.1e}" if f else "-"])
        out.append(_common.md_table(["projection", "count", "rows", "FP8 method", "FP8 us",
                                     *(f"{d} us" for d in DECODE_METHODS), "bf16 us",
                                     "FP8 GB/s", "launch", "FP8 error"], rows))
        swept = [r for r in dec["points"] if any(k.startswith("gemv ") for k in r["us"])]
        if swept:
            names = list(dict.fromkeys(k for r in swept for k in r["us"]
                                       if k.startswith("gemv ")))
            out.append("\nDecode-kernel launches (BLOCK_N/warps/stages/splits/form), us; "
                       "default: the rule's method and launch:\n\n")
            out.append(_common.md_table(
                ["projection", "rows", "default", *names],
                [[r["name"], r["rows"], f"{r['us'][fp8_matmul.method_for(r['rows'])]:.1f}",
                  *(f"{r['us'][k]:.1f}" if k in r["us"] else "-" for k in names)]
                 for r in swept]))
    pre = res.get("prefill")
    if pre:
        out.append(f"\n## Prefill: {pre['rows']} rows\n\n")
        out.append(_common.md_table(
            ["side", "linears ms", "tokens/s", "against bf16"],
            [[k, f"{v['ms']:.1f}", f"{v['tokens_per_s']:.0f}",
              f"{pre['totals']['bf16']['ms'] / v['ms']:.2f}x"] for k, v in pre["totals"].items()]))
        out.append("\nPer projection, us (TFLOP/s):\n\n")
        sides = [k for k in pre["points"][0]["us"]]
        for r in pre["points"]:
            sides += [k for k in r["us"] if k not in sides]
        out.append(_common.md_table(
            ["projection", "count", *sides],
            [[r["name"], r["count"], *(f"{r['us'][k]:.0f} ({r['tflops'][k]:.0f})"
                                        if k in r["us"] else "-" for k in sides)]
             for r in pre["points"]]))
    cross = res.get("crossover")
    if cross:
        out.append("\n## Crossover: weight-only against w8a8 by rows (us)\n\n"
                   f"`W8A8_GEMV_MIN_ROWS` is {res['w8a8_gemv_min_rows']}, "
                   f"`W8A8_MIN_ROWS` {res['w8a8_min_rows']}.\n\n")
        fp8_sides = ("weight_only", "w8a8_gemv", "w8a8", "w8a8_scaled_mm")
        out.append(_common.md_table(
            ["projection", "rows", "weight-only", "w8a8 (decode kernel)", "w8a8 (Triton GEMM)",
             "w8a8 (cuBLAS)", "bf16",
             "faster FP8"],
            [[r["name"], r["rows"], *(f"{r['us'][k]:.1f}" if k in r["us"] else "-"
                                      for k in fp8_sides), f"{r['us']['bf16']:.1f}",
              min((k for k in fp8_sides if k in r["us"]), key=lambda k: r["us"][k])]
             for r in cross]))
    return "".join(out)


def figure(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    dec = res.get("decode")
    if dec:
        pts = [r for r in dec["points"] if r["rows"] == min(dec["steps"]) and r["fp8"]]
        xs = range(len(pts))
        method = fp8_matmul.method_for(min(dec["steps"]))
        axes[0].bar([x - 0.2 for x in xs], [r["us"][method] for r in pts], 0.4, label="FP8")
        axes[0].bar([x + 0.2 for x in xs], [r["us"]["bf16"] for r in pts], 0.4, label="bf16")
        axes[0].set_xticks(list(xs), [r["name"] for r in pts], rotation=30, ha="right",
                           fontsize=7)
        axes[0].set_ylabel("us per call")
        axes[0].set_title(f"decode, {min(dec['steps'])} row(s)")
        axes[0].legend()
    cross = res.get("crossover")
    if cross:
        for name in dict.fromkeys(r["name"] for r in cross):
            pts = [r for r in cross if r["name"] == name]
            for side, style in (("weight_only", "-"), ("w8a8_gemv", "-."), ("w8a8", "--"),
                                ("bf16", ":")):
                axes[1].plot([r["rows"] for r in pts], [r["us"][side] for r in pts], style,
                             marker="o", label=f"{name} {side}")
        axes[1].set_xscale("log", base=2)
        axes[1].set_yscale("log")
        axes[1].set_xlabel("rows")
        axes[1].set_ylabel("us per call")
        axes[1].set_title("weight-only against w8a8")
        axes[1].legend(fontsize=6)
    fig.suptitle(f"FP8 linear layers, {res['meta']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="decode,prefill,crossover")
    ap.add_argument("--quick", action="store_true",
                    help="CPU dry run: tiny shapes (Triton interpreter if TRITON_INTERPRET=1)")
    ap.add_argument("--backend", choices=ops.BACKENDS, default=None,
                    help="--quick only: 'reference' skips the interpreter (default: triton "
                         "when TRITON_INTERPRET=1, else reference)")
    ap.add_argument("--decode-rows", default="1")
    ap.add_argument("--prefill-rows", type=int, default=8192)
    ap.add_argument("--crossover-rows", default="1,2,4,8,16,32,64,128,256,512")
    ap.add_argument("--gemv-sweep", default="",
                    help="decode-kernel launches BLOCK_N/WARPS/STAGES/SPLITS[/FORM], "
                         "';'-separated, timed at every --decode-rows count they take "
                         "(SPLITS 0: the rule's; FORM dot, fma (one row) or e4m3 (w8a8))")
    ap.add_argument("--gemm-sweep", default="",
                    help="w8a8 launches BLOCK_M/BLOCK_N/GROUP_M/WARPS/STAGES, ';'-separated")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args(argv)
    args.decode_rows = _ints(args.decode_rows)
    args.crossover_rows = _ints(args.crossover_rows)
    args.gemv_sweep = [s for s in args.gemv_sweep.split(";") if s]
    args.gemm_sweep = [s for s in args.gemm_sweep.split(";") if s]
    if args.quick:
        device = "cpu"
        interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
        backend = args.backend or ("triton" if interpret else "reference")
        cfg = ModelConfig.from_hf_dict(QUICK_CONFIG)
        args.prefill_rows = 70
        args.crossover_rows = [1, fp8_matmul.W8A8_MIN_ROWS]
        bw = _common.copy_bandwidth_gbs(1 << 24)
        l2 = 1 << 20
    else:
        if not torch.cuda.is_available():
            raise SystemExit("bench_fp8.py needs CUDA (or --quick for a CPU dry run)")
        device, backend = "cuda", None
        cfg = ModelConfig.from_path(presets.config_path("qwen3.5-27b"))
        bw = _common.copy_bandwidth_gbs()
        l2 = 0
    meta = _common.run_meta()
    l2 = l2 or meta["l2_bytes"]
    shapes = linear_shapes(cfg)
    parts = set(args.parts.split(","))
    res: dict = {"meta": meta, "backend": backend or "triton", "copy_gbs": bw,
                 "w8a8_gemv_min_rows": fp8_matmul.W8A8_GEMV_MIN_ROWS,
                 "w8a8_min_rows": fp8_matmul.W8A8_MIN_ROWS,
                 "shapes": [asdict(s) for s in shapes]}
    if "decode" in parts:
        res["decode"] = run_decode(args, shapes, device, backend, l2, bw)
    if "prefill" in parts:
        res["prefill"] = run_prefill(args, shapes, device, backend, l2)
    if "crossover" in parts:
        res["crossover"] = run_crossover(args, shapes, device, backend, l2)
    paths = _common.write_outputs(args.out, "fp8", res, markdown(res), lambda p: figure(res, p))
    print("wrote", *paths)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
