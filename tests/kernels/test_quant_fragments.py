"""The Gluon q4_0 / q8_0 kernel's label maps, on the host (the kernel itself runs on a GPU only:
tests/kernels/test_paged_decode_gpu.py, ``fragment``).

The kernel relabels a row's payload bytes by reshaping them into bits and permuting the
bits (q's ``Q_PERM``, K's ``K_GROUP_PERM``, V's pair tiles by ``V_PAIR_PERM``); the
module documents the same maps as formulas (``k_group_label_to_byte``,
``v_label_to_byte``) and stores the output through the V formula. These tests apply the
permutations to index tensors with torch and check them against the formulas, and that
every map is a bijection of the row's values; and they compile the kernel for sm_90 on
the host, which checks its layout premises.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from gluon_checks import LaunchRecorder, assert_binds_signature, compile_for_sm90
from kernel_oracle import TRITON_DEVICE

from pagedserve.kernels import quant_fragments as qf

GEOMETRIES = [qf.GEOMETRY["q4_0"], qf.GEOMETRY["q8_0"]]
IDS = ["q4_0", "q8_0"]


def _k_value(geo, half: int, c: int) -> int:
    """The head_dim index whose K value label ``c`` of product half ``half`` holds: a
    q4_0 byte ``16 g + j`` holds values ``32 g + j`` (low nibble) and ``32 g + 16 + j``
    (high); a q8_0 byte is its value's index."""
    byte = qf.k_group_label_to_byte(c, half, geo.group_bytes)
    if geo.halves:
        return 32 * (byte // 16) + 16 * half + byte % 16
    return byte


@pytest.mark.parametrize("geo", GEOMETRIES, ids=IDS)
def test_k_group_labels_are_the_documented_bit_order(geo):
    """K's grouped map written out: label c of a half <- byte (c3, c0, c1, c2) as bits
    j0..j3 of group (c4, c5, c6)'s bytes of that half, so labels 16 g .. 16 g + 15 (one
    k-step) are 16 bytes of group g, and both halves together are all of the row's."""
    gb = geo.group_bytes
    for c in range(128):
        j = sum(((c >> i) & 1) << k for i, k in ((3, 0), (0, 1), (1, 2), (2, 3)))
        assert qf.k_group_label_to_byte(c, 0, gb) == gb * (c >> 4) + j
    for g in range(8):
        for half in (0, 1):
            got = sorted(qf.k_group_label_to_byte(16 * g + c, half, gb) for c in range(16))
            start = gb * g + (16 * half if gb > 16 else 0)
            assert got == list(range(start, start + 16))
    values = sorted(_k_value(geo, half, c) for half in (0, 1) for c in range(128))
    assert values == list(range(256))


@pytest.mark.parametrize("geo", GEOMETRIES, ids=IDS)
def test_k_group_operand_holds_the_documented_labels(geo):
    """K's side on the host: the group asm's (``Q4_GROUP_ASM``, ``Q8_GROUP_ASM``) output
    element j' of group g and half s holds byte j of that half's 16 bytes with bits j0,
    j1 of j swapped (a register pairs bytes 0 and 2); ``_k_group_operand`` reshapes it
    to ``[j3, j2, j1', j0']`` and permutes it by ``K_GROUP_PERM``. Label c must then
    hold ``k_group_label_to_byte(16 g + c, s)``."""
    perm = qf.K_GROUP_PERM.value
    gb = geo.group_bytes
    for g in range(8):
        for half in (0, 1):
            j = torch.arange(16)
            base = gb * g + (16 * half if gb > 16 else 0)
            byte = base + ((j & 1) << 1 | (j >> 1) & 1 | (j & 12))  # element j' -> byte
            got = byte.reshape(1, 1, 2, 2, 2, 2).permute(*perm).reshape(16).tolist()
            assert got == [qf.k_group_label_to_byte(16 * g + c, half, gb) for c in range(16)]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=IDS)
