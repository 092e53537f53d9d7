"""Op dispatch: the Triton kernels on CUDA tensors, the torch reference elsewhere.

``backend`` overrides the choice: ``"triton"`` runs the Triton kernels on CPU tensors too,
which works under ``TRITON_INTERPRET=1`` (the kernel tests use it); ``"reference"`` runs
the torch reference on any device. Both backends share the argument checks and the
validate mode (``guards``), so a bad block id fails the same way on every path.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from pagedserve.kernels import guards, reference
from pagedserve.kernels.decode_plan import DecodeConfig, DecodeWorkspace, default_occupancy
from pagedserve.kernels.gdn_rollback import RollbackLayers, roll_back, rollback_layers
from pagedserve.kv import formats
from pagedserve.kv.formats import KVBlockStorage
from pagedserve.quant import fp8

# The public op API: the engine and the model import kernels only through this module.
__all__ = [
    "BACKENDS", "DecodeConfig", "DecodeWorkspace", "RollbackLayers", "default_occupancy",
    "fp8_counters", "fp8_linear", "gdn_roll_back", "kv_write", "paged_decode_attention",
    "build_long_chunk_plans", "paged_prefill_attention", "prefill_method",
    "rollback_layers",
]

BACKENDS = ("triton", "reference")


def _pick(backend: str | None, device: torch.device) -> str:
    if backend is None:
        return "triton" if device.type == "cuda" else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {list(BACKENDS)} (or None)")
    if backend == "triton" and device.type != "cuda":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(
                f"backend 'triton' on {device} tensors needs TRITON_INTERPRET=1 (the Triton "
                "interpreter); use CUDA tensors or the 'reference' backend"
            )
    return backend


def _check_triton_types(*caches: KVBlockStorage) -> None:
    for cache in caches:
        formats.check_gpu_type(cache.kv_type, "the Triton kernels")


def kv_write(
    cache: KVBlockStorage, rows: torch.Tensor, slot_mapping: torch.Tensor, *,
    backend: str | None = None, validate: bool | None = None,
) -> None:
    """Quantize ``rows`` ``[T, Hkv, D]`` and scatter them to ``slot_mapping`` int64 ``[T]``
    (-1 skips a row). See ``kernels.kv_write.kv_write``."""
    if _pick(backend, rows.device) == "triton":
        from pagedserve.kernels import kv_write as triton_kv_write

        _check_triton_types(cache)
        triton_kv_write.kv_write(cache, rows, slot_mapping, validate=validate)
        return
    guards.check_kv_write_args(cache, rows, slot_mapping)
    if guards.validate_requested(validate):
        guards.check_slot_mapping(slot_mapping, cache.num_blocks * cache.block_size)
    reference.kv_write(cache, rows, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, *,
    workspace: DecodeWorkspace | None = None, out: torch.Tensor | None = None,
    config: DecodeConfig | None = None, backend: str | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """One query token per sequence against its paged K/V.

    Args:
        q: ``[B, Hq, D]``.
        cache_k, cache_v: ``KVBlockStorage`` of one layer (types independent).
        block_tables: int32 ``[B, max_blocks]``; one column = contiguous layout.
        seq_lens: int32 ``[B]``.
        scale: softmax scale.
        workspace, config: Triton only (see ``kernels.paged_decode``); ignored by the
            reference.
        out: optional ``[B, Hq, D]`` output buffer in ``q.dtype``.

    Returns:
        ``[B, Hq, D]`` in ``q.dtype``.
    """
    if _pick(backend, q.device) == "triton":
        from pagedserve.kernels import paged_decode

        _check_triton_types(cache_k, cache_v)
        return paged_decode.paged_decode_attention(
            q, cache_k, cache_v, block_tables, seq_lens, scale, workspace=workspace,
            out=out, config=config, validate=validate,
        )
    guards.check_decode_args(q, cache_k, cache_v, block_tables, seq_lens, out)
    if guards.validate_requested(validate):
        guards.check_block_tables(block_tables, seq_lens, cache_k.num_blocks,
                                  cache_k.block_size)
    result = reference.paged_decode_attention(q, cache_k, cache_v, block_tables, seq_lens, scale)
    if out is None:
        return result
    out.copy_(result)
    return out


# Prefill methods on CUDA: the paged Triton kernel on the pool in place, the same kernel
# over a scratch copy of the rows dequantized once (``prefill_gather``), or cuDNN's fused
# attention over that copy packed (``prefill_cudnn``).
PREFILL_METHODS = ("kernel", "dequantized", "cudnn")
# A launch with a chunk of this many new rows in one sequence is a long-chunk launch: for
# it ``method=None`` copies the rows out of the pool first, where the kernel would
# dequantize each K/V tile once per query tile (docs/kernel-decisions.md).
LONG_CHUNK_MIN_ROWS = 1024


# The method of launches with a long chunk (from ``LONG_CHUNK_MIN_ROWS`` rows in one
# sequence): ``"cudnn"`` where cuDNN's fused attention is available, which attends at
# about 1.7x the paged kernel's TFLOP/s (docs/kernel-decisions.md, "cuDNN fused attention
# for long chunks"); without it, or with ``"dequantized"``, long chunks over quantized K/V
# dequantize first.
LONG_CHUNK_METHOD = "cudnn"


def prefill_method(q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
                   query_lens_cpu: list[int] | None) -> str:
    """The default method of a launch: for a long chunk in a 16-bit model, cuDNN's fused
    attention where ``LONG_CHUNK_METHOD`` names it, it is available and every chunk of the
    launch is long (the warm-up builds cuDNN's plans for long chunks only, and a short
    chunk would build one mid-request), else the kernel over a dequantized copy for
    quantized K/V; the kernel in place otherwise."""
    if not query_lens_cpu or max(query_lens_cpu) < LONG_CHUNK_MIN_ROWS:
        return "kernel"
    if q.dtype not in (torch.float16, torch.bfloat16) or q.shape[-1] > 256:
        return "kernel"
    if LONG_CHUNK_METHOD == "cudnn" and min(query_lens_cpu) >= LONG_CHUNK_MIN_ROWS:
        from pagedserve.kernels import prefill_cudnn

        if prefill_cudnn.available(q, cache_k.num_kv_heads):
            return "cudnn"
    quantized = formats.spec(cache_k.kv_type).quantized or formats.spec(cache_v.kv_type).quantized
    return "dequantized" if quantized else "kernel"


def build_long_chunk_plans(num_heads: int, num_kv_heads: int, head_dim: int,
                           dtype: torch.dtype, device: torch.device, max_chunk: int,
                           max_len: int) -> int:
    """Build, before the first request, every cuDNN plan that long chunks of up to
    ``max_chunk`` rows over up to ``max_len`` cached rows can reach, where they take
    cuDNN (``prefill_method``); returns the calls made (0 where they do not)."""
    if (LONG_CHUNK_METHOD != "cudnn" or max_chunk < LONG_CHUNK_MIN_ROWS
            or dtype not in (torch.float16, torch.bfloat16)):
        return 0
    from pagedserve.kernels import prefill_cudnn

    q = torch.empty(0, num_heads, head_dim, dtype=dtype, device=device)
    if not prefill_cudnn.available(q, num_kv_heads):
        return 0
    return prefill_cudnn.build_plans(num_heads, num_kv_heads, head_dim, dtype, device,
                                     LONG_CHUNK_MIN_ROWS, max_chunk, max_len)


def paged_prefill_attention(
    q: torch.Tensor, cache_k: KVBlockStorage, cache_v: KVBlockStorage,
    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
    scale: float, *, out: torch.Tensor | None = None, seq_begin: int = 0,
    query_start_loc_cpu: list[int] | None = None, seq_lens_cpu: list[int] | None = None,
    method: str | None = None, num_splits: int | None = None, backend: str | None = None,
    validate: bool | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new rows over its cached prefix and themselves.

    Args:
        q: ``[T, Hq, D]``, the step's query rows, sequences concatenated.
        cache_k, cache_v: ``KVBlockStorage`` of one layer (types independent), already
            holding the new rows.
        block_tables: int32 ``[B, max_blocks]``; one column = contiguous layout.
        query_start_loc: int32 ``[B + 1]`` cu_seqlens of the new rows.
        seq_lens: int32 ``[B]`` cached rows after the step (prefix + new).
        scale: softmax scale.
        out: optional ``[T, Hq, D]`` buffer in ``q.dtype``.
        seq_begin: sequences before it (the step's decode rows) are skipped: their rows
            of ``out`` are left as they are.
        query_start_loc_cpu, seq_lens_cpu: host copies of the two (spare the reference
            and the dequantized method a device sync).
        method: Triton backend only: ``"kernel"`` (``kernels.paged_prefill``, reads the
            pool in place, capturable in CUDA graphs), ``"dequantized"`` (the kernel
            over a dequantized copy, ``kernels.prefill_gather``) or ``"cudnn"`` (cuDNN's
            fused attention over that copy, ``kernels.prefill_cudnn``; CUDA only);
            ``None`` chooses by ``prefill_method``.
        num_splits: the kernel's split of the key range (``None``: its own choice).

    Returns:
        ``out`` (or a new tensor), with the rows of sequences ``seq_begin ..`` written.
    """
    if out is None:
        out = torch.empty_like(q)
    guards.check_prefill_args(q, cache_k, cache_v, block_tables, query_start_loc, seq_lens,
                              out, seq_begin)
    if method is not None and method not in PREFILL_METHODS:
        raise ValueError(f"method {method!r} is not one of {list(PREFILL_METHODS)} (or None)")
    if guards.validate_requested(validate):
        guards.check_prefill_lengths(query_start_loc, seq_lens, q.shape[0], seq_begin)
        guards.check_block_tables(block_tables[seq_begin:], seq_lens[seq_begin:],
                                  cache_k.num_blocks, cache_k.block_size)
    on_triton = _pick(backend, q.device) == "triton"
    asked = method is not None  # else chosen by ``prefill_method``, which checks cuDNN
    if on_triton and method is None and query_start_loc_cpu is not None:
        qsl = query_start_loc_cpu
        method = prefill_method(q, cache_k, cache_v,
                                [qsl[b + 1] - qsl[b] for b in range(seq_begin, len(qsl) - 1)])
    if on_triton and method == "cudnn":
        from pagedserve.kernels import prefill_cudnn

        if asked and not prefill_cudnn.available(q, cache_k.num_kv_heads):
            raise ValueError(f"method 'cudnn' needs cuDNN's fused attention: CUDA on an SM "
                             f"9.0 GPU, 16-bit queries of head_dim <= 256; got {q.dtype} "
                             f"{tuple(q.shape)} on {q.device}")
        _check_triton_types(cache_k, cache_v)
        return prefill_cudnn.cudnn_prefill_attention(
            q, cache_k, cache_v, block_tables, seq_lens, scale, out, seq_begin,
            query_start_loc_cpu or query_start_loc.tolist(), seq_lens_cpu or seq_lens.tolist())
    if on_triton and method == "dequantized":
        from pagedserve.kernels.prefill_gather import dequantized_prefill_attention

        _check_triton_types(cache_k, cache_v)
        return dequantized_prefill_attention(
            q, cache_k, cache_v, block_tables, query_start_loc, seq_lens, scale, out,
            seq_begin, query_start_loc_cpu or query_start_loc.tolist(),
            seq_lens_cpu or seq_lens.tolist())
    if on_triton:
        from pagedserve.kernels import paged_prefill

        _check_triton_types(cache_k, cache_v)
        return paged_prefill.paged_prefill_attention(
            q, cache_k, cache_v, block_tables, query_start_loc, seq_lens, scale, out,
            seq_begin, query_start_loc_cpu, seq_lens_cpu, num_splits)
    from pagedserve.kernels.prefill_attention import prefill_attention

    qsl = query_start_loc_cpu or query_start_loc.tolist()
    t0 = qsl[seq_begin]
    out[t0:] = prefill_attention(q[t0:], cache_k, cache_v, block_tables, qsl,
                                 seq_lens_cpu or seq_lens.tolist(), seq_begin, scale)
    return out


