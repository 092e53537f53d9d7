"""K/V storage formats: GGML bit-exactness against the ``gguf`` package, sizes, layout
(of one storage and of a K/V pair)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from pagedserve.kv import formats  # noqa: E402
from pagedserve.kv.formats import KVBlockStorage  # noqa: E402

QTYPES = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def gguf_blocks(x: np.ndarray, kv_type: str) -> tuple[np.ndarray, np.ndarray]:
    """gguf's quantize of float32 rows ``[R, D]`` split into ``(payload, fp16 scale bits)``,
    each ``[R, D/32, *]``."""
    raw = gguf.quants.quantize(x.astype(np.float32), QTYPES[kv_type])
    per = 34 if kv_type == "q8_0" else 18
    blocks = raw.reshape(x.shape[0], -1, per)
    return blocks[..., 2:], blocks[..., :2].copy().view(np.uint16)[..., 0]


def ours(x: np.ndarray, kv_type: str) -> tuple[np.ndarray, np.ndarray]:
    data, scales = formats.quantize(torch.from_numpy(x), kv_type)
    payload = data.numpy().view(np.uint8).reshape(x.shape[0], x.shape[1] // 32, -1)
    return payload, scales.numpy().view(np.uint16)


def assert_bit_exact(x: np.ndarray, kv_type: str) -> None:
    want_payload, want_scale = gguf_blocks(x, kv_type)
    got_payload, got_scale = ours(x, kv_type)
    np.testing.assert_array_equal(got_scale, want_scale)
    np.testing.assert_array_equal(got_payload, want_payload)
    # And back: dequantize matches gguf's dequantize of gguf's own bytes, bit for bit.
    raw = gguf.quants.quantize(x.astype(np.float32), QTYPES[kv_type])
    want = gguf.quants.dequantize(raw, QTYPES[kv_type]).reshape(x.shape)
    data, scales = formats.quantize(torch.from_numpy(x), kv_type)
    got = formats.dequantize(data, scales, kv_type).numpy()
    np.testing.assert_array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


def tricky_rows(kv_type: str) -> np.ndarray:
    """Rows of 64 values built to hit GGML's rounding corners."""
    rows = np.zeros((8, 64), np.float32)
    rows[1, :32] = -0.0  # a negative-zero group: q4_0's scale is +0.0, not -0.0
    # q8_0 with amax 127 -> d = 1, id = 1: the products are the values themselves.
    rows[2, :32] = [127.0, 0.49999997, -0.49999997, 0.5, -0.5, 1.5, -2.5, 126.5] + [0.25] * 24
    rows[2, 32:] = np.linspace(-127, 127, 32, dtype=np.float32)
    # q4_0: +x and -x tie on magnitude; the first one sets the sign of d.
    rows[3, :32] = 1.0
    rows[3, 3], rows[3, 7] = -5.0, 5.0
    rows[3, 32:] = 2.0
    rows[3, 40], rows[3, 50] = 5.0, -5.0
    rows[4] = np.float32(1e-30)  # tiny scales (fp16 scale underflows to 0)
    rows[5] = np.float32(3e6) * np.sign(np.arange(64) - 31.5)  # fp16 scale overflows to inf
    rows[6] = np.arange(64, dtype=np.float32) / 8.0 - 4.0  # many exact halves
    rows[7, 5] = -3.0  # a lone value in a zero group
    return rows


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_bit_exact_on_rounding_corners(kv_type):
    with np.errstate(over="ignore", invalid="ignore"):
        assert_bit_exact(tricky_rows(kv_type), kv_type)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
@pytest.mark.parametrize("log_scale", [-8.0, 0.0, 4.0])
def test_bit_exact_on_random_rows(kv_type, log_scale):
    rng = np.random.default_rng(int(log_scale) + 100)
    x = (rng.standard_normal((64, 256)) * 10.0**log_scale).astype(np.float32)
    x[::7, :32] = 0.0  # zero groups
    x[3, 32:64] = np.round(x[3, 32:64])  # integers: exact halves after scaling
    assert_bit_exact(x, kv_type)


@settings(max_examples=60, deadline=None)
@given(
    kv_type=st.sampled_from(["q8_0", "q4_0"]),
    x=hnp.arrays(
        np.float32, (3, 64),
        elements=st.floats(-1e4, 1e4, width=32, allow_nan=False, allow_subnormal=True),
    ),
)
def test_bit_exact_property(kv_type, x):
    assert_bit_exact(x, kv_type)


@pytest.mark.parametrize("kv_type,expected", [
    ("f16", 512), ("bf16", 512), ("q8_0", 272), ("q4_0", 144), ("f32", 1024),
])
def test_bytes_per_row_at_qwen_head_dim(kv_type, expected):
    assert formats.bytes_per_row(kv_type, 256) == expected
    cache = KVBlockStorage.allocate(kv_type, 3, 16, 4, 256)
    assert cache.nbytes == 3 * 16 * 4 * expected