def test_q_is_relabelled_like_k(geo):
    """q's labels (``q_operand``: value ``32 g + 16 s + j`` to half s's ``[g2 g1 g0 j3 j2
    j1 j0]``, permuted by ``Q_PERM``) must be K's, value for value, in both halves."""
    layouts = qf.fragment_layouts(geo.kv_type, 1, 32 if geo.halves else 16)
    index = torch.arange(128).reshape(1, 1, *[2] * 7).permute(*layouts["Q_PERM"]).reshape(128)
    for half in (0, 1):
        q_values = (32 * (index // 16) + 16 * half + index % 16).tolist()
        assert q_values == [_k_value(geo, half, c) for c in range(128)]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=IDS)
def test_k_group_thread_labels_are_one_word(geo):
    """The grouped layout's premise: the labels one thread holds in one k-step (c, c+1,
    c+8, c+9 for c = 16 g + 2 t) are the four bytes of one word (word t of the half's 16
    bytes of group g), so the asm works on the word as loaded, with no prmt."""
    gb = geo.group_bytes
    for g in range(8):
        for half in (0, 1):
            for t in range(4):
                c = 16 * g + 2 * t
                held = sorted(qf.k_group_label_to_byte(x, half, gb)
                              for x in (c, c + 1, c + 8, c + 9))
                start = gb * g + (16 * half if gb > 16 else 0) + 4 * t
                assert held == list(range(start, start + 4))


def pair_tile_labels(geo, tokens: int) -> torch.Tensor:
    """``(token, byte)`` at each ``[label, token]`` of ``V^T`` after ``_pair_fragments``,
    on the host: the rows split into even and odd tokens, the pair asm's outputs at each
    position (its four operand elements are the four bytes of one word), the join and the
    ``V_PAIR_PERM`` relabel. Returns int ``[NL, T, 2]``."""
    gb = geo.group_bytes
    a = torch.arange(tokens // 2)[:, None, None]  # token pair
    g = torch.arange(8)[None, :, None]
    j = torch.arange(gb)[None, None, :]  # word j // 4, asm position j % 4
    token = 2 * a + (j % 2)  # the asm pairs rows t, t + 1 at positions (0, 1) and (2, 3)
    outputs = []
    for second_half in (0, 1):  # first / second output: bytes 0, 1 or 2, 3 of the word
        byte = gb * g + 4 * (j // 4) + 2 * second_half + (j % 4) // 2
        outputs.append(torch.stack(torch.broadcast_tensors(token, byte), -1))
    joined = torch.stack(outputs, -2)  # [T / 2, 8, GB, 2 (x), 2 (token, byte)]
    perm = qf.fragment_layouts(geo.kv_type, 1, tokens)["V_PAIR_PERM"]
    bits = joined.reshape(1, *[2] * (len(perm) - 1), 2)
    return bits.permute(*perm, len(perm)).reshape(geo.labels, tokens, 2)


@pytest.mark.parametrize("tokens", [16, 32])
@pytest.mark.parametrize("geo", GEOMETRIES, ids=IDS)
def test_v_pair_labels_match_the_documented_map(geo, tokens):
    got = pair_tile_labels(geo, tokens)
    want_byte = torch.tensor([qf.v_label_to_byte(r, geo.label_bits) for r in range(geo.labels)])
    assert torch.equal(got[..., 0], torch.arange(tokens).expand(geo.labels, tokens))
    assert torch.equal(got[..., 1], want_byte[:, None].expand(geo.labels, tokens))
    assert sorted(want_byte.tolist()) == list(range(geo.labels))


@pytest.mark.parametrize("geo", GEOMETRIES, ids=IDS)
def test_v_rows_map_to_one_group_per_lane_group(geo):
    """V's output rows r and r + 8 k for one lane (r % 8 fixed) come from one group, whose
    scale is then one per token for that thread."""
    for g in range(8):
        groups = {qf.v_label_to_byte(r, geo.label_bits) // geo.group_bytes
                  for r in range(g, geo.labels, 8)}
        assert groups == {g}


@pytest.mark.parametrize("spec,mma", [("q4_0:q4_0:fragment:128:4:2:block", 64),
                                      ("q8_0:q8_0:fragment:64:4:2:block", 32)],
                         ids=["q4_0", "q8_0"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_kernel_compiles_for_sm90_with_its_layout_premises(spec, mma, paged):
    """Compiling checks the premises that the GPU tests, which check values, cannot see (a
    layout conversion is an identity on values wherever the data lives): every
    conversion the kernel declares free (``assert_trivial``: the relabelled byte
    tiles already sit in the threads that hold those MMA operands; the scores after
    ``movmatrix`` are the B operand of ``P @ V``) moves no data between threads, or
    compilation fails; and the tile loop runs its MMAs (64 per 512 q4_0 values, 32 per 256
    q8_0 values) without storing to shared memory (the ring is filled by ``cp.async``
    alone). (A wrong lane of ``V_PAIR`` fails this test; a wrong register order within a
    thread does not, and costs only byte shuffles.)"""
    stats = compile_for_sm90(spec, paged)
    assert stats["mma"] == mma
    assert not any(op.startswith(("STS", "STSM")) for op in stats["memory_ops"])


@pytest.mark.parametrize("spec,mma,reads", [
    # K's words (word lane % 4 of every group's 16 bytes; q8_0 two halves of 2 rows, q4_0
    # one of 4) as 8 ldmatrix.x4, V's rows and the scale rows (8 groups of a token) as
    # 16-byte loads.
    ("q4_0:q4_0:fragment:128:4:2:block", 64, {"LDSM.16.M88.4": 8, "LDS.128": 12}),
    ("q8_0:q8_0:fragment:64:4:2:block", 32, {"LDSM.16.M88.4": 8, "LDS.128": 10})],
    ids=["q4_0", "q8_0"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_ring_loop_reads_memory_only_through_its_copies(spec, mma, reads, paged):
    """The shared-memory ring: its tile loop issues the next tile's payload as 16-byte
    ``cp.async`` copies (``LDGSTS``, 16 per thread), reads the current one back from
    shared memory (``reads``: 16 bytes per instruction), and issues no global load: block
    ids ride the copies too (``quant_ring.copy_ids``). A table load in the loop makes
    ptxas serialize the paged loop's dequantization chains, which made it slower than the
    contiguous loop on the H200 (docs/kernel-decisions.md), so the paged loop's scheduled
    stall cycles must stay within 10% of the contiguous loop's."""
    stats = compile_for_sm90(spec, paged)
    ops = stats["memory_ops"]
    assert stats["spill"] == 0 and stats["mma"] == mma
    assert ops.get("LDGSTS.E.BYPASS.128", 0) >= 16, ops
    assert {op: ops.get(op, 0) for op in reads} == reads, ops
    assert not any(op.startswith("LDG.") for op in ops), ops  # no global load in the loop
    if paged:
        contiguous = compile_for_sm90(spec, False)
        assert stats["stall_cycles"] <= 1.1 * contiguous["stall_cycles"], (
            stats["stall_cycles"], contiguous["stall_cycles"])


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_q8_0_scores_k_a_group_at_a_time(paged):
    """q8_0's K goes into the products as raw ``1152 + qs`` (``Q8_GROUP_ASM``), its
    offsets and scales applied to each group's partial scores in f32: in the ring loop
    only V's 128 values per thread are dequantized in f16 (64 ``HMUL2``; 128 with K's),
    and the loop stays well under the per-value form's size (docs/kernel-decisions.md)."""
    stats = compile_for_sm90("q8_0:q8_0:fragment:64:4:2:block", paged)
    assert stats["ops"].get("HMUL2") == 64, stats["ops"]
    assert stats["instructions"] < 850, stats["instructions"]


def test_small_q8_0_batches_launch_wide_tiles_at_their_own_budget(monkeypatch):
    """The library's q8_0 launch for 2 sequences (``default_config``: 8 warps of 16
    tokens, one program per SM) over a workspace sized for two per SM: the grid and the
    plan's budget are the launch's (33 chunks per K/V head on 132 SMs), not the
    workspace's 66; for 5 sequences, 4 warps at the workspace's budget."""
    from pagedserve.kernels import ops
    from pagedserve.kernels.decode_plan import DecodeWorkspace
    from pagedserve.kv.formats import KVBlockStorage

    budget_arg = qf.fragment_decode_kernel.arg_names.index("chunk_budget")
    recorder = LaunchRecorder()
    monkeypatch.setattr(qf, "fragment_decode_kernel", recorder)
    monkeypatch.setattr(qf, "supports", lambda q, ck, cv, cfg: True)
    dev = TRITON_DEVICE
    ck, cv = KVBlockStorage.allocate_pair("q8_0", "q8_0", 8, 16, 4, 256, dev)
    ws = DecodeWorkspace(8, 24, 4, 256, dev, occupancy=2.0, num_sms=132)
    for batch, grid, budget, warps in [(2, (33, 4), 33, 8), (5, (66, 4), 66, 4)]:
        ops.paged_decode_attention(
            torch.zeros(batch, 24, 256, dtype=torch.float16, device=dev), ck, cv,
            torch.zeros(batch, 2, dtype=torch.int32, device=dev),
            torch.full((batch,), 20, dtype=torch.int32, device=dev),
            0.0625, backend="triton", workspace=ws)
        seen = recorder.seen
        assert seen["grid"] == grid
        assert seen["args"][budget_arg] == budget
        assert seen["kwargs"]["num_warps"] == seen["kwargs"]["W"] == warps


def test_launcher_binds_every_kernel_argument(monkeypatch):
    """The Gluon kernel runs only on a GPU; on the CPU, check that the launcher's
    arguments (shared with the Triton kernel) bind the kernel's signature exactly: each
    run-time argument once, in order, and every compile-time one by name."""
    from pagedserve.kernels import ops
    from pagedserve.kernels.decode_plan import DecodeConfig
    from pagedserve.kv.formats import KVBlockStorage

    arg_names = qf.fragment_decode_kernel.arg_names
    recorder = LaunchRecorder()
    seen = recorder.seen
    monkeypatch.setattr(qf, "fragment_decode_kernel", recorder)
    monkeypatch.setattr(qf, "supports", lambda q, ck, cv, cfg: True)
    dev = TRITON_DEVICE
    ck, cv = KVBlockStorage.allocate_pair("q4_0", "q4_0", 8, 16, 2, 256, dev)
    q = torch.zeros(3, 12, 256, dtype=torch.float16, device=dev)
    table = torch.zeros(3, 2, dtype=torch.int32, device=dev)
    lens = torch.tensor([5, 0, 20], dtype=torch.int32, device=dev)
    ops.paged_decode_attention(q, ck, cv, table, lens, 0.0625, backend="triton",
                               config=DecodeConfig(block_n=128, num_warps=4,
                                                   min_partition=128, quant_dot="fragment"))
    n = assert_binds_signature(seen, arg_names, 0.0625)
    assert seen["args"][0] is q
    # Untraced, the trace pointer is a placeholder (the output) and TRACE is off.
    out = seen["args"][1]
    assert seen["args"][n - 1] is out and seen["kwargs"]["TRACE"] is False

    # A trace buffer binds the last run-time argument and compiles the traced variant;
    # one of the wrong shape is refused before launch, naming the shape it needs.
    from pagedserve.kernels import paged_decode
    from pagedserve.kernels.decode_plan import DecodeWorkspace
    ws = DecodeWorkspace(3, 12, 2, 256, dev, chunks_per_head=5)
    cfg = DecodeConfig(block_n=128, num_warps=4, min_partition=128, quant_dot="fragment")
    trace = torch.zeros(math.prod(paged_decode.decode_grid(ws, 3, cfg)), 8, dtype=torch.int64,
                        device=dev)
    assert trace.shape[0] == 10  # max(W = 5, B = 3) chunks x 2 K/V heads
    paged_decode.paged_decode_attention(q, ck, cv, table, lens, 0.0625, workspace=ws,
                                        config=cfg, trace=trace)
    assert seen["args"][n - 1] is trace and seen["kwargs"]["TRACE"] is True
    with pytest.raises(ValueError, match=r"int64 \[10, 8\]"):
        paged_decode.paged_decode_attention(q, ck, cv, table, lens, 0.0625, workspace=ws,
                                            config=cfg, trace=trace[:9])
    # The Triton kernel's traced variant needs a GPU (its own GPU test); on the CPU the
    # request is refused by name instead of failing inside the interpreter.
    if dev == "cpu":
        with pytest.raises(ValueError, match="trace= needs a GPU"):
            paged_decode.paged_decode_attention(
                q, ck, cv, table, lens, 0.0625, workspace=ws,
                config=dataclasses.replace(cfg, quant_dot="packed"), trace=trace)
    assert seen["grid"][1] == 2 and seen["kwargs"]["G"] == 6 and seen["kwargs"]["PAGED"]
    assert seen["kwargs"]["INTERLEAVE"] == 2  # K and V side by side
