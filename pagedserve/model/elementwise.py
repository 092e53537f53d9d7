"""The decoder's elementwise tails, as plain torch functions with compiled twins.

Between its GEMMs and attention/GDN ops, a Qwen3.5 layer runs a dozen small elementwise
steps (norms in float32, RoPE, gates). Eagerly each is several kernels; at batch size 1 on
a GPU the launches, not the bytes, would cost milliseconds per token across 64 layers. The
compiled twins (``torch.compile``, one fused Triton kernel each on CUDA) remove that, and
they are capturable in the decode CUDA graphs once warmed up.

Every function computes exactly what transformers' ``modeling_qwen3_5`` computes, including
where it upcasts to float32 and rounds back. (Compiled kernels may skip an intermediate
16-bit rounding; in float32 both forms are the same.) The CPU path uses the eager forms.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from pagedserve.kernels.gdn_reference import gated_rms_norm

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm ``norm(x) * (1 + w)`` in float32, over the last dim.

    ``x``: ``[..., N]`` any float dtype; ``weight``: ``[N]`` (the offset from 1). Returns
    ``x``'s shape and dtype.
    """
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).type_as(x)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = x + residual`` (in ``x.dtype``), then ``rms_norm(s)``. Returns ``(s, norm)``."""
    s = x + residual
    return s, rms_norm(s, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first ``rotary_dim`` channels of ``x`` ``[T, H, D]``.

    ``cos``, ``sin``: ``[T, rotary_dim]`` in ``x.dtype``; the other channels pass through.
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    cos, sin = cos[:, None, :], sin[:, None, :]  # [T, 1, rot]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def qk_norm_rope(
    q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q ``[T, Hq, D]`` and k ``[T, Hkv, D]``, then partial RoPE."""
    q = rotate(rms_norm(q, q_weight, eps), cos, sin)
    k = rotate(rms_norm(k, k_weight, eps), cos, sin)
    return q, k


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Attention output gate: ``o * sigmoid(gate)``, both ``[T, Hq, D]``."""
    return o * torch.sigmoid(gate)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation: ``silu(gate) * up`` of ``gate_up`` ``[T, 2 * I]`` -> ``[T, I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN decay and write strength from ``a``, ``b`` ``[T, Hv]``.

    Returns ``g = -exp(A_log) * softplus(a + dt_bias)`` (float32; exp in float32 because a
    16-bit ``exp(A_log)`` can overflow) and ``beta = sigmoid(b)`` (``b.dtype``).
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, b.sigmoid()


@dataclass(frozen=True)
class ElementwiseOps:
    """One implementation of each elementwise step; modules call through this."""

    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    qk_norm_rope: Callable = qk_norm_rope
    sigmoid_gate: Callable = sigmoid_gate
    silu_mul: Callable = silu_mul
    gdn_gates: Callable = gdn_gates
    gated_rms_norm: Callable = gated_rms_norm


EAGER = ElementwiseOps()


# Each op recompiles once per dtype combination and per weight kind it meets (a weight
# passed as an ``nn.Parameter`` and one passed as a plain tensor are guarded apart). A
# process that builds several engines (tests, benchmarks with more than one model) meets
# more than dynamo's default of 8, and with ``fullgraph=True`` the ninth is a hard failure
# that leaves the CUDA graphs uncaptured; the raised limit keeps that from happening.
RECOMPILE_LIMIT = 64


def token_dynamic(fn: Callable, backend: str | Callable = "inductor") -> Callable:
    """``fn`` compiled with only the token count dynamic: every tensor argument of two or
    more dims leads with the token dim (weights are 1-D), and that dim alone is marked
    dynamic; the others stay constants of the kernel. With every dim dynamic, a kernel
    computes its indices with runtime divisors and cannot assume its rows aligned for
    wide loads (docs/kernel-decisions.md, "Compiled elementwise ops"). One kernel serves
    every token count of a feature shape (1 token gets its own: dynamo specializes sizes
    0 and 1)."""
    compiled = torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)

    @functools.wraps(fn)
    def run(*args: object) -> object:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() >= 2:
                torch._dynamo.maybe_mark_dynamic(a, 0)
        return compiled(*args)

    return run


@functools.cache
def compiled_ops() -> ElementwiseOps:
    """The compiled twins. Compilation itself happens lazily, at each one's first call."""
    dynamo = torch._dynamo.config
    dynamo.recompile_limit = max(dynamo.recompile_limit, RECOMPILE_LIMIT)
    return ElementwiseOps(**{
        f.name: token_dynamic(getattr(EAGER, f.name)) for f in fields(ElementwiseOps)
    })


def check_compiled(ops: ElementwiseOps, device: torch.device, dtype: torch.dtype) -> bool:
    """Compile and run every op once on small inputs; ``False`` (logged) if any fails."""
    t, h, d = 3, 64, 64
    x = torch.randn(t, h, device=device, dtype=dtype)
    # A parameter, as the model passes its weights: the variant compiled here is the one
    # the model runs.
    def weight(n: int) -> torch.nn.Parameter:
        return torch.nn.Parameter(torch.randn(n, device=device, dtype=dtype),
                                  requires_grad=False)

    w, wd, wg = weight(h), weight(d), weight(4)
    q = torch.randn(t, 2, d, device=device, dtype=dtype)
    cos = torch.randn(t, 16, device=device, dtype=dtype)
    g = torch.randn(t, 4, device=device, dtype=dtype)
    try:
        ops.rms_norm(x, w, 1e-6)
        ops.add_rms_norm(x, x, w, 1e-6)
        ops.qk_norm_rope(q, q, wd, wd, cos, cos, 1e-6)
        ops.sigmoid_gate(x, x)
        ops.silu_mul(x)
        ops.gdn_gates(g, g, wg, wg)
        ops.gated_rms_norm(q, q, wd, 1e-6)
    except Exception as exc:  # noqa: BLE001 - any failure means: use the eager forms
        log.warning("compiling the elementwise ops failed, running them eagerly: %s", exc)
        return False
    return True
