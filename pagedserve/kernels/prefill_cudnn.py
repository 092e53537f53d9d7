"""Prefill attention for long chunks through cuDNN's fused attention (torch's SDPA op).

Each prefill sequence's cached rows are first copied out of the pool, dequantized to the
model dtype and packed (``prefill_gather.gather_rows``); cuDNN then attends the chunk's
queries over them. cuDNN's causal mask is aligned top-left (query i sees keys 0 .. i),
while a chunk's query i sits at row ``ctx + i``, so a chunk over a cached prefix is two
calls whose log-sum-exps are merged::

    keys      [ 0 ............ ctx-1 ][ ctx ............ ctx+n-1 ]
    call 1      every key (no mask)      -
    call 2      -                        causal over the chunk's own rows (square)
    out       (o1 e^lse1 + o2 e^lse2) / (e^lse1 + e^lse2)

Queries, packed rows and outputs are BSHD views (``[1, H, rows, D]`` over ``[rows, H,
D]`` memory); GQA is cuDNN's own (K/V keep ``Hkv`` heads).

torch builds a cuDNN plan per exact shape. ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1`` makes
it round the lengths up to powers of two for calls like these (BSHD, no bias), so a few
plans serve every prompt; the engine sets it before its first cuDNN call
(``enable_bucketed_plans``), and the warm-up builds them. This path runs eagerly (its
sizes come from the host copies of the lengths), on CUDA only.
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F
import triton

from pagedserve.kernels.prefill_gather import gather_rows
from pagedserve.kv.formats import KVBlockStorage

log = logging.getLogger(__name__)

PLAN_ENV = "TORCH_CUDNN_SDPA_AVOID_RECOMPILE"


def enable_bucketed_plans() -> None:
    """Ask torch for cuDNN plans over power-of-two buckets of the lengths. torch reads the
    variable once, at its first cuDNN attention call in the process."""
    os.environ.setdefault(PLAN_ENV, "1")


def _powers_of_two(lo: int, hi: int) -> list[int]:
    """Every power of two from the one holding ``lo`` to the one holding ``hi``."""
    first, last = triton.next_power_of_2(lo), triton.next_power_of_2(hi)
    out = []
    while first <= last:
        out.append(first)
        first *= 2
    return out


def build_plans(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device, min_chunk: int, max_chunk: int, max_len: int) -> int:
    """One call at every plan bucket a prefill can reach: chunks of ``min_chunk ..
    max_chunk`` rows (causal over themselves) and over prefixes of ``1 .. max_len -
    min_chunk`` rows, on zero tensors. Returns the number of calls."""
    enable_bucketed_plans()
    calls = 0
    for sq in _powers_of_two(min_chunk, max(min_chunk, max_chunk)):
        q = torch.zeros(sq, num_heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(sq, num_kv_heads, head_dim, dtype=dtype, device=device)
        _attend(q, kv, kv, True, 1.0)
        calls += 1
        for skv in _powers_of_two(2, max(2, max_len - min_chunk)):
            kv = torch.zeros(skv, num_kv_heads, head_dim, dtype=dtype, device=device)
            _attend(q, kv, kv, False, 1.0)
            calls += 1
        del q, kv
    return calls


def available(q: torch.Tensor, num_kv_heads: int) -> bool:
    """Whether cuDNN's fused attention runs queries like ``q`` (``[*, Hq, D]``) over
    ``num_kv_heads`` K/V heads here: CUDA, 16-bit, an SM 9.0 GPU, and one small causal
    and one non-causal call that succeed (torch's own conditions, and the cuDNN build's,
    which may lack head_dim 256), tried once per device and shape."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if not torch.backends.cudnn.is_available() or q.shape[-1] % 8 or q.shape[-1] > 256:
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return _runs(q.device.index or 0, q.dtype, q.shape[-2], num_kv_heads, q.shape[-1])


