"""FP8 linear kernels on a GPU at the Qwen3.5-27B projection shapes, and under CUDA graphs.

Same float64 oracle as ``test_fp8_linear.py`` (``fp8_oracle``; on the GPU, in float64 on
the device) and the same element bound ``out_tol * |ref| + acc_tol * |x| @ |W|.T``:

- ``out_tol``: bf16 rounds to nearest on a GPU: 2^-8.
- ``acc_tol`` (``fp8_oracle.acc_tol``): weight-only 2^-16 (bf16 tensor-core dots
  accumulate in float32); w8a8 2^-10 (the FP8 MMA keeps about 14 bits inside each
  128-column dot). A scale read from another block, a dropped block or a misplaced row
  (the oracle's block scales differ up to 2^7-fold) moves an output by far more.

What each test asserts is in its docstring. Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from fp8_oracle import (
    acc_tol,
    assert_close,
    assert_silu_mul_quantized,
    make_weight,
    quantize_activations,
    silu_mul,
    w8a8,
    w8a8_quantized,
    weight_only,
)
from kernel_oracle import needs_cuda

from pagedserve.kernels import fp8_matmul, ops
from pagedserve.kernels.fp8_activations import quantize_activations as triton_quantize
from pagedserve.model.fp8_linear import Fp8Linear, RowConcatLinear

pytestmark = [pytest.mark.gpu, needs_cuda]

OUT_TOL = 2.0**-8
# The 27B shape's FP8 projections: fused parts and K (hidden 5120, intermediate 17408,
# attention 24 x 256 query heads with their gate and 4 x 256 K/V heads, GDN 16 x 128 key
# and 48 x 128 value heads).
SHAPES = {
    "qkv_proj": ((12288, 1024, 1024), 5120),
    "o_proj": ((5120,), 6144),
    "gate_up_proj": ((17408, 17408), 5120),
    "down_proj": ((5120,), 17408),
    "gdn_in_proj_qkvz": ((10240, 6144), 5120),
    "gdn_out_proj": ((5120,), 6144),
}
DECODE_ROWS = [1, 2, 4, 16, 63]
PREFILL_ROWS = [64, 777, 4096]


def weight(name: str, seed: int = 0):
    parts, k = SHAPES[name]
    data, scale = make_weight(parts, k, seed, device="cuda")
    return data, scale, parts, k


def activations(m: int, k: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    scale = torch.logspace(-1, 1, m, device="cuda")[:, None]
    return (torch.randn(m, k, device="cuda", generator=gen) * scale).bfloat16()


def check(method: str, x, data, scale, parts, out) -> float:
    oracle = weight_only if method == "weight_only" else w8a8
    ref, absref = oracle(x, data, scale, parts)
    try:
        return assert_close(out, ref, absref, OUT_TOL, acc_tol(method, on_gpu=True))
    except AssertionError as exc:
        if not method.startswith("w8a8"):
            raise
        # Which half is off: the quantizer (an error that vanishes against the kernel's
        # own quantized activations) or the GEMM (one that stays).
        ref, absref = w8a8_quantized(*triton_quantize(x), data, scale, parts)
        err = (out.double() - ref).abs() / absref.clamp_min(1e-300)
        raise AssertionError(f"{exc}; against the kernel's own quantized activations the "
                             f"error is at most {float(err.max()):.3g} x sum |terms|") from None


@pytest.mark.parametrize("method", ["weight_only", "w8a8_gemv"])
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", DECODE_ROWS)
def test_decode_kernel_at_27b_shapes(name, m, method):
    """The decode kernel by either method (weight-only: the dot form, or the fma form at
    one row; w8a8_gemv: the e4m3 form, rows rounded in registers), with its split-K
    launch where the rule splits, matches its oracle on every element, leaves its
    counters zero, and repeats its bits on a second call."""
    data, scale, parts, k = weight(name)
    x = activations(m, k)
    counters = ops.fp8_counters(data.shape[0], "cuda")
    out = ops.fp8_linear(x, data, scale, parts, counters=counters, method=method)
    again = ops.fp8_linear(x, data, scale, parts, counters=counters, method=method)
    torch.cuda.synchronize()
    check(method, x, data, scale, parts, out)
    assert not counters.any()
    assert torch.equal(out, again)


@pytest.mark.parametrize("method", ["w8a8", "w8a8_scaled_mm"])
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", PREFILL_ROWS)
def test_w8a8_at_27b_shapes(name, m, method):
    """The prefill paths (activations quantized per 1x128 group, then the Triton or the
    cuBLAS FP8 GEMM) match the oracle, which quantizes the activations itself."""
    data, scale, parts, k = weight(name)
    x = activations(m, k)
    out = ops.fp8_linear(x, data, scale, parts, method=method)
    check(method, x, data, scale, parts, out)


@pytest.mark.parametrize("method", ["w8a8", "w8a8_scaled_mm"])
@pytest.mark.parametrize("m", PREFILL_ROWS)
def test_silu_mul_linear_at_the_27b_down_proj(m, method):
    """The MLP's down projection on its ``gate | up`` input, SwiGLU's product formed in
    the quantization: the quantized rows against the float64 product, and the output
    against the oracle's w8a8 product of it (bf16 rounding of the product may move a
    rare element to the other e4m3 neighbour: far inside the 2^-10 bound at K = 17408)."""
    data, scale, parts, k = weight("down_proj")
    gate_up = activations(m, 2 * k, seed=4)
    q, s = triton_quantize(gate_up, silu_mul=True)
    assert_silu_mul_quantized(q, s, gate_up, 2.0**-7)  # one bf16 step: at most 2^-7
    out = fp8_matmul.silu_mul_linear(gate_up, data, scale, parts, method=method)
    check(method, silu_mul(gate_up), data, scale, parts, out)


def test_hopper_prefill_runs_cublas_block_scaled_gemm():
    """On an H100/H200 with this torch, ``_scaled_mm`` takes the checkpoints' block scales
    (the probe passes) and the default prefill method of every 27B projection is it."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the rule is measured on Hopper")
    assert fp8_matmul.blockwise_scaled_mm_works(torch.device("cuda"))
    for name in SHAPES:
        data, _, parts, _ = weight(name)
        assert fp8_matmul.method_for(512, data, parts, torch.bfloat16) == "w8a8_scaled_mm"


