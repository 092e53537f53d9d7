"""Float64 oracle of decode attention and builders of test pools.

The oracle shares nothing with the code under test except ``formats.dequantize`` (itself
checked bit for bit against the ``gguf`` package in ``test_formats.py``): it walks each
block table position by position and does softmax attention in float64.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.kv import formats
from pagedserve.kv.formats import KVBlockStorage

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
# Triton kernels run on CUDA, or on CPU tensors under the interpreter.
needs_triton = pytest.mark.skipif(not (INTERPRET or HAS_CUDA),
                                  reason="needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
# Tensors of the Triton tests: CUDA when present, else CPU under the interpreter.
TRITON_DEVICE = "cuda" if HAS_CUDA and not INTERPRET else "cpu"

# Error bound per K/V storage type: max |out - oracle| / max |oracle|. The oracle reads the
# same stored (quantized) values, so only the kernels' arithmetic is measured: p rounded to
# the dot dtype (f16: 2^-11; bf16: 2^-8), f16 output rounding (2^-11), float32 sums.
# bf16's bound is 5 of its ulps: the largest of millions of outputs of the 27B-shape grid
# (thousands of keys, bf16 queries, probabilities and output) reached 1.2e-2.
# f32 storage (the CPU reference path only) is held to float32 arithmetic.
BOUNDS = {"f16": 2e-3, "q8_0": 2e-3, "q4_0": 2e-3, "bf16": 2e-2, "f32": 1e-5}


def bound(k_type: str, v_type: str) -> float:
    return max(BOUNDS[k_type], BOUNDS[v_type])


def q_dtype_for(k_type: str, v_type: str) -> torch.dtype:
    """bf16 storage is tested with bf16 queries (the model's dtype), f32 storage with
    float32 queries (a float32 model's), others with f16."""
    if "f32" in (k_type, v_type):
        return torch.float32
    return torch.bfloat16 if "bf16" in (k_type, v_type) else torch.float16


def rows64(cache: KVBlockStorage, table_row: list[int], length: int) -> torch.Tensor:
    """float64 ``[Hkv, length, D]``: the stored rows of one sequence, dequantized."""
    bs = cache.block_size
    pos = torch.arange(length)
    blocks = torch.tensor(table_row, dtype=torch.long)[pos // bs] if length else pos
    offs = pos % bs
    data = cache.data[blocks, :, offs]  # [L, Hkv, W]
    scales = cache.scales[blocks, :, offs] if cache.scales is not None else None
    vals = formats.dequantize(data.cpu(), None if scales is None else scales.cpu(),
                              cache.kv_type, torch.float64)
    return vals.transpose(0, 1)  # [Hkv, L, D]


def decode_oracle(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    tables: list[list[int]], lens: list[int], scale: float,
    live: list[list[bool]] | None = None,
) -> torch.Tensor:
    """float64 ``[B, Hq, D]`` on the CPU.

    Args:
        tables: per sequence, the block id of each block (only the first
            ``ceil(len / block_size)`` are read).
        live: per sequence and position, whether the row takes part (rows behind an
            invalid block id do not); default all.
    """
    B, Hq, D = q.shape
    Hkv = cache_k.num_kv_heads
    G = Hq // Hkv
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        n = lens[b]
        keep = torch.ones(n, dtype=torch.bool) if live is None else torch.tensor(live[b][:n])
        if n == 0 or not bool(keep.any()):
            continue
        k = rows64(cache_k, tables[b], n)[:, keep]  # [Hkv, L', D]
        v = rows64(cache_v, tables[b], n)[:, keep]
        qb = q[b].double().cpu().reshape(Hkv, G, D)
        s = torch.einsum("hgd,hld->hgl", qb, k) * scale
        p = torch.softmax(s, dim=-1)
        out[b] = torch.einsum("hgl,hld->hgd", p, v).reshape(Hq, D)
    return out


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return float((out.double().cpu() - ref).abs().max() / ref.abs().max().clamp_min(1e-6))


def build_pool(
    k_type: str, v_type: str, lens: list[int], *, num_kv_heads: int, head_dim: int,
    block_size: int = 16, extra_blocks: int = 3, seed: int = 0, device: str = "cpu",
    table_cols: int | None = None, paired: bool = True,
) -> tuple[KVBlockStorage, KVBlockStorage, torch.Tensor, list[list[int]]]:
    """K and V pools holding random rows for sequences of ``lens``, blocks shuffled.
    ``paired``: K and V from ``KVBlockStorage.allocate_pair`` (the library's layout: side
    by side when their types match), else each from ``allocate`` (own buffers).

    Returns:
        ``(cache_k, cache_v, block_tables int32 [B, cols], tables as lists)``; unused
        table entries are -1.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + extra_blocks
    cols = table_cols or max(1, max(need, default=1))
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, k = [], 0
    for n in need:
        tables.append(perm[k:k + n])
        k += n
    sizes = (num_blocks, block_size, num_kv_heads, head_dim)
    if paired:
        caches = KVBlockStorage.allocate_pair(k_type, v_type, *sizes, device=device)
    else:
        caches = [KVBlockStorage.allocate(t, *sizes, device=device) for t in (k_type, v_type)]
    for i, cache in enumerate(caches):
        kv_type = cache.kv_type
        # Rows with a spread of magnitudes per token, like real K/V.
        rows = torch.randn(num_blocks * block_size, num_kv_heads, head_dim, generator=gen)
        rows *= torch.exp(torch.randn(num_blocks * block_size, 1, 1, generator=gen) * 0.5)
        if i == 0:
            rows *= 1.5  # sharper softmax
        data, scales = formats.quantize(rows, kv_type)
        cache.data.copy_(data.reshape(num_blocks, block_size, num_kv_heads, -1).transpose(1, 2))
        if scales is not None:
            cache.scales.copy_(
                scales.reshape(num_blocks, block_size, num_kv_heads, -1).transpose(1, 2)
            )
    table = torch.full((len(lens), cols), -1, dtype=torch.int32)
    for b, ids in enumerate(tables):
        table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    return caches[0], caches[1], table.to(device), tables