@functools.cache
def _runs(device: int, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
          head_dim: int) -> bool:
    enable_bucketed_plans()
    q = torch.zeros(64, num_heads, head_dim, dtype=dtype, device=f"cuda:{device}")
    kv = torch.zeros(128, num_kv_heads, head_dim, dtype=dtype, device=q.device)
    try:
        _attend(q, kv[:64], kv[:64], True, 1.0)
        _attend(q, kv, kv, False, 1.0)
    except RuntimeError as exc:
        log.warning("cuDNN fused attention does not run %s x %d/%d heads x %d here (%s); "
                    "long prefill chunks take the Triton kernel", dtype, num_heads,
                    num_kv_heads, head_dim, str(exc).splitlines()[0][:200])
        return False
    return True


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[n, Hq, D]`` over ``k``, ``v`` ``[L, Hkv, D]`` -> output ``[1, Hq, n, D]``
    and its log-sum-exp (float32, ``[1, Hq, n, 1]``). One key (which torch does not send
    to cuDNN) has the closed form: the output is its value row, the log-sum-exp its
    score."""
    if k.shape[0] == 1:
        n, hq, d = q.shape
        group = hq // k.shape[1]
        k0 = k[0].repeat_interleave(group, dim=0).float()  # [Hq, D]
        lse = (q.float() * k0).sum(-1).T * scale  # [Hq, n]
        out = v[0].repeat_interleave(group, dim=0)[:, None].expand(hq, n, d)
        return out[None].to(q.dtype), lse[None, :, :, None]
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], None,
        True, 0.0, causal, False, scale=scale)
    return res[0], res[1].reshape(*res[0].shape[:-1], 1)


# The fewest query rows of a cuDNN call. In the bucketed mode cuDNN returns a wrong
# log-sum-exp for a call of one query row, while its output is right
# (``probe_cudnn_attention.py --check 1x17``); so a one-row chunk's prefix call gets a
# second, zero query row. (Its own row, a single key, has the closed form.)
MIN_QUERY_ROWS = 2


def attend_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 out: torch.Tensor, pad_rows: bool = True) -> None:
    """One sequence: ``q`` ``[n, Hq, D]`` (the chunk) over ``k``, ``v`` ``[ctx + n, Hkv,
    D]`` (prefix, then the chunk's own rows), causal; writes ``out`` ``[n, Hq, D]``.
    ``pad_rows=False`` leaves a call of fewer than ``MIN_QUERY_ROWS`` rows as it is (for
    ``probe_cudnn_attention.py --check``, which shows both)."""
    n = q.shape[0]
    ctx = k.shape[0] - n
    own, own_lse = _attend(q, k[ctx:], v[ctx:], True, scale)  # [1, Hq, n, D]
    if ctx == 0:
        out.copy_(own[0].transpose(0, 1))
        return
    pad = MIN_QUERY_ROWS - n if pad_rows else 0
    q_prefix = F.pad(q, (0, 0, 0, 0, 0, pad)) if pad > 0 else q  # zero rows appended
    prefix, prefix_lse = _attend(q_prefix, k[:ctx], v[:ctx], False, scale)
    prefix, prefix_lse = prefix[:, :, :n], prefix_lse[:, :, :n]  # without a padded row
    top = torch.maximum(own_lse, prefix_lse)
    w_own, w_prefix = torch.exp(own_lse - top), torch.exp(prefix_lse - top)  # [1, Hq, n, 1]
    total = w_own + w_prefix
    merged = own.float().mul_(w_own / total)  # [1, Hq, n, D]: the one float32 temporary
    merged.addcmul_(prefix, w_prefix / total)
    out.copy_(merged[0].transpose(0, 1))


def cudnn_prefill_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, out: torch.Tensor,
    seq_begin: int, query_start_loc_cpu: list[int], seq_lens_cpu: list[int],
) -> torch.Tensor:
    """The contract of ``paged_prefill.paged_prefill_attention`` (sequences ``seq_begin
    ..`` of the step), one sequence at a time; ``*_cpu`` are the host copies. Callers
    check ``available`` first (which also asks for bucketed plans)."""
    lens = seq_lens[seq_begin:]
    cum_k = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    cum_k[1:] = torch.cumsum(lens, 0, dtype=torch.int32)
    total = sum(seq_lens_cpu[seq_begin:])
    k_rows = gather_rows(cache_k, block_tables[seq_begin:], cum_k, total, q.dtype)
    v_rows = gather_rows(cache_v, block_tables[seq_begin:], cum_k, total, q.dtype)
    first = 0
    for b in range(seq_begin, len(seq_lens_cpu)):
        start, end = query_start_loc_cpu[b], query_start_loc_cpu[b + 1]
        rows = slice(first, first + seq_lens_cpu[b])
        if end > start:
            attend_chunk(q[start:end], k_rows[rows], v_rows[rows], scale, out[start:end])
        first += seq_lens_cpu[b]
    return out
