"""K/V write: quantize-and-scatter, bit for bit equal to ``formats.quantize``, on both backends.

The expected storage is built independently: ``formats.quantize`` of the rows (checked
against ``gguf`` in ``test_formats.py``) placed at ``divmod(slot, block_size)`` by a Python
loop; every slot not written must keep its poison bytes (and every byte of the other
storage of a K/V pair, ``KVBlockStorage.allocate_pair``, its own).
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracle import HAS_CUDA, TRITON_DEVICE, needs_cuda, needs_triton

from pagedserve.kernels import ops
from pagedserve.kv import formats
from pagedserve.kv.formats import KVBlockStorage

BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("triton", id="triton", marks=needs_triton),
]


def poison(cache, data_byte=0xA5, scale_byte=0x5A):
    cache.data.view(torch.uint8).fill_(data_byte)
    if cache.scales is not None:
        cache.scales.view(torch.uint8).fill_(scale_byte)
    return cache


def poisoned(kv_type, num_blocks, block_size, hkv, d, device):
    return poison(KVBlockStorage.allocate(kv_type, num_blocks, block_size, hkv, d,
                                          device=device))


def expected(cache: KVBlockStorage, rows: torch.Tensor, slots: list[int]) -> KVBlockStorage:
    want = KVBlockStorage(
        cache.kv_type, cache.data.clone().cpu(),
        None if cache.scales is None else cache.scales.clone().cpu(), cache.head_dim,
    )
    data, scales = formats.quantize(rows.cpu(), cache.kv_type)  # [T, Hkv, W], [T, Hkv, G]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, off = divmod(slot, cache.block_size)
        want.data[block, :, off] = data[t]
        if scales is not None:
            want.scales[block, :, off] = scales[t]
    return want


def assert_same_bits(got: KVBlockStorage, want: KVBlockStorage) -> None:
    assert torch.equal(got.data.cpu().view(torch.uint8), want.data.view(torch.uint8))
    if want.scales is not None:
        assert torch.equal(got.scales.cpu().view(torch.uint8), want.scales.view(torch.uint8))


def make_rows(t, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randn(t, hkv, d, generator=gen) * torch.logspace(-4, 4, t)[:, None, None]
    rows[0, 0, :32] = 0.0
    rows[min(1, t - 1), -1, :32] = -0.0
    if d >= 64 and t > 2:
        rows[2, 0, 40], rows[2, 0, 60] = 3.0, -3.0  # q4_0 magnitude tie
        rows[2, 0, 32:40] = 0.5
    return rows.to(dtype)


@pytest.mark.parametrize("backend,kv_type", [
    *[pytest.param("reference", t, id=f"reference-{t}") for t in formats.KV_TYPES],
    *[pytest.param("triton", t, id=f"triton-{t}", marks=needs_triton)
      for t in formats.GPU_KV_TYPES],
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_is_bit_exact(backend, kv_type, dtype):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    hkv, d, bs, nb = 3, 64, 16, 5
    cache = poisoned(kv_type, nb, bs, hkv, d, device)
    rows = make_rows(9, hkv, d, dtype)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(1))[:9].tolist()
    slots[4] = -1  # a padding row
    want = expected(cache, rows, slots)
    ops.kv_write(cache, rows.to(device), torch.tensor(slots, device=device), backend=backend)
    assert_same_bits(cache, want)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_type", formats.GPU_KV_TYPES)
def test_pair_writes_leave_the_other_storage_alone(backend, kv_type):
    """K and V of a pair share buffers (``allocate_pair``): writing K rows changes exactly
    those rows of K and no byte of V, and the reverse; K and V start from different
    poison bytes, so a write that strays into the other's rows shows."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    hkv, d, bs, nb = 3, 64, 16, 5
    k, v = KVBlockStorage.allocate_pair(kv_type, kv_type, nb, bs, hkv, d, device=device)
    poison(k)
    poison(v, 0x3C, 0xC3)
    gen = torch.Generator().manual_seed(4)
    for i, (target, other) in enumerate(((k, v), (v, k))):
        rows = make_rows(7, hkv, d, torch.float32, seed=i)
        slots = torch.randperm(nb * bs, generator=gen)[:7].tolist()
        slots[3] = nb * bs - 1  # the last token of the last block: K's rows there end at V's
        want, want_other = expected(target, rows, slots), expected(other, rows, [])
        ops.kv_write(target, rows.to(device), torch.tensor(slots, device=device),
                     backend=backend)
        assert_same_bits(target, want)
        assert_same_bits(other, want_other)


@needs_triton
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "bf16"])
@pytest.mark.parametrize("hkv,d", [(1, 128), (4, 256)])
def test_write_shapes(kv_type, hkv, d):
    cache = poisoned(kv_type, 3, 8, hkv, d, TRITON_DEVICE)
    rows = make_rows(5, hkv, d, torch.float32, seed=hkv)
    slots = [0, 23, 9, -1, 16]
    want = expected(cache, rows, slots)
    ops.kv_write(cache, rows.to(TRITON_DEVICE), torch.tensor(slots, device=TRITON_DEVICE),
                 backend="triton")
    assert_same_bits(cache, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_rejects_slots_outside_the_pool(backend):
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    cache = poisoned("q4_0", 2, 16, 2, 64, device)
    rows = torch.randn(3, 2, 64, device=device)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 32 is outside the pool's 32"):
        ops.kv_write(cache, rows, torch.tensor([0, 32, -1], device=device), backend=backend,
                     validate=True)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = -2"):
        ops.kv_write(cache, rows, torch.tensor([0, 1, -2], device=device), backend=backend,
                     validate=True)


@needs_triton
def test_triton_skips_slots_outside_the_pool_without_validate(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_VALIDATE", raising=False)
    cache = poisoned("q8_0", 2, 16, 2, 64, TRITON_DEVICE)
    rows = torch.randn(3, 2, 64)
    slots = [5, 10**9, -7]
    want = expected(cache, rows, [5, -1, -1])
    ops.kv_write(cache, rows.to(TRITON_DEVICE), torch.tensor(slots, device=TRITON_DEVICE),
                 backend="triton")
    assert_same_bits(cache, want)


def test_bad_arguments_are_named():
    cache = poisoned("f16", 2, 16, 2, 64, "cpu")
    with pytest.raises(ValueError, match=r"rows must be \[T, 2, 64\]"):
        ops.kv_write(cache, torch.randn(3, 2, 32), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be contiguous int64"):
        ops.kv_write(cache, torch.randn(3, 2, 64), torch.zeros(3, dtype=torch.int32))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_type", formats.GPU_KV_TYPES)
def test_gpu_write_is_bit_exact_at_prefill_size(kv_type):
    """A prefill-sized write on the GPU: division and rounding must not drift from IEEE."""
    assert HAS_CUDA
    hkv, d, bs = 4, 256, 16
    t = 4096
    nb = t // bs + 4
    cache = poisoned(kv_type, nb, bs, hkv, d, "cuda")
    rows = make_rows(t, hkv, d, torch.bfloat16, seed=7)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(3))[:t]
    slots[::97] = -1
    want = expected(cache, rows, slots.tolist())
    ops.kv_write(cache, rows.cuda(), slots.cuda())
    torch.cuda.synchronize()
    assert_same_bits(cache, want)
