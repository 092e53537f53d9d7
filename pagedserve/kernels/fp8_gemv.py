"""Triton FP8 linear for a few rows (decode): ``y = x @ W.T`` at 1 byte a weight.

Decode steps are bound by reading the weights, so this kernel streams each e4m3 weight
byte once, forms one 128-column block's products, and applies that block's scales to the
float32 partial sums (``fp8_tiles``). Three forms (``FORMS``) form the products:

- ``dot`` and ``fma`` are weight-only (the activations stay in their dtype, as on the
  CPU): ``dot`` widens the tile in registers (exact: every e4m3 value is a bf16, f16 and
  float32 value) for the tensor-core dot in the activation dtype; ``fma``, for one row,
  forms the products in float32 on the CUDA cores, which the launch sweeps measured
  faster than the dot padded to 16 rows.
- ``e4m3`` is w8a8: each row's 128-column block is rounded to e4m3 in registers by the
  prefill quantization's rule (``fp8_activations.quantize_groups``, the same bits), and
  the e4m3 tensor-core dot takes the weight tile as loaded, with the weight as the MMA's
  wide side (``w [BLOCK_N, 128] @ x^T [128, BLOCK_M]``: a Hopper MMA tile is at least 64
  rows, a decode step a few), scaled by both block scales.

Grid and split-K (``launch_config``)::

    program (n tile, k split, m tile)     n tile: BLOCK_N weight rows
                                          k split: a run of 128-column blocks
    y[m, n] = sum over splits s of  partial_s[m, n]

One row tile covers all of a decode step's rows (``BLOCK_M`` up to 64), so the weights
are read once. A 27B-shape projection has too few row tiles to fill the GPU (hidden
5120 at 64 rows a tile is 80 programs on 132 SMs), so the K range is split until about
``PROGRAMS_PER_SM`` programs per SM run. Each split writes its float32 partial to a
workspace ``[splits, M, N]`` and counts itself on its n tile's counter; the last to
arrive sums the partials in split order (the result does not depend on who is last),
writes ``y`` and resets the counter to 0, so the counters stay zero between launches
and a CUDA graph replays them as captured. The workspace is a new tensor per call from
torch's allocator (a CUDA graph captures it in its private pool); nothing on the host
waits on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8_activations import quantize_groups
from pagedserve.kernels.fp8_tiles import dot_f32, load_weight_tile, scale_rows_of
from pagedserve.quant import fp8

# Launch rule constants, from the launch sweeps (benchmarks/bench_fp8.py --gemv-sweep,
# docs/kernel-decisions.md "FP8 linear layers"). One row launches the fma form with
# ONE_ROW_WARPS warps; several rows, the dot form.
BLOCK_N = 64  # weight rows per program
MAX_BLOCK_M = 64  # rows of x per program; more rows take more m tiles (and no split)
PROGRAMS_PER_SM = 4  # split-K target: resident programs that keep the loads in flight
MAX_SPLIT = 16
NUM_WARPS = 4
NUM_STAGES = 4
ONE_ROW_WARPS = 8
# The e4m3 form's launch: 256-row weight tiles over 8 warps (two Hopper MMA warpgroups),
# which quantize the rows once per 256 weight rows; its K split is the one of 64-row
# tiles. The fastest of 64/128/256-row tiles at 2-8 rows in the launch sweeps
# (docs/kernel-decisions.md, "FP8 linear layers").
E4M3_BLOCK_N = 256
E4M3_WARPS = 8
E4M3_STAGES = 3
# How a k block's products are formed (``GemvConfig.form``):
#   dot   x [BLOCK_M, 128] @ w [128, BLOCK_N] on the tensor cores
#   fma   one row of x: w [BLOCK_N, 128] * x [128] summed over k on the CUDA cores
#   e4m3  x rounded to e4m3 per 1x128 group, then w [BLOCK_N, 128] @ x^T [128, BLOCK_M]
#         on the e4m3 tensor cores: w8a8, the weight never widened
FORMS = {"dot": 0, "fma": 1, "e4m3": 2}


@dataclass(frozen=True)
class GemvConfig:
    """One launch: tile sizes and the K split (``splits`` 1: no split, no workspace)."""

    block_m: int
    block_n: int
    splits: int
    num_warps: int = NUM_WARPS
    num_stages: int = NUM_STAGES
    form: str = "dot"

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {v}")
        if not 1 <= self.splits <= MAX_SPLIT:
            raise ValueError(f"splits must be in 1..{MAX_SPLIT}, got {self.splits}")
        if self.form not in FORMS:
            raise ValueError(f"form {self.form!r} is not one of {list(FORMS)}")


def num_counters(n: int) -> int:
    """Split-K counters a weight of ``n`` rows needs: one per n tile of ``BLOCK_N`` (the
    narrowest tile of any form)."""
    return triton.cdiv(n, BLOCK_N)


def launch_config(m: int, n: int, k: int, num_sms: int, w8a8: bool = False) -> GemvConfig:
    """The launch for ``x [m, k] @ W.T [k, n]`` on ``num_sms`` SMs (module doc); with
    ``w8a8``, the e4m3 form's."""
    block_m = min(MAX_BLOCK_M, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, block_m)
    num_kb = fp8.num_blocks(k)
    target = PROGRAMS_PER_SM * num_sms
    splits = 1
    if m <= block_m and tiles < target and num_kb > 1:
        splits = min(MAX_SPLIT, num_kb, triton.cdiv(target, tiles))
        splits = triton.cdiv(num_kb, triton.cdiv(num_kb, splits))  # no empty split
    if w8a8:
        return GemvConfig(block_m, E4M3_BLOCK_N, splits, E4M3_WARPS, E4M3_STAGES, form="e4m3")
    if m == 1:
        return GemvConfig(block_m, BLOCK_N, splits, ONE_ROW_WARPS, form="fma")
    return GemvConfig(block_m, BLOCK_N, splits)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, srow_ptr, out_ptr, part_ptr, counter_ptr,
    M, N, K, stride_xm, stride_wn, stride_sr, stride_om, blocks_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK: tl.constexpr,
    SPLIT: tl.constexpr, ROW_MAP: tl.constexpr, NATIVE: tl.constexpr, IEEE: tl.constexpr,
    FORM: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    rows_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    m_ok = rows_m < M
    n_ok = rows_n < N
    srow = scale_rows_of(srow_ptr, rows_n, n_ok, ROW_MAP, BLOCK)  # [BLOCK_N]
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    kb_end = tl.minimum(pid_k * blocks_per_split + blocks_per_split, tl.cdiv(K, BLOCK))
    if FORM == 0:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for kb in range(pid_k * blocks_per_split, kb_end):
            k = kb * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = load_weight_tile(w_ptr, stride_wn, rows_n, n_ok, k, k_ok)  # [BLOCK, BLOCK_N]
            s = tl.load(s_ptr + srow * stride_sr + kb, mask=n_ok, other=0.0)  # [BLOCK_N]
            acc += dot_f32(x, w.to(x.dtype), NATIVE, IEEE) * s[None, :]
    elif FORM == 1:
        # One row (``gemv`` checks M == 1): rows_m is 0 for every lane, masked past row 0.
        w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        acc_n = tl.zeros((BLOCK_N,), tl.float32)
        for kb in range(pid_k * blocks_per_split, kb_end):
            k = kb * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)  # [BLOCK]
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK]
            s = tl.load(s_ptr + srow * stride_sr + kb, mask=n_ok, other=0.0)  # [BLOCK_N]
            acc_n += tl.sum(w.to(tl.float32) * x[None, :], axis=1) * s
        acc = tl.where(rows_m[:, None] == 0, acc_n[None, :], 0.0)  # [BLOCK_M, BLOCK_N]
    else:
        # x rounded to e4m3 per row and 128-column block (``fp8_activations``' rule), in
        # registers; the weight tile is the e4m3 MMA's wide side, x^T its narrow one.
        w_rows = w_ptr + rows_n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
        for kb in range(pid_k * blocks_per_split, kb_end):
            k = kb * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
            k_ok = k < K
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)  # [BLOCK_M, BLOCK]
            bits, xs = quantize_groups(x)  # [BLOCK_M, BLOCK], [BLOCK_M]
            xq = bits.to(tl.float8e4nv, bitcast=True)
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_N, BLOCK]
            s = tl.load(s_ptr + srow * stride_sr + kb, mask=n_ok, other=0.0)  # [BLOCK_N]
            acc_t += dot_f32(w, tl.trans(xq), NATIVE, False) * (s[:, None] * xs[None, :])
        acc = tl.trans(acc_t)  # [BLOCK_M, BLOCK_N]
    out_ptrs = out_ptr + rows_m.to(tl.int64)[:, None] * stride_om + rows_n[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT:
        # Partials [splits, M, N]; the last split of this n tile sums them in split order.
        part = part_ptr + rows_m.to(tl.int64)[:, None] * N + rows_n[None, :]
        tl.store(part + pid_k.to(tl.int64) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's stores before the (release) count
        done = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        splits = tl.num_programs(1)
        if done == splits - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for s_idx in range(0, splits):
                total += tl.load(part + s_idx * M * N, mask=mask, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(counter_ptr + pid_n, 0, sem="relaxed", scope="gpu")
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
    scale_rows: torch.Tensor | None, counters: torch.Tensor, config: GemvConfig,
) -> torch.Tensor:
    """``x @ W.T`` with ``W`` dequantized in registers (module doc). Arguments are checked
    by the caller (``kernels.fp8_linear``).

    Args:
        x: ``[M, K]`` float16/bfloat16/float32, last dim contiguous.
        weight: ``float8_e4m3fn`` ``[N, K]``, contiguous.
        scale_inv: float32 ``[R, ceil(K / 128)]``.
        scale_rows: int32 ``[N]`` scale row of each weight row, or ``None`` for ``n // 128``.
        counters: int32 ``[>= ceil(N / config.block_n)]``, zero (left zero).
        config: the launch (``launch_config``).

    Returns:
        ``[M, N]`` in ``x.dtype``.
    """
    m, k = x.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    num_kb = fp8.num_blocks(k)
    per_split = triton.cdiv(num_kb, config.splits)
    splits = triton.cdiv(num_kb, per_split)
    tiles_n = triton.cdiv(n, config.block_n)
    if splits > 1 and (m > config.block_m or counters.numel() < tiles_n):
        raise ValueError(f"a split launch needs one m tile and {tiles_n} counters; got "
                         f"{m} rows for block_m {config.block_m}, {counters.numel()} counters")
    if config.form == "fma" and m != 1:
        raise ValueError(f"form 'fma' takes one row of x, got {m}")
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    _gemv_kernel[(tiles_n, splits, triton.cdiv(m, config.block_m))](
        x, weight, scale_inv, weight if scale_rows is None else scale_rows, out, part,
        counters, m, n, k, x.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        per_split, BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK=fp8.BLOCK,
        SPLIT=splits > 1, ROW_MAP=scale_rows is not None, NATIVE=x.is_cuda,
        IEEE=x.dtype == torch.float32, FORM=FORMS[config.form], num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out
