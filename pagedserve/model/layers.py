"""Small building blocks of the Qwen3.5 decoder: RMSNorm, rotary embedding, SwiGLU MLP.

Modules hold parameters; their math is in ``elementwise`` (``self.ew``: eager, or the
compiled twins after ``Qwen3_5Model.use_compiled_elementwise``).

Tensors are token-major and unpadded: ``T`` new tokens of a step, sequences concatenated.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.model.elementwise import EAGER, ElementwiseOps
from pagedserve.model.fp8_linear import silu_mul_linear
from pagedserve.parallel.group import SINGLE, TensorParallel


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: ``norm(x) * (1 + w)``, computed in float32.

    The weight is stored as the offset from 1 (a fresh layer holds zeros), and the product
    is taken before rounding back to the input dtype.
    """

    ew: ElementwiseOps = EAGER

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[..., dim]`` in any float dtype; returns the same shape and dtype."""
        return self.ew.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``s = x + residual`` and ``norm(s)`` in one pass. Returns ``(s, norm(s))``."""
        return self.ew.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Partial RoPE over the first ``rotary_dim`` channels of each head (rotate-half form).

    Angles are computed per step from the positions, in float32, so no table bounded by a
    maximum length is kept and the op is capturable in a CUDA graph. Text positions are the
    same on Qwen3.5's three M-RoPE axes, so M-RoPE reduces to this plain RoPE.
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        # Built on the CPU exactly as transformers builds it, then moved with the model.
        steps = torch.arange(0, rotary_dim, 2, dtype=torch.float, device="cpu") / rotary_dim
        self.inv_freq: torch.Tensor  # [rotary_dim / 2] float32
        self.register_buffer("inv_freq", 1.0 / (theta**steps), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions``: int64 ``[T]``. Returns ``cos``, ``sin``: float32 ``[T, rotary_dim]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, rotary_dim]
        return emb.cos(), emb.sin()


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused into one GEMM.

    ``gate_up_proj.weight`` is ``[2 * I, H]``: the checkpoint's ``gate_proj`` rows, then
    ``up_proj`` rows (see ``PACKED``). Under tensor parallelism each rank holds ``I / N``
    rows of each and the matching columns of the row-parallel ``down_proj``.
    """

    PACKED = {"gate_up_proj.weight": ("gate_proj.weight", "up_proj.weight")}
    ew: ElementwiseOps = EAGER

    def __init__(self, hidden_size: int, intermediate_size: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        intermediate_size //= tp.size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[T, H]`` -> ``[T, H]``."""
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        return self.tp.all_reduce(silu_mul_linear(self.down_proj, gate_up, self.ew.silu_mul))
