"""Argument checks of the attention-side ops: cheap ones always, full ones on request.

The hot path checks only what the host already knows (shapes, dtypes, devices, strides):
no device sync, nothing a CUDA graph could not capture. The kernels themselves never read
or write out of bounds whatever the metadata says (lengths are clamped to the table's
capacity, invalid block ids and slots are masked). Validate mode (``validate=True`` or
``PAGEDSERVE_VALIDATE=1``) adds the full check of block ids, lengths and slots: one sync,
and a ``ValueError`` that names the bad entry before anything is launched.
"""

from __future__ import annotations

import os

import torch

from pagedserve.kv.formats import KVBlockStorage

SUPPORTED_HEAD_DIMS = (64, 128, 256)
VALIDATE_ENV = "PAGEDSERVE_VALIDATE"


def validate_requested(validate: bool | None) -> bool:
    """``validate`` if given, else whether ``PAGEDSERVE_VALIDATE=1``."""
    if validate is not None:
        return bool(validate)
    return os.environ.get(VALIDATE_ENV, "0") == "1"


# Every check below is written ``if not ok: raise ValueError(f"...")``, so that the
# message, with its shape tuples, is formatted only when a check fails: eager decode runs
# these per layer per step, and formatting every message cost more than the checks.


def check_storage(cache: KVBlockStorage, name: str) -> None:
    data, scales = cache.data, cache.scales
    if data.dim() != 4:
        raise ValueError(f"{name}.data must be [num_blocks, Hkv, block_size, W], "
                         f"got shape {tuple(data.shape)}")
    if data.stride(-1) != 1:
        raise ValueError(f"{name}.data must have a contiguous last dim")
    if scales is not None and (scales.shape[:3] != data.shape[:3] or scales.stride(-1) != 1):
        raise ValueError(f"{name}.scales {tuple(scales.shape)} must match data "
                         f"{tuple(data.shape[:3])} with a contiguous last dim")


def _row_strides(shape: torch.Size, interleave: int) -> tuple[int, ...]:
    """Strides of ``[num_blocks, Hkv, block_size, width]`` rows in the decode kernels'
    layout (``formats``' byte diagram): ``width`` elements a row, ``interleave *
    block_size`` rows per (block, head), nothing between."""
    _, hkv, bs, width = shape
    return (hkv * interleave * bs * width, interleave * bs * width, width, 1)


def check_row_layout(cache: KVBlockStorage, name: str) -> int:
    """The strides the decode kernels assume (after ``check_storage``): row ``(b, h,
    t)`` of ``data`` and of ``scales`` at row ``(b * Hkv + h) * (I * block_size) + t``
    from their own pointers, I = ``interleave``, 1 (own buffers) or 2
    (``allocate_pair``). Returns I."""
    interleave = cache.interleave
    for part, t in (("data", cache.data), ("scales", cache.scales)):
        if t is None:
            continue
        if interleave not in (1, 2) or t.stride() != _row_strides(t.shape, interleave):
            accepted = [_row_strides(t.shape, i) for i in (1, 2)]
            raise ValueError(
                f"{name}.{part} {tuple(t.shape)} has strides {t.stride()}; decode takes "
                f"strides {accepted[0]} (its own buffer) or {accepted[1]} (K and V side "
                f"by side, KVBlockStorage.allocate_pair), scales like data")
    return interleave