@pytest.mark.parametrize("kv_type", formats.KV_TYPES)
def test_layout_shapes_and_dtypes(kv_type):
    cache = KVBlockStorage.allocate(kv_type, 5, 16, 2, 128)
    width = 64 if kv_type == "q4_0" else 128
    assert tuple(cache.data.shape) == (5, 2, 16, width)
    assert cache.data.dtype == formats.STORAGE_DTYPE[kv_type]
    if kv_type in ("q8_0", "q4_0"):
        assert tuple(cache.scales.shape) == (5, 2, 16, 4)
        assert cache.scales.dtype == torch.float16
    else:
        assert cache.scales is None
    assert (cache.num_blocks, cache.num_kv_heads, cache.block_size) == (5, 2, 16)


@pytest.mark.parametrize("kv_type", formats.KV_TYPES)
def test_pair_of_one_type_lies_side_by_side(kv_type):
    """``allocate_pair``: the byte diagram in ``formats``, checked by address. Row (b, h,
    t) of K is row ``(b * Hkv + h) * 2 * bs + t`` of one buffer and the same row of V is
    ``bs`` rows later; scales likewise; each storage counts its own bytes, which add up
    to the buffers'."""
    nb, bs, hkv, d = 3, 16, 2, 64
    k, v = KVBlockStorage.allocate_pair(kv_type, kv_type, nb, bs, hkv, d)
    assert (k.interleave, v.interleave) == (2, 2)
    assert k.kv_type == v.kv_type == kv_type and k.head_dim == v.head_dim == d
    for part in ("data", "scales"):
        tk, tv = getattr(k, part), getattr(v, part)
        if tk is None:
            assert tv is None and not formats.spec(kv_type).quantized
            continue
        width = tk.shape[-1]
        assert tk.shape == tv.shape == (nb, hkv, bs, width)
        row = width * tk.element_size()  # bytes
        base = tk.data_ptr()
        for b, h, t in ((0, 0, 0), (0, 1, 5), (2, 0, 15), (2, 1, 9)):
            at = ((b * hkv + h) * 2 * bs + t) * row
            assert tk[b, h, t].data_ptr() - base == at
            assert tv[b, h, t].data_ptr() - base == at + bs * row
        assert tk.untyped_storage().nbytes() == 2 * nb * hkv * bs * row
    assert k.nbytes == v.nbytes == nb * hkv * bs * formats.bytes_per_row(kv_type, d)
    buffers = k.data.untyped_storage().nbytes()
    if k.scales is not None:
        buffers += k.scales.untyped_storage().nbytes()
    assert k.nbytes + v.nbytes == buffers


def test_pair_of_two_types_has_two_buffers():
    """q4_0 K with f16 V: rows of different widths, each storage in its own buffers."""
    k, v = KVBlockStorage.allocate_pair("q4_0", "f16", 3, 16, 2, 64)
    assert (k.kv_type, v.kv_type) == ("q4_0", "f16") and (k.interleave, v.interleave) == (1, 1)
    assert k.data.is_contiguous() and k.scales.is_contiguous() and v.data.is_contiguous()
    assert v.scales is None
    assert k.data.untyped_storage().data_ptr() != v.data.untyped_storage().data_ptr()
    assert k.nbytes == 3 * 16 * 2 * formats.bytes_per_row("q4_0", 64)
    assert v.nbytes == 3 * 16 * 2 * formats.bytes_per_row("f16", 64)


def test_q4_0_nibble_order_is_ggml():
    # Values -8..7 twice over with d = 1: byte j = q[j] | q[16 + j] << 4, q = value + 8.
    x = torch.tensor([[-8.0] + [float(v % 16 - 8) for v in range(1, 32)]])
    data, scales = formats.quantize(x, "q4_0")
    assert float(scales[0, 0]) == 1.0
    q = [int(v) + 8 for v in x[0]]
    want = [q[j] | (q[16 + j] << 4) for j in range(16)]
    assert data[0].tolist() == want


def test_errors_name_the_bad_value():
    with pytest.raises(ValueError, match="'q5_0'.*accepted"):
        formats.spec("q5_0")
    with pytest.raises(ValueError, match="head_dim 48 .* multiple of 32"):
        formats.bytes_per_row("q4_0", 48)


def test_f32_stores_exactly_and_is_cpu_only():
    x = torch.randn(7, 64, dtype=torch.float64).float()
    data, scales = formats.quantize(x, "f32")
    assert scales is None and torch.equal(formats.dequantize(data, None, "f32"), x)
    formats.check_device_support("f32", "cpu")
    formats.check_device_support("q4_0", "cuda")
    with pytest.raises(ValueError, match="'f32' runs on the CPU only.*'f16', 'bf16'"):
        formats.check_device_support("f32", "cuda")
