"""The FP8 block weight format of Qwen's ``*-FP8`` checkpoints: one quantize/dequantize pair.

A weight ``W`` ``[N, K]`` is stored as ``float8_e4m3fn`` values ``Q`` ``[N, K]`` and one
float32 ``scale_inv`` per 128x128 block, ``[ceil(N / 128), ceil(K / 128)]``; blocks on the
right and bottom edges are partial when ``N`` or ``K`` is not a multiple of 128::

          k: 0        128       256  K=300
    n: 0   +---------+---------+----+
           | s[0, 0] | s[0, 1] |s02 |     W[n, k] = Q[n, k] * s[n // 128, k // 128]
     128   +---------+---------+----+
           | s[1, 0] | s[1, 1] |s12 |     quantizing: s = amax(|W| over the block) / 448,
     N=200 +---------+---------+----+                 Q = round_e4m3(W / s)

The ``_inv`` in the checkpoint's name follows DeepSeek-V3's convention: the stored value is
what multiplies ``Q`` back to ``W``. 448 is the largest finite e4m3 value.

A fused projection concatenates parts by rows (``parts``: each part's row count). Each part
keeps its own block grid, because a part whose row count is not a multiple of 128 ends in a
partial block that must not share scales with the next part's first rows::

    data  [N0 + N1, K]      rows of part 0 (N0 = 200) | rows of part 1 (N1 = 72)
    scale [2 + 1, KB]       part 0 block rows 0, 1    | part 1 block row 0
    row n -> scale row      n // 128 for n < 200      | 2 + (n - 200) // 128

``scale_rows(parts)`` gives that map; every path (CPU dequantize, tests, and the GPU kernels)
uses it. Where every part but the last fills its block rows (``uniform_block_rows``: all the
published Qwen3.5 shapes), the map is ``n // 128`` and the GPU kernels compute it instead.
"""

from __future__ import annotations

import torch

BLOCK = 128  # rows and columns of one scale block ([128, 128], the only size accepted)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(float8_e4m3fn).max


def num_blocks(n: int) -> int:
    return -(-n // BLOCK)


def scale_shape(rows: int, cols: int) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of one ``[rows, cols]`` weight."""
    return num_blocks(rows), num_blocks(cols)


def scale_rows(parts: tuple[int, ...], device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 ``[sum(parts)]``: for each weight row, the row of the fused scale grid it uses."""
    out = []
    base = 0
    for rows in parts:
        out.append(base + torch.arange(rows, device=device) // BLOCK)
        base += num_blocks(rows)
    return torch.cat(out)


def uniform_block_rows(parts: tuple[int, ...]) -> bool:
    """Whether ``scale_rows(parts)`` is ``n // 128``: every part but the last is a whole
    number of blocks, so no part ends inside a block row."""
    return all(rows % BLOCK == 0 for rows in parts[:-1])


@torch.no_grad()
def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[N, K]`` (any float dtype) -> (``float8_e4m3fn`` ``[N, K]``, float32
    ``scale_inv`` ``[ceil(N/128), ceil(K/128)]``), per the format above.

    The block maximum is taken in float32; an all-zero block gets scale 1 (its values are
    0 whatever the scale). Division happens in float32 before rounding to e4m3.
    """
    n, k = weight.shape
    nb, kb = scale_shape(n, k)
    w = torch.zeros(nb * BLOCK, kb * BLOCK, dtype=torch.float32, device=weight.device)
    w[:n, :k] = weight.float()
    blocks = w.view(nb, BLOCK, kb, BLOCK)  # [NB, 128, KB, 128]
    amax = blocks.abs().amax(dim=(1, 3))  # [NB, KB]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))  # [NB, KB]
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.view(nb * BLOCK, kb * BLOCK)[:n, :k].to(FP8_DTYPE)  # [N, K]
    return q.contiguous(), scale


def dequantize(
    data: torch.Tensor, scale: torch.Tensor, parts: tuple[int, ...] | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``data`` fp8 ``[N, K]`` and ``scale`` float32 ``[R, ceil(K/128)]`` -> ``[N, K]`` in
    ``dtype``. ``parts`` (row counts, default one part of ``N``) says where fused parts start.

    The product is taken in float32 (exact to one rounding, as in float64 then rounded) and
    then rounded to ``dtype``. The scales multiply in place, block column by block column as
    a broadcast, so the only temporary is the float32 weight.
    """
    parts = (data.shape[0],) if parts is None else parts
    return _scaled(data, scale.float()[scale_rows(parts, scale.device)], dtype)


def dequantize_rows(
    data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor,
    parts: tuple[int, ...] | None = None, dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Rows ``rows`` (int64 ``[M]``) of what ``dequantize`` gives, ``[M, K]`` in ``dtype``:
    only those rows are read and widened (a vocabulary subset of an FP8 LM head)."""
    parts = (data.shape[0],) if parts is None else parts
    per_row = scale.float()[scale_rows(parts, scale.device)[rows.to(scale.device)]]  # [M, KB]
    # Gathered as bytes: indexing float8 tensors is not implemented on every device.
    picked = data.view(torch.uint8)[rows.to(data.device)].view(data.dtype)  # [M, K]
    return _scaled(picked, per_row, dtype)


def _scaled(data: torch.Tensor, per_row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data`` fp8 ``[N, K]`` times ``per_row`` float32 ``[N, ceil(K/128)]`` (each row's
    block-column scales), in float32, rounded to ``dtype``."""
    n, k = data.shape
    w = data.float()  # [N, K]
    full = k // BLOCK * BLOCK
    if full:
        w[:, :full].view(n, full // BLOCK, BLOCK).mul_(per_row[:, : full // BLOCK, None])
    if full < k:
        w[:, full:].mul_(per_row[:, -1:])  # the partial last block column
    return w.to(dtype)