def test_activation_quantization_bits_at_27b_shape():
    """The GPU quantizer's e4m3 bits and scales equal the oracle's (torch's cast of the
    float32 quotient) for 4096 rows of the down projection's input."""
    x = activations(4096, 17408)
    q, s = triton_quantize(x)
    q_ref, s_ref = quantize_activations(x)
    assert torch.equal(s, s_ref), f"{int((s != s_ref).sum())} of {s.numel()} scales differ"
    differ = q.view(torch.uint8) != q_ref.view(torch.uint8)
    assert not differ.any(), f"{int(differ.sum())} of {q.numel()} e4m3 codes differ"


@pytest.mark.parametrize("name,m", [("down_proj", 1), ("o_proj", 16), ("gate_up_proj", 1),
                                    ("gdn_in_proj_qkvz", 8),
                                    ("qkv_proj", 512), ("down_proj", 512)])
def test_cuda_graph_capture_and_replay(name, m):
    """A captured call replayed on new inputs gives the bits of an eager call on them (and
    so the oracle's result); the split-K counters are zero after every replay."""
    data, scale, parts, k = weight(name)
    counters = ops.fp8_counters(data.shape[0], "cuda")
    static_x = activations(m, k, seed=1)
    call = lambda: ops.fp8_linear(static_x, data, scale, parts, counters=counters)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm up (compiles) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    for seed in (2, 3):
        x = activations(m, k, seed=seed)
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert not counters.any()
        eager = ops.fp8_linear(x, data, scale, parts, counters=counters)
        assert torch.equal(static_out, eager)
        check(fp8_matmul.method_for(m), x, data, scale, parts, static_out)


def test_module_dispatches_to_the_kernels():
    """``Fp8Linear`` on CUDA runs the Triton path (its bits, not the reference's), and a
    fused projection of FP8 and bf16 runs (``RowConcatLinear``) stays in row order."""
    data, scale, parts, k = weight("gdn_in_proj_qkvz")
    layer = Fp8Linear(k, parts, torch.device("cuda"))
    layer.weight.copy_(data)
    layer.weight_scale_inv.copy_(scale)
    dense = torch.nn.Linear(k, 96, bias=False, device="cuda", dtype=torch.bfloat16)
    fused = RowConcatLinear([layer, dense])
    for m in (1, 300):
        x = activations(m, k)
        triton = ops.fp8_linear(x, data, scale, parts, backend="triton")
        reference = ops.fp8_linear(x, data, scale, parts, backend="reference")
        out = layer(x)
        assert torch.equal(out, triton) and not torch.equal(out, reference)
        both = fused(x)
        assert torch.equal(both[:, :16384], triton) and torch.equal(both[:, 16384:], dense(x))
