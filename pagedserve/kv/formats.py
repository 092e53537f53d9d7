"""K/V storage types: one place for each type's size, and its quantize/dequantize pair.

Types are data, not classes: a storage type is a name (``"f16"``, ``"bf16"``, ``"q8_0"``,
``"q4_0"``, ``"f32"``) that configs carry and kernels take as a ``constexpr``. ``q8_0`` and
``q4_0`` are GGML's formats: groups of 32 values, each group with one fp16 scale. ``f32``
stores K/V exactly as a float32 model computes them; it is for the CPU reference path
(exact comparisons with transformers), and the GPU kernels do not take it
(``GPU_KV_TYPES``).

Bytes per row (one token, one K/V head) for head_dim D:

    f32       : 4 * D
    f16, bf16 : 2 * D
    q8_0      : (D / 32) * 34     (32 int8 + one fp16 scale per group)
    q4_0      : (D / 32) * 18     (16 bytes of nibbles + one fp16 scale per group)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.kv.type_names import KV_TYPES

GROUP_SIZE = 32


@dataclass(frozen=True)
class KVTypeSpec:
    """Size facts of one storage type."""

    name: str
    quantized: bool
    # Bytes per group of ``group_size`` values: payload and scale.
    group_size: int
    payload_bytes_per_group: int
    scale_bytes_per_group: int

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim <= 0 or head_dim % self.group_size:
            raise ValueError(
                f"head_dim {head_dim} cannot be stored as {self.name}: it must be a positive "
                f"multiple of {self.group_size}"
            )

    def bytes_per_row(self, head_dim: int) -> int:
        """Bytes of one token row of one K/V head (payload plus scales)."""
        self.check_head_dim(head_dim)
        groups = head_dim // self.group_size
        return groups * (self.payload_bytes_per_group + self.scale_bytes_per_group)


_SPECS = {
    "f16": KVTypeSpec("f16", False, 1, 2, 0),
    "bf16": KVTypeSpec("bf16", False, 1, 2, 0),
    "q8_0": KVTypeSpec("q8_0", True, GROUP_SIZE, 32, 2),
    "q4_0": KVTypeSpec("q4_0", True, GROUP_SIZE, 16, 2),
    "f32": KVTypeSpec("f32", False, 1, 4, 0),
}
if tuple(_SPECS) != KV_TYPES:
    raise ImportError(f"kv/type_names.py lists {KV_TYPES}, but formats.py has {tuple(_SPECS)}")
# The types the Triton kernels read and write.
GPU_KV_TYPES: tuple[str, ...] = ("f16", "bf16", "q8_0", "q4_0")


def check_gpu_type(kv_type: str, what: str) -> None:
    """``ValueError`` naming ``what`` if the GPU kernels do not take ``kv_type``."""
    spec(kv_type)
    if kv_type not in GPU_KV_TYPES:
        raise ValueError(f"{what} do not take K/V type {kv_type!r}: {kv_type!r} runs on the "
                         f"CPU only; accepted: {list(GPU_KV_TYPES)}")


def check_device_support(kv_type: str, device: str | torch.device) -> None:
    """``ValueError`` if K/V of ``kv_type`` cannot live on ``device`` (f32 is CPU-only)."""
    spec(kv_type)
    if torch.device(device).type == "cuda":
        check_gpu_type(kv_type, "CUDA devices")


def spec(kv_type: str) -> KVTypeSpec:
    """The spec of ``kv_type``; ``ValueError`` names the accepted types."""
    try:
        return _SPECS[kv_type]
    except KeyError:
        raise ValueError(
            f"unknown K/V storage type {kv_type!r}; accepted: {list(KV_TYPES)}"
        ) from None


def bytes_per_row(kv_type: str, head_dim: int) -> int:
    return spec(kv_type).bytes_per_row(head_dim)


# ---------------------------------------------------------------------------------------
# Quantize / dequantize (torch; the reference every other path is tested against)
# ---------------------------------------------------------------------------------------
#
# Storage layout, per layer, of K and of V (``KVBlockStorage``; W = ``payload_width``):
#
#   f16 / bf16   data   [num_blocks, Hkv, block_size, D]        float16 / bfloat16
#   f32          data   [num_blocks, Hkv, block_size, D]        float32 (CPU only)
#   q8_0         data   [num_blocks, Hkv, block_size, D]        int8    (qs)
#                scales [num_blocks, Hkv, block_size, D // 32]  float16 (d, one per group)
#   q4_0         data   [num_blocks, Hkv, block_size, D // 2]   uint8   (packed nibbles)
#                scales [num_blocks, Hkv, block_size, D // 32]  float16
#
# K and V of one layer share buffers when their types match (``allocate_pair``, the
# engine's layout): one payload buffer [num_blocks, Hkv, 2, block_size, W] and one of
# scales [num_blocks, Hkv, 2, block_size, D // 32], K at index 0 and V at index 1 of the
# third dim, each storage a view of its index, so that the K rows and the V rows that a
# decode program reads for one (block, K/V head) are adjacent in memory. K and V of
# different types (rows of different widths) each get their own buffers. With
# I = ``KVBlockStorage.interleave`` (1: own buffers, 2: a pair):
#
#   payload buffer of a pair (I = 2), rows of W elements, bs = block_size:
#
#     (b, h) = (0, 0)           (0, 1)                        (b, h)
#     | K 0..bs-1 | V 0..bs-1 | K 0..bs-1 | V 0..bs-1 | ... | K 0..bs-1 | V 0..bs-1 | ...
#     ^ K.data    ^ V.data    ^ row 2 bs of K.data          ^ row (b Hkv + h) 2 bs of K.data
#
#   scales buffer of a pair: the same, rows of D // 32 float16
#
#   row (b, h, t) of a storage = row (b * Hkv + h) * (I * block_size) + t counted from its
#   own data pointer, and the same row counted from its own scales pointer
#
# The kernels address K and V rows by that one int32 index
# (``kernels/guards.check_row_layout`` checks the strides); torch code indexes the
# [num_blocks, Hkv, block_size, W] views.
#
# Scales sit apart from payloads so that every payload row starts 16-byte aligned. Within
# one q4_0 group of 32 values the nibble order is GGML's:
#
#   byte j (0..15) of group g:   bits 7..4 = q[g*32 + 16 + j]   bits 3..0 = q[g*32 + j]
#
#   group g payload:  | b0 | b1 | ... | b15 |      value = (q - 8) * d_g,  q in 0..15
#                       lo nibbles -> values  0..15 of the group
#                       hi nibbles -> values 16..31 of the group
#
# q8_0: value = qs * d_g, qs in -127..127. Rounding follows GGML's reference exactly
# (float32 arithmetic; the scale is rounded to fp16 only when stored), so the bits equal
# the ``gguf`` package's quantize and dequantize. The Triton kernels write this layout
# bit-identically (``kernels/kv_write.py``) and read it (``kernels/kv_tiles.py``).


def quantize(x: torch.Tensor, kv_type: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize rows ``x`` ``[..., D]`` to ``(data, scales)`` in the layout above.

    Float types return ``(x cast, None)``.
    """
    s = spec(kv_type)
    if not s.quantized:
        return x.to(STORAGE_DTYPE[kv_type]), None
    s.check_head_dim(x.shape[-1])
    g = x.float().reshape(*x.shape[:-1], -1, GROUP_SIZE)  # [..., D/32, 32]
    if kv_type == "q8_0":
        d = g.abs().amax(dim=-1, keepdim=True) / 127.0
        inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
        q = _roundf(g * inv).to(torch.int8)
        return q.reshape(x.shape), d.squeeze(-1).to(torch.float16)
    # q4_0: the signed value of largest magnitude (first one on ties) maps to -8.
    imax = g.abs().argmax(dim=-1, keepdim=True)
    d = torch.gather(g, -1, imax) / -8.0
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = torch.trunc(g * inv + 8.5).clamp(0, 15).to(torch.uint8)  # [..., D/32, 32]
    packed = q[..., :16] | (q[..., 16:] << 4)  # [..., D/32, 16]
    return packed.reshape(*x.shape[:-1], -1), d.squeeze(-1).to(torch.float16)


