"""The cuDNN prefill method (``kernels/prefill_cudnn.py``) against the float64 oracle.

On the CPU cuDNN's call is stood in for by float64 attention with cuDNN's contract (a
top-left causal mask, the natural-log log-sum-exp of each query row, K/V of ``Hkv``
heads): what is under test is everything around it, the gather of each sequence's rows,
the split of a chunk into its prefix and its own rows, and the log-sum-exp merge. On
CUDA (``gpu``) the real op runs, on the 27B heads.
"""

from __future__ import annotations

import pytest
import torch
from kernel_oracle import HAS_CUDA, TRITON_DEVICE, bound, needs_triton
from test_paged_prefill import GPU_TYPES, GRID_NEW, GRID_PREFIX, run_case

from pagedserve.kernels import prefill_cudnn


def contract_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention as its contract states it, in float64: ``q`` ``[n, Hq,
    D]``, ``k``/``v`` ``[L, Hkv, D]`` -> ``[1, Hq, n, D]`` in ``q.dtype`` and the float32
    log-sum-exp ``[1, Hq, n, 1]``; causal is aligned top-left (query i sees keys 0 .. i).
    With bucketed plans cuDNN's log-sum-exp is wrong for one query row (``prefill_cudnn.
    MIN_QUERY_ROWS``), so the stand-in refuses such a call; a single key never reaches
    cuDNN (the closed form)."""
    n, hq, d = q.shape
    assert n >= 2 or k.shape[0] == 1, "a cuDNN call of one query row"
    length, hkv = k.shape[:2]
    qh = q.double().reshape(n, hkv, hq // hkv, d)
    s = torch.einsum("ihgd,lhd->hgil", qh, k.double()) * scale  # [Hkv, G, n, L]
    if causal:
        seen = torch.arange(length)[None, :] <= torch.arange(n)[:, None]  # [n, L]
        s = s.masked_fill(~seen.to(s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [Hkv, G, n]
    o = torch.einsum("hgil,lhd->hgid", torch.softmax(s, dim=-1), v.double())
    return (o.reshape(1, hq, n, d).to(q.dtype),
            lse.reshape(1, hq, n, 1).float())


@pytest.fixture
def contract(monkeypatch):
    monkeypatch.setattr(prefill_cudnn, "_attend", contract_attend)
    monkeypatch.setattr(prefill_cudnn, "available", lambda q, num_kv_heads: True)


@needs_triton  # the rows' gather is the Triton copy of the dequantized method
@pytest.mark.parametrize("types", ["bf16:bf16", "q8_0:q4_0"])
def test_split_and_merge_equal_the_oracle(contract, types):
    k_type, v_type = types.split(":")
    # Fresh prompts (one call), chunks over prefixes of every size, a one-row chunk, and
    # sequences of very different lengths in one launch.
    err = run_case("triton", k_type, v_type, [40, 1, 17, 64, 3], [0, 37, 16, 100, 1],
                   hkv=2, group=3, head_dim=64, method="cudnn")
    assert err < bound(k_type, v_type)


@needs_triton
def test_rows_before_seq_begin_are_left_alone(contract):
    err = run_case("triton", "q8_0", "q8_0", [1, 1, 30, 9], [20, 5, 0, 44], hkv=2, group=2,
                   head_dim=64, seq_begin=2, method="cudnn")
    assert err < bound("q8_0", "q8_0")


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n", [1, 6])
def test_one_key_has_the_closed_form(causal, n):
    # torch does not send a single key to cuDNN: a prefix of one row, or a one-row chunk's
    # own row, are computed here (for causal, only n = 1 is a square call).
    if causal and n > 1:
        pytest.skip("a causal call is square")
    gen = torch.Generator().manual_seed(n)
    q = torch.randn(n, 6, 32, generator=gen)
    k, v = torch.randn(1, 2, 32, generator=gen), torch.randn(1, 2, 32, generator=gen)
    out, lse = prefill_cudnn._attend(q, k, v, causal, 0.3)
    want, want_lse = contract_attend(q, k, v, causal, 0.3)
    assert out.shape == want.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(lse, want_lse, rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(HAS_CUDA, reason="the CPU refusal")
def test_method_needs_cuda():
    if TRITON_DEVICE != "cpu":
        pytest.skip("Triton runs on CUDA here")
    with pytest.raises(ValueError, match="method 'cudnn' needs cuDNN"):
        run_case("triton", "bf16", "bf16", [4], [0], method="cudnn")


# ---- the real op (CUDA) ------------------------------------------------------------------

def _needs_sm90() -> None:
    """Skip off Hopper; on it, the op must run (a skip there would hide a broken build)."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("cuDNN fused attention at head_dim 256 is an SM 9.0 path")
    q = torch.empty(1, 24, 256, device="cuda", dtype=torch.bfloat16)
    assert prefill_cudnn.available(q, 4), "cuDNN fused attention does not run on this H100/H200"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("k_type", GPU_TYPES)
@pytest.mark.parametrize("v_type", ["bf16", "q4_0"])
def test_gpu_grid_27b_heads(k_type, v_type):
    _needs_sm90()
    err = run_case("triton", k_type, v_type, GRID_NEW, GRID_PREFIX, hkv=4, group=6,
                   head_dim=256, device="cuda", seed=3, method="cudnn")
    assert err < bound(k_type, v_type)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("chunk", [1, 5, 64, 65, 1024, 4096])
def test_gpu_chunk_lengths_27b_shape(chunk):
    _needs_sm90()
    err = run_case("triton", "q8_0", "q4_0", [chunk, chunk], [8191, 4], hkv=4, group=6,
                   head_dim=256, device="cuda", method="cudnn")
    assert err < bound("q8_0", "q4_0")


@pytest.mark.parametrize("kv_type", ["bf16", "q8_0"])
def test_cudnn_takes_launches_of_long_chunks_only(monkeypatch, kv_type):
    # cuDNN's plans are built in the warm-up for long chunks only: a launch that mixes a
    # long chunk with a short one takes the Triton path (over a dequantized copy for
    # quantized K/V), as does a launch with no long chunk.
    from pagedserve.kernels import ops
    from pagedserve.kv.formats import KVBlockStorage

    monkeypatch.setattr(ops, "LONG_CHUNK_METHOD", "cudnn")
    monkeypatch.setattr(prefill_cudnn, "available", lambda q, num_kv_heads: True)
    cache = KVBlockStorage.allocate(kv_type, 4, 16, 2, 64, torch.device("cpu"))
    q = torch.empty(0, 4, 64, dtype=torch.bfloat16)
    long_rows = ops.LONG_CHUNK_MIN_ROWS
    triton_long = "dequantized" if kv_type == "q8_0" else "kernel"
    assert ops.prefill_method(q, cache, cache, [long_rows, 2 * long_rows]) == "cudnn"
    assert ops.prefill_method(q, cache, cache, [long_rows, 30]) == triton_long
    assert ops.prefill_method(q, cache, cache, [long_rows - 1, 30]) == "kernel"
    assert ops.prefill_method(q.float(), cache, cache, [long_rows]) == "kernel"
