"""Float64 oracle of the FP8 linear layer, written from the block format's definition.

Shares nothing with the code under test: the weight's scale-row map is rebuilt here part by
part, the dequantization is float64 products, and the activation quantization follows the
format's rule (``s = amax / 448`` in float32, 1 for an all-zero group; ``q = e4m3(x / s)``
with IEEE float32 divisions) with torch's float32 -> float8_e4m3fn cast as the reference
for the rounding itself.
"""

from __future__ import annotations

import torch

BLOCK = 128
E4M3 = torch.float8_e4m3fn


def acc_tol(method: str, on_gpu: bool) -> float:
    """The accumulation's share of ``assert_close``'s bound, relative to the sum of the
    terms' magnitudes.

    - Under the interpreter every dot is an IEEE float32 dot of exact products: float32
      sums of a few hundred terms stay near 2^-16, so 2^-14.
    - On a GPU the weight-only kernel's bf16 tensor-core dots accumulate in float32: 2^-16
      holds at K = 17408 with a wide margin.
    - The w8a8 GEMMs' FP8 MMA (Triton's and cuBLAS's) on an H100/H200 accumulates with
      about 14 bits inside each 128-column dot before the kernel promotes it to float32
      (DeepSeek-V3 report, section 3.3.2): 2^-10.
    """
    if not on_gpu:
        return 2.0**-14
    return 2.0**-10 if method.startswith("w8a8") else 2.0**-16


def make_weight(parts: tuple[int, ...], k: int, seed: int, device: str = "cpu",
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused FP8 weight with random e4m3 values and random block scales between 2^-12 and
    2^-4 (weights of magnitude about 0.1, as in a checkpoint; a scale read from the wrong
    block changes that block's share of a sum several fold): ``(float8_e4m3fn [N, K],
    float32 [sum_p ceil(n_p / 128), ceil(K / 128)])``. Each part has its own block rows."""
    gen = torch.Generator().manual_seed(seed)
    n = sum(parts)
    data = (torch.randn(n, k, generator=gen) * 64).clamp(-448, 448).to(E4M3)
    shape = (sum(-(-p // BLOCK) for p in parts), -(-k // BLOCK))
    scale = torch.exp2(torch.randint(-12, -5, shape, generator=gen).float())
    scale = scale * (1 + torch.rand(shape, generator=gen))
    return data.to(device), scale.to(device)


def scale_row_map(parts: tuple[int, ...]) -> list[int]:
    """For each weight row, its scale row: each part's rows count blocks from its own start."""
    out: list[int] = []
    base = 0
    for rows in parts:
        out += [base + r // BLOCK for r in range(rows)]
        base += -(-rows // BLOCK)
    return out


def dequantize64(data: torch.Tensor, scale: torch.Tensor, parts: tuple[int, ...]) -> torch.Tensor:
    """float64 ``[N, K]``: ``data[n, k] * scale[row_map[n], k // 128]``, on data's device."""
    k = data.shape[1]
    rows = torch.tensor(scale_row_map(parts), device=data.device)
    cols = torch.arange(k, device=data.device) // BLOCK
    return data.double() * scale.double()[rows][:, cols]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 ``[M, ceil(K / 128)]``), one
    scale per row and 128-column group (the last group has only the columns that exist)."""
    m, k = x.shape
    xf = x.float()
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(m, -(-k // BLOCK), dtype=torch.float32, device=x.device)
    for g in range(s.shape[1]):
        cols = slice(g * BLOCK, min(k, (g + 1) * BLOCK))
        amax = xf[:, cols].abs().amax(dim=1)  # [M], float32
        sg = torch.where(amax > 0, _div32(amax, torch.full_like(amax, 448.0)),
                         torch.ones_like(amax))
        s[:, g] = sg
        q[:, cols] = _div32(xf[:, cols], sg[:, None]).clamp(-448.0, 448.0).to(E4M3)
    return q, s


def _div32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The IEEE float32 quotient of float32 ``a / b``: the float64 quotient rounded once to
    float32, which is exact rounding for a division. torch's own ``/`` on CUDA multiplies
    by the reciprocal when the divisor is a scalar, which is off by an ulp at times."""
    return (a.double() / b.double()).float()


def weight_only(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                parts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``(x @ W.T, |x| @ |W|.T)`` with the activations as given: the product and
    the sum of its terms' magnitudes (what accumulation errors scale with)."""
    w64 = dequantize64(data, scale, parts)
    x64 = x.double()
    return x64 @ w64.T, x64.abs() @ w64.abs().T


def w8a8(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
         parts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``weight_only``, with the activations quantized per 1x128 group first."""
    return w8a8_quantized(*quantize_activations(x), data, scale, parts)


def w8a8_quantized(q: torch.Tensor, s: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                   parts: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """As ``w8a8``, from activations quantized already (``q`` e4m3, ``s`` their scales)."""
    cols = torch.arange(q.shape[1], device=q.device) // BLOCK
    x64 = q.double() * s.double()[:, cols]
    w64 = dequantize64(data, scale, parts)
    return x64 @ w64.T, x64.abs() @ w64.abs().T


def assert_close(out: torch.Tensor, ref: torch.Tensor, absref: torch.Tensor,
                 out_tol: float, acc_tol: float) -> float:
    """Every element within ``out_tol * |ref| + acc_tol * absref``: one rounding to the
    output dtype plus the accumulation's error, which scales with the sum of the terms'
    magnitudes (``absref``). Returns the largest ratio of error to bound (<= 1)."""
    assert torch.isfinite(out).all(), "non-finite output"
    err = (out.double() - ref).abs()
    bound = out_tol * ref.abs() + acc_tol * absref
    ratio = float((err / bound.clamp_min(1e-300)).max())
    assert ratio <= 1.0, f"error {ratio:.3g} x its bound (out_tol {out_tol}, acc_tol {acc_tol})"
    return ratio


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's product of ``gate_up`` ``[M, 2K]`` (the gate's columns, then up's) in
    float64, rounded once to ``gate_up``'s dtype."""
    g, u = gate_up.double().chunk(2, dim=-1)
    return (g * torch.sigmoid(g) * u).to(gate_up.dtype)


def assert_silu_mul_quantized(q: torch.Tensor, s: torch.Tensor, gate_up: torch.Tensor,
                              act_tol: float) -> None:
    """``(q, s)`` quantize SwiGLU's product of ``gate_up`` per 1x128 group: each scale
    within ``act_tol`` (the product's rounding to its dtype, which moves a group's
    maximum) of the oracle's, and each dequantized element within e4m3's half step
    (2^-4 of it, or 2^-10 of the scale below the normal range) plus ``act_tol`` of the
    float64 product."""
    g, u = gate_up.double().chunk(2, dim=-1)
    act = g * torch.sigmoid(g) * u  # [M, K] float64
    _, s_ref = quantize_activations(silu_mul(gate_up))
    s64 = s.double()
    assert torch.all((s64 - s_ref.double()).abs() <= act_tol * s_ref.double()), "scales"
    cols = torch.arange(act.shape[1], device=act.device) // BLOCK
    scale = s64[:, cols]
    deq = q.double() * scale
    bound = (2.0**-4 + act_tol) * act.abs() + 2.0**-10 * scale
    err = (deq - act).abs()
    assert torch.all(err <= bound), f"{int((err > bound).sum())} of {act.numel()} elements"