def dequantize(
    data: torch.Tensor, scales: torch.Tensor | None, kv_type: str,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize``: ``[..., D]`` in ``dtype``."""
    s = spec(kv_type)
    if not s.quantized:
        return data.to(dtype)
    if scales is None:
        raise ValueError(f"{kv_type} data needs its scales to dequantize")
    d = scales.float().unsqueeze(-1)  # [..., D/32, 1]
    if kv_type == "q8_0":
        q = data.float().reshape(*data.shape[:-1], -1, GROUP_SIZE)
        return (q * d).reshape(data.shape).to(dtype)
    packed = data.reshape(*data.shape[:-1], -1, GROUP_SIZE // 2)  # [..., D/32, 16]
    lo = (packed & 0x0F).float() - 8.0
    hi = (packed >> 4).float() - 8.0
    q = torch.cat([lo, hi], dim=-1)  # [..., D/32, 32]
    return (q * d).reshape(*data.shape[:-1], -1).to(dtype)


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: halves away from zero (``torch.round`` rounds halves to even).

    ``floor(|x| + 0.5)`` is not ``roundf``: for ``|x| = 0.49999997`` the float32 sum rounds up
    to 1.0. ``|x| - floor(|x|)`` is exact, so comparing it with 0.5 is.
    """
    a = x.abs()
    whole = torch.floor(a)
    return torch.sign(x) * (whole + (a - whole >= 0.5).to(a.dtype))


STORAGE_DTYPE = {
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "q8_0": torch.int8,
    "q4_0": torch.uint8,
}


def payload_width(kv_type: str, head_dim: int) -> int:
    """Last-dim width of the ``data`` tensor for rows of ``head_dim`` values."""
    spec(kv_type).check_head_dim(head_dim)
    return head_dim // 2 if kv_type == "q4_0" else head_dim


def _zeros(kv_type: str, shape: tuple[int, ...], head_dim: int,
           device: str | torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Zeroed ``(data [*shape, W], scales [*shape, D // 32] or None)`` of ``kv_type``."""
    data = torch.zeros((*shape, payload_width(kv_type, head_dim)),
                       dtype=STORAGE_DTYPE[kv_type], device=device)
    scales = None
    if spec(kv_type).quantized:
        scales = torch.zeros((*shape, head_dim // GROUP_SIZE), dtype=torch.float16,
                             device=device)
    return data, scales


@dataclass
class KVBlockStorage:
    """K or V of one full-attention layer, for all blocks of the pool.

    Attributes:
        kv_type: storage type name.
        data: ``[num_blocks, Hkv, block_size, W]`` payload (``W = payload_width``); its
            own buffer, or a view of the one it shares with the layer's other storage
            (``allocate_pair``, ``interleave``).
        scales: ``[num_blocks, Hkv, block_size, D // 32]`` float16 (shared like
            ``data``), or ``None``.
    """

    kv_type: str
    data: torch.Tensor
    scales: torch.Tensor | None
    head_dim: int

    @classmethod
    def allocate(
        cls, kv_type: str, num_blocks: int, block_size: int, num_kv_heads: int,
        head_dim: int, device: str | torch.device = "cpu",
    ) -> KVBlockStorage:
        """One storage in its own buffers (``interleave`` 1)."""
        data, scales = _zeros(kv_type, (num_blocks, num_kv_heads, block_size), head_dim,
                              device)
        return cls(kv_type, data, scales, head_dim)

    @classmethod
    def allocate_pair(
        cls, k_type: str, v_type: str, num_blocks: int, block_size: int, num_kv_heads: int,
        head_dim: int, device: str | torch.device = "cpu",
    ) -> tuple[KVBlockStorage, KVBlockStorage]:
        """``(K, V)`` of one layer. Of one type, side by side in shared buffers
        ``[num_blocks, Hkv, 2, block_size, *]`` (K index 0, V index 1; ``interleave`` 2),
        so that decode reads a (block, head) piece of K and of V from adjacent memory; of
        different types (rows of different widths), each in its own buffers."""
        if k_type != v_type:
            return (cls.allocate(k_type, num_blocks, block_size, num_kv_heads, head_dim, device),
                    cls.allocate(v_type, num_blocks, block_size, num_kv_heads, head_dim, device))
        data, scales = _zeros(k_type, (num_blocks, num_kv_heads, 2, block_size), head_dim,
                              device)
        k, v = (cls(k_type, data[:, :, i], None if scales is None else scales[:, :, i],
                    head_dim) for i in range(2))
        return k, v

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[1]

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    @property
    def interleave(self) -> int:
        """How many storages share each (block, head) piece of this storage's buffer: 1
        (its own buffer) or 2 (a pair of ``allocate_pair``). Read from the head stride,
        ``interleave * block_size`` rows (``guards.check_row_layout`` checks every stride)."""
        return self.data.stride(1) // max(1, self.block_size * self.data.shape[3])

    @property
    def nbytes(self) -> int:
        """This storage's own bytes (a pair's K and V each count their half of the
        buffers they share)."""
        extra = self.scales.numel() * self.scales.element_size() if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + extra
