"""The Gluon f16 kernel (``kernels/float_fragments.py``) on the host: which launches it takes,
that the launcher binds its signature, and its sm_90 code compiled offline. Its values are
checked against the float64 oracle on a GPU only (``test_paged_decode_gpu.py``,
``fragment-f16``): Gluon has no interpreter.
"""

from __future__ import annotations

import pytest
import torch
from gluon_checks import LaunchRecorder, assert_binds_signature, compile_for_sm90

from pagedserve.kernels import float_fragments as ff
from pagedserve.kernels.decode_plan import DecodeConfig, default_config

H200_SHARED = 232448  # bytes of shared memory a block may opt into on sm_90


def shape_ok(**changes) -> bool:
    args = dict(k_type="f16", v_type="f16", head_dim=256, group=6, block_size=16, block_n=64,
                num_warps=4, stages=2, paged=True, shared_limit=H200_SHARED)
    return ff.supports_shape(**{**args, **changes})


def test_the_library_launch_is_supported():
    cfg = default_config("f16", "f16", 1 << 20)
    assert cfg.quant_dot == "fragment"
    assert shape_ok(block_n=cfg.block_n, num_warps=cfg.num_warps, stages=cfg.num_stages)
    assert ff.ring_bytes(cfg.num_warps, cfg.num_stages) == 128 * 1024


@pytest.mark.parametrize("changes", [
    dict(k_type="bf16", v_type="bf16"), dict(v_type="q8_0"), dict(head_dim=128),
    dict(group=16), dict(block_size=8), dict(block_size=48), dict(block_n=128),
    dict(num_warps=8, block_n=128, stages=2),  # 256 KB of rings
], ids=["bf16", "mixed", "d128", "gqa16", "bs8", "bs48", "32-per-warp", "too-much-shared"])
def test_other_shapes_are_not_supported(changes):
    assert not shape_ok(**changes)


def test_contiguous_layout_takes_any_block_size():
    assert shape_ok(block_size=4096, paged=False) and shape_ok(block_size=4000, paged=False)


def test_cpu_tensors_are_not_supported():
    from pagedserve.kv.formats import KVBlockStorage

    ck = KVBlockStorage.allocate("f16", 4, 16, 4, 256)
    q = torch.zeros(1, 24, 256, dtype=torch.float16)
    assert not ff.supports(q, ck, ck, default_config("f16", "f16"), paged=True)


def test_launcher_binds_every_kernel_argument(monkeypatch):
    """On the CPU, with the kernel replaced by a recorder: each run-time argument once, in
    order, and every compile-time one by name; the ring's depth is ``num_stages``."""
    from pagedserve.kernels import paged_decode
    from pagedserve.kv.formats import KVBlockStorage

    arg_names = ff.float_fragment_kernel.arg_names
    recorder = LaunchRecorder()
    seen = recorder.seen
    monkeypatch.setattr(ff, "float_fragment_kernel", recorder)
    monkeypatch.setattr(ff, "supports", lambda q, ck, cv, cfg, paged: True)
    ck, cv = KVBlockStorage.allocate_pair("f16", "f16", 8, 16, 2, 256)
    q = torch.zeros(3, 12, 256, dtype=torch.float16)
    table = torch.zeros(3, 2, dtype=torch.int32)
    lens = torch.tensor([5, 0, 20], dtype=torch.int32)
    cfg = DecodeConfig(block_n=64, num_warps=4, num_stages=3, min_partition=128,
                       quant_dot="fragment")
    paged_decode.paged_decode_attention(q, ck, cv, table, lens, 0.0625, config=cfg)
    assert_binds_signature(seen, arg_names, 0.0625)
    assert seen["args"][0] is q and seen["args"][2] is ck.data and seen["args"][4] is cv.data
    assert seen["kwargs"]["STAGES"] == 3 and seen["kwargs"]["W"] == 4
    assert seen["kwargs"]["PAGED"] and seen["grid"][1] == 2
    assert seen["kwargs"]["INTERLEAVE"] == 2  # K and V side by side


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_kernel_compiles_for_sm90_as_designed(paged):
    """The tile loop as the module describes it: 16 K and 16 V rows per thread copied as
    16-byte ``cp.async`` (no payload through registers), read back with ``ldmatrix``
    (V transposed), 32 MMAs per warp and 16 tokens (16 for ``K . Q^T``, 16 for
    ``V^T . P^T``), no spills; the only global loads in the loop are the paged layout's two
    table reads a tile ahead (none for the contiguous layout)."""
    stats = compile_for_sm90("f16:f16:fragment:64:4:2:block", paged)
    mem = stats["memory_ops"]
    assert stats["spill"] == 0 and stats["mma"] == 32
    assert mem["LDGSTS.E.BYPASS.128"] == 32
    assert mem["LDSM.16.M88.4"] == 16 and mem["LDSM.16.MT88.4"] == 16
    assert mem.get("LDG.E", 0) == (2 if paged else 0)
    assert not any(op.startswith("LDG.E.128") for op in mem)
