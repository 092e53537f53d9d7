"""The FP8 linear layer's GPU entry point: argument checks and the one method rule.

Four methods; the number of rows ``M`` of ``x`` and the weight's shape choose:

- ``weight_only`` (``M < W8A8_GEMV_MIN_ROWS``, decode): ``fp8_gemv``, bandwidth-bound;
  the activations stay in their dtype.
- ``w8a8_gemv`` (``W8A8_GEMV_MIN_ROWS <= M < W8A8_MIN_ROWS``, decode): ``fp8_gemv``'s
  e4m3 form, bandwidth-bound: it rounds the rows to e4m3 per 1x128 group in registers
  (the w8a8 methods' rule) and runs the e4m3 tensor-core dot on the weight as stored.
- ``w8a8_scaled_mm`` (``M >= W8A8_MIN_ROWS``, prefill, where it applies):
  ``fp8_activations`` quantizes the rows per 1x128 group, then ``torch._scaled_mm`` runs
  cuBLAS's block-scaled e4m3 GEMM (1x128 activation groups against 128x128 weight
  blocks: the checkpoints' own format, so no scale is converted). It applies to 16-bit
  activations and weights whose rows are whole blocks with no fused part ending inside
  a block and whose columns are a multiple of ``SCALE_GROUPS_ALIGN`` blocks, on a torch
  and GPU whose ``_scaled_mm`` takes block scales (probed once per device:
  ``blockwise_scaled_mm_works``).
- ``w8a8`` (prefill elsewhere): the same activations through ``fp8_gemm``, the Triton
  e4m3 tensor-core GEMM, which takes any shape and fused layout.

``silu_mul_linear`` is the MLP's down projection on its ``gate | up`` input: the w8a8
GEMMs' quantization forms SwiGLU's product itself (``fp8_activations``), so the product
is never stored in the activation dtype.

The weight-only and the w8a8 methods differ in what they compute (the w8a8 activations are
rounded to e4m3); all write the activation dtype. Shapes alone decide every launch,
nothing waits on the device, and every buffer comes from torch's allocator or the
caller, so a call is capturable in a CUDA graph (the probe runs at a device's first
prefill-sized call, which the CUDA graphs' warm-up makes outside their capture).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from pagedserve.kernels import fp8_gemm, fp8_gemv
from pagedserve.kernels.decode_plan import device_num_sms
from pagedserve.kernels.fp8_activations import quantize_activations
from pagedserve.quant import fp8

log = logging.getLogger(__name__)

METHODS = ("weight_only", "w8a8_gemv", "w8a8", "w8a8_scaled_mm")
GEMM_METHODS = ("w8a8", "w8a8_scaled_mm")  # the activations quantized by a launch of their own
# From this many rows on, ``method=None`` quantizes the activations and runs an FP8
# tensor-core GEMM; below, the decode kernel (``fp8_gemv``). On the H100 the two cross
# between 32 and 64 rows for the MLP projections (docs/kernel-decisions.md, "FP8 linear
# layers").
W8A8_MIN_ROWS = 64
# From this many rows on (below ``W8A8_MIN_ROWS``), the decode kernel's e4m3 form. Equal
# to ``W8A8_MIN_ROWS`` (the form off) until the launch sweeps time it against the
# weight-only dot (``benchmarks/bench_fp8.py --decode-rows 2,4,8,16``).
W8A8_GEMV_MIN_ROWS = W8A8_MIN_ROWS
# cuBLAS reads a 128x128 scale grid with its K dimension padded to a multiple of 4 blocks
# (cuBLAS docs, "128x128 2D block scaling"): weights whose K / 128 is not one take the
# Triton GEMM rather than a padded copy of their scales. Every 27B projection qualifies.
SCALE_GROUPS_ALIGN = 4
# cuBLAS refuses (NOT_SUPPORTED) a row count whose column-major activation scales start
# off a 16-byte boundary, such as 777 rows; ``scaled_mm`` pads the rows to this.
ROW_ALIGN = 16
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def method_for(rows: int, weight: torch.Tensor | None = None,
               parts: tuple[int, ...] = (), dtype: torch.dtype | None = None) -> str:
    """The default method for ``rows`` rows of ``dtype`` activations against ``weight``
    (module doc); without a weight, the Triton choice."""
    if rows < W8A8_GEMV_MIN_ROWS:
        return "weight_only"
    if rows < W8A8_MIN_ROWS:
        return "w8a8_gemv"
    if weight is not None and scaled_mm_applies(weight, parts, dtype):
        return "w8a8_scaled_mm"
    return "w8a8"


def scaled_mm_applies(weight: torch.Tensor, parts: tuple[int, ...],
                      dtype: torch.dtype | None) -> bool:
    """Whether ``w8a8_scaled_mm`` takes this weight and activation dtype (module doc)."""
    n, k = weight.shape
    return (weight.is_cuda and dtype in (torch.float16, torch.bfloat16)
            and n % fp8.BLOCK == 0 and k % (fp8.BLOCK * SCALE_GROUPS_ALIGN) == 0
            and fp8.uniform_block_rows(parts) and blockwise_scaled_mm_works(weight.device))


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
              silu_mul: bool = False) -> torch.Tensor:
    """``x @ (W * scale_inv).T`` with ``x`` quantized per 1x128 group, through
    ``torch._scaled_mm`` with block scales.

    ``x`` 16-bit ``[M, K]``; ``weight`` e4m3 ``[N, K]`` with ``scale_inv``
    ``[N / 128, K / 128]``. cuBLAS takes B column-major (``weight.T`` is that view), both
    scale grids with their outer dimension contiguous (``scale_inv.T`` is already so; the
    activation scales are written so), and a row count whose scale column starts
    16-byte aligned: the quantized rows are padded to ``ROW_ALIGN`` and the padding rows'
    outputs dropped (each output row reads only its own row of ``x``). With ``silu_mul``,
    ``x`` is ``gate | up`` ``[M, 2K]`` and the product quantized is ``silu(gate) * up``.
    """
    m = x.shape[0]
    rows = -(-m // ROW_ALIGN) * ROW_ALIGN
    xq, xs = quantize_activations(x, rows, scales_row_contiguous=True, silu_mul=silu_mul)
    y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale_inv.t(), out_dtype=x.dtype)
    return y[:m]  # [M, N]


@functools.cache
def _probe(device: torch.device) -> bool:
    # Rows off the alignment (the padded path), and scales that differ by group and
    # block, so that a transposed or misread scale grid shows in the error.
    m, k, n = 120, fp8.BLOCK * SCALE_GROUPS_ALIGN * 2, 256
    gen = torch.Generator(device=device).manual_seed(0)
    col = torch.logspace(-1, 1, k // fp8.BLOCK, device=device).repeat_interleave(fp8.BLOCK)
    row = torch.logspace(-2, 0, n // fp8.BLOCK, device=device).repeat_interleave(fp8.BLOCK)
    x = (torch.randn(m, k, device=device, generator=gen) * col).bfloat16()
    weight, scale_inv = fp8.quantize(torch.randn(n, k, device=device, generator=gen)
                                     * row[:, None])
    try:
        out = scaled_mm(x, weight, scale_inv).float()
    except (RuntimeError, TypeError, ValueError) as exc:
        log.info("FP8 prefill uses the Triton GEMM: torch._scaled_mm takes no block "
                 "scales here (%s)", str(exc).splitlines()[0] if str(exc) else exc)
        return False
    xq, xs = quantize_activations(x)
    x_deq = (xq.float().view(m, k // fp8.BLOCK, fp8.BLOCK) * xs[:, :, None]).view(m, k)
    ref = F.linear(x_deq, fp8.dequantize(weight, scale_inv, (n,), torch.float32))
    err = float((out - ref).abs().max() / ref.abs().max())
    if err > 2e-2:  # a wrong scale layout moves outputs by far more than e4m3 rounding
        log.warning("FP8 prefill uses the Triton GEMM: torch._scaled_mm with block scales "
                    "is off by %.3g of the largest output here", err)
        return False
    return True


def blockwise_scaled_mm_works(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` computes 1x128-by-128x128 block-scaled GEMMs correctly
    on ``device``: one small GEMM against the dequantized float matmul, once per device.
    While a CUDA graph is being captured and the probe has not run, ``False``."""
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    device = torch.device("cuda", device.index if device.index is not None
                          else torch.cuda.current_device())
    if torch.cuda.is_current_stream_capturing() and _probe.cache_info().currsize == 0:
        return False
    return _probe(device)