def check_decode_args(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor | None,
) -> None:
    """Host-known checks of ``paged_decode_attention``'s arguments (no sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    B, Hq, D = q.shape
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q dtype {q.dtype} not supported; accepted: float16, bfloat16, "
                         "float32")
    if q.stride(-1) != 1:
        raise ValueError("q must have a contiguous last dim")
    interleaves = []
    for name, c in (("cache_k", cache_k), ("cache_v", cache_v)):
        check_storage(c, name)
        interleaves.append(check_row_layout(c, name))
        if c.head_dim != D:
            raise ValueError(f"{name}.head_dim {c.head_dim} != q head_dim {D}")
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {D} not supported; accepted: {SUPPORTED_HEAD_DIMS}")
    k_shape, v_shape = cache_k.data.shape[:3], cache_v.data.shape[:3]
    if k_shape != v_shape:
        raise ValueError(f"K and V pools differ: [num_blocks, Hkv, block_size] "
                         f"{tuple(k_shape)} vs {tuple(v_shape)}")
    num_blocks, Hkv, block_size = k_shape
    if num_blocks < 1:
        raise ValueError("the K/V pool has no blocks")
    interleave, v_interleave = interleaves
    if interleave != v_interleave:
        raise ValueError(
            f"K and V must share their buffers alike: cache_k interleave {interleave}, "
            f"cache_v interleave {v_interleave} (allocate K and V with "
            "KVBlockStorage.allocate_pair, or each with allocate)")
    # The kernel addresses rows by one int32 index (``check_row_layout``), and points rows
    # outside a sequence at row 0 (so the pool must have one). K and V share the count.
    rows = num_blocks * Hkv * interleave * block_size
    if rows >= 2**31:
        raise ValueError(f"cache_k spans {rows} rows; decode addresses at most 2**31 - 1 "
                         "(cache_v, of the same shape, as many)")
    if Hq % Hkv != 0:
        raise ValueError(f"Hq ({Hq}) must be a multiple of Hkv ({Hkv})")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [B, max_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.shape[0] != B or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables has shape {tuple(block_tables.shape)}; need "
                         f"[{B}, >= 1]")
    if block_tables.stride(-1) != 1:
        raise ValueError("block_tables must have a contiguous last dim")
    if (seq_lens.dtype != torch.int32 or seq_lens.dim() != 1 or seq_lens.shape[0] != B
            or not seq_lens.is_contiguous()):
        raise ValueError(f"seq_lens must be contiguous int32 [{B}], got {seq_lens.dtype} "
                         f"{tuple(seq_lens.shape)}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype
                            or out.stride(-1) != 1):
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} with a contiguous last "
                         f"dim, got {out.dtype} {tuple(out.shape)}")
    device = q.device
    for t in (cache_k.data, cache_v.data, block_tables, seq_lens, out):
        if t is not None and t.device != device:
            raise ValueError(f"all tensors must be on {device}; found {t.device}")


def check_block_tables(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int, block_size: int,
) -> None:
    """Full check (syncs): lengths within the tables' capacity, live block ids in the pool.

    Entries past a sequence's last block are not read and may hold anything (-1 by
    convention).
    """
    B, cols = block_tables.shape
    capacity = cols * block_size
    lens = seq_lens.to(torch.int64)
    bad_len = (lens < 0) | (lens > capacity)
    if bool(bad_len.any()):
        b = int(bad_len.nonzero()[0, 0])
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])} is outside [0, {capacity}]: the table holds "
            f"{cols} blocks of {block_size} tokens"
        )
    needed = (lens + block_size - 1) // block_size  # [B]
    col = torch.arange(cols, device=block_tables.device)
    live = col[None, :] < needed[:, None]  # [B, cols]
    ids = block_tables.to(torch.int64)
    bad = live & ((ids < 0) | (ids >= num_blocks))
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(ids[b, j])} is outside the pool of {num_blocks} "
            f"blocks (sequence {b} has {int(lens[b])} tokens in {int(needed[b])} blocks)"
        )


def check_kv_write_args(
    cache: KVBlockStorage, rows: torch.Tensor, slot_mapping: torch.Tensor,
) -> None:
    """Host-known checks of ``kv_write``'s arguments (no sync)."""
    check_storage(cache, "cache")
    Hkv, D = cache.num_kv_heads, cache.head_dim
    if rows.dim() != 3 or rows.shape[1:] != (Hkv, D):
        raise ValueError(f"rows must be [T, {Hkv}, {D}], got shape {tuple(rows.shape)}")
    if rows.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"rows dtype {rows.dtype} not supported; accepted: float16, "
                         "bfloat16, float32")
    if rows.stride(-1) != 1:
        raise ValueError("rows must have a contiguous last dim")
    if (slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1
            or slot_mapping.shape[0] != rows.shape[0] or not slot_mapping.is_contiguous()):
        raise ValueError(f"slot_mapping must be contiguous int64 [{rows.shape[0]}], got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    device = cache.data.device
    for t in (rows, slot_mapping):
        if t.device != device:
            raise ValueError(f"all tensors must be on {device}; found {t.device}")


def check_slot_mapping(slot_mapping: torch.Tensor, num_slots: int) -> None:
    """Full check (syncs): every slot is -1 (skip) or inside the pool."""
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        t = int(bad.nonzero()[0, 0])
        raise ValueError(
            f"slot_mapping[{t}] = {int(slot_mapping[t])} is outside the pool's "
            f"{num_slots} slots (and is not -1, the skip marker)"
        )


def check_prefill_args(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    out: torch.Tensor, seq_begin: int,
) -> None:
    """Host-known checks of ``paged_prefill_attention``'s arguments (no sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be int32 [B], got shape {tuple(seq_lens.shape)}")
    B = seq_lens.shape[0]
    if q.shape[0] < B:
        raise ValueError(f"q has {q.shape[0]} rows for {B} sequences; every sequence of a "
                         "step has at least one new row")
    # The storage, head_dim and table checks are decode's, on one query row per sequence.
    check_decode_args(q[:B], cache_k, cache_v, block_tables, seq_lens, None)
    if (query_start_loc.dtype != torch.int32 or query_start_loc.dim() != 1
            or query_start_loc.shape[0] != B + 1 or not query_start_loc.is_contiguous()):
        raise ValueError(f"query_start_loc must be contiguous int32 [{B + 1}], got "
                         f"{query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if query_start_loc.device != q.device:
        raise ValueError(f"all tensors must be on {q.device}; found {query_start_loc.device}")
    if not 0 <= seq_begin <= B:
        raise ValueError(f"seq_begin {seq_begin} is outside [0, {B}]")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1 \
            or out.device != q.device:
        raise ValueError(f"out must be {q.dtype} {tuple(q.shape)} on {q.device} with a "
                         f"contiguous last dim, got {out.dtype} {tuple(out.shape)} on "
                         f"{out.device}")


def check_prefill_lengths(
    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, seq_begin: int,
) -> None:
    """Full check (syncs): query offsets ascend within the step's ``num_tokens`` rows, and
    every sequence from ``seq_begin`` on caches at least its new rows."""
    qsl = query_start_loc.to(torch.int64).cpu()
    lens = seq_lens.to(torch.int64).cpu()
    if int(qsl[0]) != 0 or int(qsl[-1]) != num_tokens:
        raise ValueError(f"query_start_loc must run from 0 to the step's {num_tokens} rows, "
                         f"got {int(qsl[0])} .. {int(qsl[-1])}")
    for b in range(seq_begin, lens.shape[0]):
        n = int(qsl[b + 1] - qsl[b])
        if n < 0 or n > int(lens[b]):
            raise ValueError(f"sequence {b} has {n} new rows but seq_lens[{b}] = "
                             f"{int(lens[b])}: it must cache at least its new rows")