def fp8_counters(out_features: int, device: torch.device | str) -> torch.Tensor:
    """The split-K counters of one FP8 weight of ``out_features`` rows: int32 zeros that
    its Triton weight-only launches leave zero (``kernels.fp8_gemv``)."""
    from pagedserve.kernels.fp8_gemv import num_counters

    return torch.zeros(num_counters(out_features), dtype=torch.int32, device=device)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, parts: tuple[int, ...],
    *, counters: torch.Tensor | None = None, method: str | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """``x @ W.T`` for an FP8 block weight ``W`` (``quant/fp8.py``, docs/fp8.md).

    Args:
        x: ``[..., K]`` float16/bfloat16/float32.
        weight: ``float8_e4m3fn`` ``[N, K]``, the fused parts' rows one after another.
        scale_inv: float32 ``[sum(ceil(n / 128) for n in parts), ceil(K / 128)]``.
        parts: row count of each fused part.
        counters: Triton only: the weight's split-K counters (``fp8_counters``); ``None``
            allocates zeros per call.
        method: GPU only: ``"weight_only"`` (``kernels.fp8_gemv``), ``"w8a8_gemv"``
            (its e4m3 form, activations rounded per 1x128 group in registers),
            ``"w8a8"`` (the same activations, ``kernels.fp8_gemm``) or
            ``"w8a8_scaled_mm"`` (the same, cuBLAS's block-scaled GEMM); ``None``:
            ``fp8_matmul.method_for``, an FP8 GEMM from ``W8A8_MIN_ROWS`` rows.

    Returns:
        ``[..., N]`` in ``x.dtype``. The reference dequantizes ``W`` to ``x.dtype`` and runs
        the float matmul (weight-only semantics at every row count).
    """
    from pagedserve.kernels import fp8_matmul

    if _pick(backend, x.device) == "triton":
        return fp8_matmul.fp8_linear(x, weight, scale_inv, parts, counters, method)
    fp8_matmul.check_args(x, weight, scale_inv, parts)
    return F.linear(x, fp8.dequantize(weight, scale_inv, parts, x.dtype))


def gdn_roll_back(
    layers: RollbackLayers, num_rows: torch.Tensor, rows_per_seq: int,
    state_slots: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
    conv_spare: torch.Tensor, recurrent_spare: torch.Tensor,
) -> None:
    """Every GDN layer's state of each sequence set to its spare advanced over its first
    ``num_rows`` (int32 ``[P]``; 0: left as it is) of its ``rows_per_seq`` rows of a
    verify record, in one launch (``kernels.gdn_rollback.roll_back``, which gives the
    shapes; ``layers`` from ``rollback_layers``). Triton only: CUDA tensors, or CPU
    tensors under ``TRITON_INTERPRET=1``; elsewhere a rollback runs the model's own ops
    (``Qwen3_5Model.advance_linear_states``)."""
    _pick("triton", conv_state.device)
    roll_back(layers, num_rows, rows_per_seq, state_slots, conv_state, recurrent_state,
              conv_spare, recurrent_spare)