def check_args(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               parts: tuple[int, ...]) -> None:
    """``ValueError`` naming the first argument that does not fit ``fp8_linear``."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"x dtype {x.dtype} is not one of {ACTIVATION_DTYPES}")
    if weight.dtype != fp8.FP8_DTYPE or weight.dim() != 2 or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous {fp8.FP8_DTYPE} [N, K], got {weight.dtype} "
                         f"{tuple(weight.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} columns, the weight {k}")
    if sum(parts) != n or min(parts, default=0) <= 0:
        raise ValueError(f"parts {parts} do not sum to the weight's {n} rows")
    want = (sum(fp8.num_blocks(p) for p in parts), fp8.num_blocks(k))
    if scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != want:
        raise ValueError(f"scale_inv must be float32 {want}, got {scale_inv.dtype} "
                         f"{tuple(scale_inv.shape)}")
    if scale_inv.stride(1) != 1:
        raise ValueError("scale_inv's last dim must be contiguous")
    devices = {t.device for t in (x, weight, scale_inv)}
    if len(devices) != 1:
        raise ValueError(f"x, weight and scale_inv are on different devices: {devices}")


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, parts: tuple[int, ...],
    counters: torch.Tensor | None = None, method: str | None = None,
    gemv_config: fp8_gemv.GemvConfig | None = None,
    gemm_config: fp8_gemm.GemmConfig | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for an FP8 block weight, Triton (see ``kernels.ops.fp8_linear``).

    ``gemv_config`` / ``gemm_config`` replace the launch rules (tests, benchmarks).
    """
    check_args(x, weight, scale_inv, parts)
    if method is not None and method not in METHODS:
        raise ValueError(f"method {method!r} is not one of {list(METHODS)} (or None)")
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = _rows(x, k)
    m = x2.shape[0]
    if m == 0:
        return x.new_empty(*lead, n)
    method = method or method_for(m, weight, parts, x.dtype)
    if method in GEMM_METHODS:
        y = _w8a8(x2, weight, scale_inv, parts, method, gemm_config)
    else:
        w8a8 = method == "w8a8_gemv"
        config = gemv_config or fp8_gemv.launch_config(m, n, k, device_num_sms(x.device),
                                                       w8a8)
        if (config.form == "e4m3") != w8a8:
            raise ValueError(f"method {method!r} does not run the gemv form {config.form!r} "
                             f"(the e4m3 form runs for 'w8a8_gemv' only)")
        scale_rows = _scale_rows(parts, x.device)
        if counters is None:
            counters = torch.zeros(-(-n // config.block_n), dtype=torch.int32, device=x.device)
        elif counters.dtype != torch.int32 or counters.device != x.device:
            raise ValueError(f"counters must be int32 on {x.device}, got {counters.dtype} "
                             f"on {counters.device}")
        y = fp8_gemv.gemv(x2, weight, scale_inv, scale_rows, counters, config)
    return y.reshape(*lead, n)


def silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
    parts: tuple[int, ...], method: str | None = None,
    gemm_config: fp8_gemm.GemmConfig | None = None,
) -> torch.Tensor:
    """``(silu(gate) * up) @ W.T`` for ``gate_up`` ``[..., 2K]`` (the gate's columns, then
    up's) by a w8a8 method, SwiGLU's product formed inside the activations' quantization.
    ``method`` ``None``: ``method_for``, which must be one of ``GEMM_METHODS`` (from
    ``W8A8_MIN_ROWS`` rows on): the decode kernel takes the product stored."""
    n, k = weight.shape
    if gate_up.shape[-1] != 2 * k:
        raise ValueError(f"gate_up has {gate_up.shape[-1]} columns; the weight's {k} "
                         f"take {2 * k}")
    check_args(gate_up[..., :k], weight, scale_inv, parts)
    lead = gate_up.shape[:-1]
    x2 = _rows(gate_up, 2 * k)
    m = x2.shape[0]
    if m == 0:
        return gate_up.new_empty(*lead, n)
    method = method or method_for(m, weight, parts, gate_up.dtype)
    if method not in GEMM_METHODS:
        raise ValueError(f"silu_mul_linear runs 'w8a8' or 'w8a8_scaled_mm', got {method!r} "
                         f"for {m} rows (the w8a8 GEMMs run from {W8A8_MIN_ROWS} rows on)")
    return _w8a8(x2, weight, scale_inv, parts, method, gemm_config,
                 silu_mul=True).reshape(*lead, n)


def _rows(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` ``[..., width]`` as ``[M, width]`` with a contiguous last dim (the kernels'
    row stride may be any)."""
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _w8a8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
          parts: tuple[int, ...], method: str, gemm_config: fp8_gemm.GemmConfig | None,
          silu_mul: bool = False) -> torch.Tensor:
    """``x`` ``[M, K]`` (``[M, 2K]`` with ``silu_mul``) quantized, then ``method``'s GEMM."""
    if method == "w8a8_scaled_mm":
        if not scaled_mm_applies(weight, parts, x.dtype):
            raise ValueError(f"method 'w8a8_scaled_mm' does not apply to a {tuple(weight.shape)} "
                             f"weight with parts {parts} and {x.dtype} activations here")
        return scaled_mm(x, weight, scale_inv, silu_mul)
    xq, xs = quantize_activations(x, silu_mul=silu_mul)
    return fp8_gemm.gemm(xq, xs, weight, scale_inv, _scale_rows(parts, x.device), x.dtype,
                         gemm_config or fp8_gemm.launch_config(x.shape[0]))


def _scale_rows(parts: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
    """A ragged fused weight's row -> scale row map (``None`` for uniform block rows):
    device ops only, no copy from the host."""
    if fp8.uniform_block_rows(parts):
        return None
    return fp8.scale_rows(parts, device).to(torch.int32)
