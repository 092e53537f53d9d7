"""Probe: cuDNN's fused attention (through torch) for a long prefill chunk, against the
paged kernel and SDPA flash, on the 27B attention shape (Hq 24, Hkv 4, head_dim 256), bf16.

cuDNN's causal mask is aligned top-left, so a chunk of n rows over a prefix of ctx rows is
two calls and a merge of their log-sum-exps::

    keys        [ 0 ........ ctx-1 ][ ctx ........ ctx+n-1 ]
    call 1      full (no mask)       -
    call 2      -                    causal, square (top-left = bottom-right)

Sides, each checked against flash first (max abs difference):
- kernel: ``ops.paged_prefill_attention`` over an in-order bf16 pool (the scratch pool of
  the dequantize-once method);
- flash: SDPA flash with a lower-right causal bias, GQA;
- cudnn: ``prefill_cudnn.attend_chunk``, the method's own two calls and merge, on packed
  rows ``[L, Hkv, D]`` (GQA);
- cudnn_expanded: the same on K/V repeated to Hq heads beforehand.

``--check NxCTX,...`` (no timing) runs ``prefill_cudnn``'s own calls instead, on any sizes,
against float64 attention: the merged chunk as the method runs it and with a one-row call
left unpadded (``prefill_cudnn.MIN_QUERY_ROWS``), then each unpadded call's output and
log-sum-exp apart (the chunk's causal rows, the prefix), so that a wrong shape names its
part.

    python benchmarks/tools/probe_cudnn_attention.py [--cases 8192x0,8192x32768]
                                                     [--check 700x3000,129x1,16x15]
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import _common  # noqa: E402

from pagedserve.kernels import ops, prefill_cudnn  # noqa: E402
from pagedserve.kv.formats import KVBlockStorage  # noqa: E402

HQ, HKV, D = 24, 4, 256


def case(n: int, ctx: int, block_size: int = 16) -> None:
    dev = "cuda"
    length = ctx + n
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_k = torch.randn(length, HKV, D, device=dev, generator=gen, dtype=torch.bfloat16)
    rows_v = torch.randn(length, HKV, D, device=dev, generator=gen, dtype=torch.bfloat16)
    q = torch.randn(n, HQ, D, device=dev, generator=gen, dtype=torch.bfloat16)
    scale = D ** -0.5
    num_blocks = -(-length // block_size)
    cache_k, cache_v = KVBlockStorage.allocate_pair("bf16", "bf16", num_blocks, block_size,
                                                    HKV, D, dev)
    slots = torch.arange(length, device=dev)
    ops.kv_write(cache_k, rows_k, slots)
    ops.kv_write(cache_v, rows_v, slots)
    table = torch.arange(num_blocks, device=dev, dtype=torch.int32)[None]
    qsl = torch.tensor([0, n], dtype=torch.int32, device=dev)
    lens = torch.tensor([length], dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    qh = q.transpose(0, 1)[None]  # [1, Hq, n, D], BSHD strides
    kh = rows_k.transpose(0, 1)[None]  # [1, Hkv, L, D], BSHD strides
    vh = rows_v.transpose(0, 1)[None]
    rows_ke, rows_ve = (x.repeat_interleave(HQ // HKV, dim=1) for x in (rows_k, rows_v))
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    bias = causal_lower_right(n, length)

    def kernel():
        ops.paged_prefill_attention(q, cache_k, cache_v, table, qsl, lens, scale, out=out,
                                    query_start_loc_cpu=[0, n], seq_lens_cpu=[length],
                                    method="kernel")
        return out.transpose(0, 1)[None]

    def flash():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale,
                                                  enable_gqa=True)

    def cudnn(q, k, v):  # [n, Hq, D] over [ctx + n, H, D] -> [1, Hq, n, D]
        o = torch.empty_like(q)
        prefill_cudnn.attend_chunk(q, k, v, scale, o)
        return o.transpose(0, 1)[None]

    sides = {"kernel": kernel, "flash": flash,
             "cudnn": lambda: cudnn(q, rows_k, rows_v),
             "cudnn_expanded": lambda: cudnn(q, rows_ke, rows_ve)}
    ref = flash().float()
    good = {}
    for name, fn in sides.items():
        try:
            diff = (fn().float() - ref).abs().max().item()
            print(f"  {name}: max |diff| vs flash {diff:.3e}", flush=True)
            if diff < 5e-2:
                good[name] = [fn]
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure
            print(f"  {name}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            traceback.print_exc(limit=2)
    us = _common.time_sides(good, "eager", min_rounds=5, min_seconds=0.3)
    flops = 4.0 * HQ * D * (n * ctx + n * (n + 1) / 2)
    line = "  ".join(f"{k} {v:.0f} us ({flops / v / 1e6:.0f} TF)" for k, v in us.items())
    print(f"chunk {n} over {ctx}: {line}", flush=True)
    if "cudnn" in good:  # a plan is built per new shape: time first calls of unseen ones
        for extra in (1, 17, 100):  # the same keys: the prefix grows by ``extra``
            times = []
            for _ in range(2):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                cudnn(q[:n - extra], rows_k, rows_v)
                torch.cuda.synchronize()
                times.append(1e3 * (time.perf_counter() - t0))
            print(f"  new shape q {n - extra} over {ctx + extra}: first call {times[0]:.1f} "
                  f"ms, second {times[1]:.1f} ms", flush=True)


def exact(q, k, v, causal: bool, scale: float):
    """float64 attention with cuDNN's contract: ``q`` ``[n, Hq, D]`` over ``k``, ``v`` ``[L,
    Hkv, D]``, causal top-left -> output ``[1, Hq, n, D]`` and log-sum-exp ``[1, Hq, n, 1]``."""
    n, length = q.shape[0], k.shape[0]
    qh = q.double().reshape(n, HKV, HQ // HKV, D)
    s = torch.einsum("ihgd,lhd->hgil", qh, k.double()) * scale  # [Hkv, G, n, L]
    if causal:
        keys, rows = (torch.arange(x, device=q.device) for x in (length, n))
        seen = keys[None] <= rows[:, None]  # [n, L]
        s = s.masked_fill(~seen, float("-inf"))
    o = torch.einsum("hgil,lhd->hgid", torch.softmax(s, -1), v.double())
    return o.reshape(1, HQ, n, D), torch.logsumexp(s, -1).reshape(1, HQ, n, 1)


def check(n: int, ctx: int) -> None:
    """``prefill_cudnn``'s calls for a chunk of ``n`` rows over ``ctx``, against float64."""
    gen = torch.Generator(device="cuda").manual_seed(n * 7919 + ctx)
    rows_k, rows_v = (torch.randn(ctx + n, HKV, D, device="cuda", generator=gen,
                                  dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(n, HQ, D, device="cuda", generator=gen, dtype=torch.bfloat16)
    scale = D ** -0.5
    ref = F.scaled_dot_product_attention(
        q.double().transpose(0, 1), rows_k.double().repeat_interleave(HQ // HKV, 1).transpose(0, 1),
        rows_v.double().repeat_interleave(HQ // HKV, 1).transpose(0, 1), scale=scale,
        attn_mask=torch.ones(n, ctx + n, dtype=torch.bool, device="cuda").tril(ctx))
    merged = []
    for pad in (True, False):
        out = torch.empty_like(q)
        prefill_cudnn.attend_chunk(q, rows_k, rows_v, scale, out, pad_rows=pad)
        err = ((out.double().transpose(0, 1) - ref).norm() / ref.norm()).item()
        merged.append(f"{err:.1e}")
    parts = {"chunk causal": (rows_k[ctx:], rows_v[ctx:], True)}
    if ctx:
        parts["prefix"] = (rows_k[:ctx], rows_v[:ctx], False)
    line = []
    for name, (k, v, causal) in parts.items():
        try:
            out, lse = prefill_cudnn._attend(q, k, v, causal, scale)
            want, want_lse = exact(q, k, v, causal, scale)
            line.append(f"{name}: out {(out.double() - want).abs().max().item():.1e} "
                        f"lse {(lse.double() - want_lse).abs().max().item():.1e}")
        except Exception as exc:  # noqa: BLE001 - a probe reports every failure
            line.append(f"{name}: failed: {type(exc).__name__}: {str(exc)[:200]}")
    print(f"check {n:6d} over {ctx:6d}: merged rel {merged[0]} (unpadded {merged[1]})"
          "  |  unpadded calls: " + "  ".join(line), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="4096x0,8192x0,4096x32768,8192x8192,8192x32768,"
                                      "8192x122880")
    p.add_argument("--check", default="", help="NxCTX,...: correctness only (see above)")
    args = p.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, "
          f"{torch.cuda.get_device_name()}", flush=True)
    if args.check:
        for c in args.check.split(","):
            check(*(int(x) for x in c.split("x")))
        return 0
    for c in args.cases.split(","):
        n, ctx = (int(x) for x in c.split("x"))
        print(f"case {n}x{ctx}", flush=True)
        case(n, ctx)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
