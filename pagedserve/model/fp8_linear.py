"""Linear layers whose weights are stored in the FP8 block format (``quant/fp8.py``).

``Fp8Linear`` is a drop-in for a bias-free ``nn.Linear``: ``y = x @ W.T`` with ``W`` held as
``float8_e4m3fn`` ``[N, K]`` plus float32 block scales. ``forward`` runs ``ops.fp8_linear``:

- on CUDA, the Triton kernels, chosen by the number of rows (``kernels/fp8_matmul.py``):
  below ``W8A8_MIN_ROWS`` (decode) the decode kernel, which reads each weight byte once,
  weight-only (the activations in the model dtype) or, from ``W8A8_GEMV_MIN_ROWS`` rows
  on, with the rows rounded to e4m3 per 1x128 group in registers; from
  ``W8A8_MIN_ROWS`` on (prefill) the activations are quantized per 1x128 group by a
  launch of their own (the checkpoints' dynamic activation scheme) and an FP8
  tensor-core GEMM runs;
- elsewhere, the reference: the whole weight dequantized to the activation dtype and the
  float matmul (weight-only semantics at every row count).

``RowConcatLinear`` serves a fused projection whose parts are stored differently (the GDN
input projection of Qwen's FP8 checkpoints: ``in_proj_qkv`` and ``in_proj_z`` in FP8,
``in_proj_b`` and ``in_proj_a`` in bf16): each run of like parts is one child layer, and the
outputs are concatenated in row order. ``split_outputs`` gives a layer's output already
split, and skips the concatenation where the children end on the split's boundaries.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import torch
from torch import nn

from pagedserve.kernels import ops
from pagedserve.quant import fp8


class Fp8Linear(nn.Module):
    """Bias-free linear layer over an FP8 block weight.

    Attributes:
        weight: ``float8_e4m3fn`` ``[N, K]``; the rows of ``parts`` one after another.
        weight_scale_inv: float32 ``[sum(ceil(n / 128) for n in parts), ceil(K / 128)]``;
            each part's block rows one after another (the diagram in ``quant/fp8.py``).
        parts: row count of each fused part (one entry for an unfused weight).
        split_counters: int32 zeros (a buffer, not saved): the weight-only kernel's split-K
            counters, which its launches leave zero (``kernels/fp8_gemv.py``).
    """

    split_counters: torch.Tensor

    def __init__(self, in_features: int, parts: tuple[int, ...], device: torch.device) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = sum(parts)
        self.parts = parts
        num_scale_rows = sum(fp8.num_blocks(n) for n in parts)
        self.weight = nn.Parameter(
            torch.empty(self.out_features, in_features, dtype=fp8.FP8_DTYPE, device=device),
            requires_grad=False,
        )
        self.weight_scale_inv = nn.Parameter(
            torch.empty(num_scale_rows, fp8.num_blocks(in_features), dtype=torch.float32,
                        device=device),
            requires_grad=False,
        )
        self.register_buffer("split_counters", ops.fp8_counters(self.out_features, device),
                             persistent=False)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as ``[N, K]`` in ``dtype`` (computed on each call, never cached)."""
        return fp8.dequantize(self.weight, self.weight_scale_inv, self.parts, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, K]`` in the model dtype -> ``[T, N]`` in the same dtype."""
        return ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.parts,
                              counters=self.split_counters)

    def forward_silu_mul(self, gate_up: torch.Tensor,
                         silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``forward(silu_mul(gate_up))`` for ``gate_up`` ``[T, 2K]``. Where the rows take
        an FP8 GEMM (CUDA, prefill) the activations' quantization forms SwiGLU's product
        itself (``fp8_matmul.silu_mul_linear``) and it is never stored; elsewhere
        ``silu_mul`` runs first."""
        if gate_up.is_cuda:
            from pagedserve.kernels import fp8_matmul  # Triton: only where CUDA runs

            if fp8_matmul.method_for(gate_up.shape[0]) in fp8_matmul.GEMM_METHODS:
                return fp8_matmul.silu_mul_linear(gate_up, self.weight,
                                                  self.weight_scale_inv, self.parts)
        return self(silu_mul(gate_up))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, parts={self.parts}, fp8 block {fp8.BLOCK}"


class RowConcatLinear(nn.Module):
    """A fused projection built from child layers that each own a run of its output rows."""

    def __init__(self, children: list[nn.Module]) -> None:
        super().__init__()
        self.pieces = nn.ModuleList(children)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, K]`` -> ``[T, sum of the children's rows]``."""
        return torch.cat([piece(x) for piece in self.pieces], dim=-1)

    def split_forward(self, x: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        """``forward(x).split(sizes, dim=-1)``; each child's output is split on its own
        when every child ends on a boundary of ``sizes`` (no copy into one tensor)."""
        rows: tuple[int, ...] = tuple(piece.out_features for piece in self.pieces)  # type: ignore[misc]
        plan = _split_by_piece(rows, tuple(sizes))
        if plan is None:
            return self.forward(x).split(sizes, dim=-1)
        return tuple(part for piece, own in zip(self.pieces, plan)
                     for part in piece(x).split(own, dim=-1))


@functools.cache
def _split_by_piece(rows: tuple[int, ...],
                    sizes: tuple[int, ...]) -> tuple[tuple[int, ...], ...] | None:
    """Each child's run of ``sizes`` (children of ``rows`` output rows, in order), or
    ``None`` when a child does not end on a boundary of ``sizes``."""
    ends = list(itertools.accumulate(sizes))
    plan, first, end = [], 0, 0
    for n in rows:
        end += n
        if end not in ends:
            return None
        last = ends.index(end) + 1
        plan.append(sizes[first:last])
        first = last
    return tuple(plan)


def split_outputs(linear: nn.Module, x: torch.Tensor,
                  sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """``linear(x).split(sizes, dim=-1)``, without concatenating a ``RowConcatLinear``'s
    children where they end on the split's boundaries."""
    if isinstance(linear, RowConcatLinear):
        return linear.split_forward(x, sizes)
    return tuple(linear(x).split(sizes, dim=-1))


def silu_mul_linear(linear: nn.Module, gate_up: torch.Tensor,
                    silu_mul: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``linear(silu_mul(gate_up))``, SwiGLU's product fused into an ``Fp8Linear``'s
    activation quantization where it has one (``Fp8Linear.forward_silu_mul``)."""
    if isinstance(linear, Fp8Linear):
        return linear.forward_silu_mul(gate_up, silu_mul)
    return linear(silu_mul(gate_up))


def weight_nbytes(model: nn.Module) -> int:
    """Bytes of every parameter: FP8 data at 1 byte each, scales and float weights at theirs."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def describe_weights(model: nn.Module) -> str:
    """One line for the start-up log: total bytes, and the FP8 share with its scales."""
    total = weight_nbytes(model)
    fp8_layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    if not fp8_layers:
        return f"{total / 2**30:.3f} GiB, no FP8 layers"
    data = sum(m.weight.numel() for m in fp8_layers)
    scales = sum(m.weight_scale_inv.numel() * 4 for m in fp8_layers)
    return (f"{total / 2**30:.3f} GiB: {len(fp8_layers)} FP8 block-128 linear layers "
            f"{data / 2**30:.3f} GiB + scales {scales / 2**20:.2f} MiB, the rest "
            f"{(total - data - scales) / 2**30:.3f} GiB in the model dtype "
            "(FP8 Triton kernels on CUDA, dequantized float reference elsewhere)")
