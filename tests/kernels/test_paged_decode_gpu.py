"""The decode grid at real sizes on a GPU, and CUDA-graph capture and replay.

Same float64 oracle and bounds as ``test_paged_decode.py`` (``kernel_oracle.BOUNDS``).
Pools are in the library's layout (``build_pool``: K and V of one type side by side);
``test_separate_storages_of_one_type`` covers K and V of one type in their own buffers.
Skipped without CUDA.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from kernel_oracle import bound, build_pool, decode_oracle, needs_cuda, q_dtype_for, rel_error

from pagedserve.kernels import ops
from pagedserve.kernels.decode_plan import DecodeConfig, DecodeWorkspace

pytestmark = [pytest.mark.gpu, needs_cuda]

TYPES = ["f16", "q8_0", "q4_0"]
COMBOS = [*itertools.product(TYPES, TYPES), ("bf16", "bf16"), ("bf16", "q4_0")]
EDGE_LENS = [0, 1, 15, 16, 17, 31, 32, 33, 1000, 4097, 20000]


# The Gluon kernels (the library's defaults): for q4_0 or q8_0 K and V
# (kernels/quant_fragments.py) 32 tokens per warp for q4_0, 16 for q8_0, a shared-memory
# ring of two stages (fewer stages run the Triton kernel); for f16 K and V
# (kernels/float_fragments.py) 16 tokens per warp and a ring of two stages.
FRAGMENT = DecodeConfig(block_n=128, num_warps=4, num_stages=2, min_partition=128,
                        quant_dot="fragment")
FRAGMENT_Q8 = DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_partition=128,
                           quant_dot="fragment")
FRAGMENT_F16 = DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_partition=128,
                            quant_dot="fragment", table_read="block")
# q8_0 and q4_0 for small short batches (``decode_plan.default_config``): 8 warps, one
# program per SM.
WIDE_Q8 = DecodeConfig(block_n=128, num_warps=8, num_stages=2, min_partition=128,
                       quant_dot="fragment", table_read="block", occupancy=1.0)
WIDE_Q4 = DecodeConfig(block_n=256, num_warps=8, num_stages=2, min_partition=256,
                       quant_dot="fragment", table_read="block", occupancy=1.0)
FRAGMENT_CONFIGS = {"q4_0": FRAGMENT, "q8_0": FRAGMENT_Q8, "f16": FRAGMENT_F16}
FRAGMENT_TYPES = list(FRAGMENT_CONFIGS)
# The Triton kernel's paged f16 launch (``decode_plan.triton_float_config``).
TRITON_F16 = DecodeConfig(block_n=64, num_warps=4, num_stages=3, min_partition=128,
                          table_read="block")


def check(k_type, v_type, lens, *, hkv=4, group=6, d=256, config=None, ws_kwargs=None,
          block_size=16, seed=0, paired=True):
    ck, cv, table, tables = build_pool(k_type, v_type, lens, num_kv_heads=hkv, head_dim=d,
                                       block_size=block_size, seed=seed, device="cuda",
                                       paired=paired)
    q = torch.randn(len(lens), hkv * group, d, generator=torch.Generator().manual_seed(seed))
    q = q.to(q_dtype_for(k_type, v_type))
    ws = DecodeWorkspace(len(lens), hkv * group, hkv, d, "cuda", **(ws_kwargs or {}))
    ws.part_acc.fill_(float("nan"))
    out = torch.full_like(q, float("nan"), device="cuda")
    ops.paged_decode_attention(q.cuda(), ck, cv, table,
                               torch.tensor(lens, dtype=torch.int32, device="cuda"),
                               d**-0.5, workspace=ws, out=out, config=config, validate=True)
    torch.cuda.synchronize()
    ref = decode_oracle(q, ck, cv, tables, lens, d**-0.5)
    err = rel_error(out, ref)
    assert err <= bound(k_type, v_type), f"error {err:.2e}"
    assert ws.counters_clear()
    return out


@pytest.mark.parametrize("k_type,v_type", COMBOS)
def test_qwen_shape_all_type_pairs(k_type, v_type):
    check(k_type, v_type, EDGE_LENS)


@pytest.mark.parametrize("hkv,group,d", [(8, 1, 64), (4, 2, 128), (2, 8, 128), (1, 6, 64)])
@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q4_0", "q4_0"), ("q8_0", "f16")])
def test_gqa_and_head_dims(hkv, group, d, k_type, v_type):
    check(k_type, v_type, [3, 700, 5000], hkv=hkv, group=group, d=d)


@pytest.mark.parametrize("mode", ["element", "packed"])
@pytest.mark.parametrize("k_type,v_type", [("q4_0", "q4_0"), ("q8_0", "q4_0"), ("q4_0", "q8_0"),
                                           ("q8_0", "f16")])
def test_quant_dot_modes(mode, k_type, v_type):
    check(k_type, v_type, EDGE_LENS, config=DecodeConfig(block_n=64, quant_dot=mode))


@pytest.mark.parametrize("d", [64, 128])
def test_packed_mode_head_dims(d):
    check("q4_0", "q8_0", [3, 700, 5000], hkv=2, group=8, d=d,
          config=DecodeConfig(block_n=64, quant_dot="packed"))


@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q4_0", "q4_0")])
def test_forced_many_partitions(k_type, v_type):
    # 64-token chunks: the 20000-token sequence merges 313 partials.
    check(k_type, v_type, EDGE_LENS, config=DecodeConfig(block_n=64, min_partition=64),
          ws_kwargs=dict(chunks_per_head=1024))


@pytest.mark.parametrize("config", [
    DecodeConfig(block_n=32, num_warps=4, num_stages=1),
    DecodeConfig(block_n=128, num_warps=8, num_stages=2, min_partition=512),
], ids=["bn32-w4-s1", "bn128-w8-s2"])
def test_tile_configs(config):
    check("q4_0", "f16", [17, 9000, 33], config=config)


def test_ragged_many_sequences():
    """More sequences than the chunk budget can split: most get one chunk, one long one
    many; the batch is wider than the plan's default vectors."""
    lens = [int(x) for x in torch.randint(0, 2000, (40,), generator=torch.Generator()
                                          .manual_seed(5))]
    lens[7] = 30000
    lens[8] = 0
    check("q4_0", "q8_0", lens)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_f16_default_runs_the_gluon_ring(monkeypatch, paged):
    """The library's f16 launch runs ``float_fragments`` on a GPU, not a fallback, in
    both layouts (the exactness tests above would pass on the fallback too)."""
    from pagedserve.kernels import float_fragments

    layouts = []
    launch = float_fragments.launch
    monkeypatch.setattr(float_fragments, "launch", lambda grid, args, constants, *rest: (
        layouts.append(constants["PAGED"]), launch(grid, args, constants, *rest)))
    lens = [5000, 17, 0]
    if paged:
        check("f16", "f16", lens)
    else:
        check_contiguous("f16", "f16", lens, [2, 0, 1])
    assert layouts == [paged]


@pytest.mark.parametrize("kv_type,lens", [
    ("q8_0", [4096, 16]), ("q8_0", [32768, 2048, 33, 0]), ("q4_0", [4096, 16]),
    ("q4_0", [8192, 2048, 33, 0])], ids=["q8_0-two", "q8_0-ragged-four", "q4_0-two",
                                         "q4_0-ragged-four"])
def test_small_batches_take_the_wide_launch(monkeypatch, kv_type, lens):
    """At most four q8_0 (q4_0) sequences over at most 128K (32K) table tokens: the
    library's launch runs the Gluon kernel with 8 warps, its plan at one program per SM
    over a workspace sized for two, exactly."""
    from pagedserve.kernels import quant_fragments

    warps = []
    launch = quant_fragments.launch
    monkeypatch.setattr(quant_fragments, "launch", lambda grid, args, constants, kv_type,
                        num_warps, *rest: (warps.append((grid[0], num_warps)),
                                           launch(grid, args, constants, kv_type, num_warps,
                                                  *rest)))
    check(kv_type, kv_type, lens)
    # 132 SMs / 4 K/V heads at one program per SM (the H200); the workspace holds 66.
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert warps == [(max(math.ceil(sms / 4), len(lens)), 8)]


def check_contiguous(k_type, v_type, lens, order, config=None, paired=True):
    """The contiguous layout (one block per sequence, padded to the longest), the pool's
    blocks assigned to the sequences in ``order``, against the oracle."""
    pad = max(lens)
    ck, cv, _, _ = build_pool(k_type, v_type, [pad] * len(lens), num_kv_heads=4,
                              head_dim=256, block_size=pad, extra_blocks=0, device="cuda",
                              paired=paired)
    table = torch.tensor([[i] for i in order], dtype=torch.int32)
    q = torch.randn(len(lens), 24, 256).half()
    out = ops.paged_decode_attention(q.cuda(), ck, cv, table.cuda(),
                                     torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     0.0625, config=config)
    torch.cuda.synchronize()
    ref = decode_oracle(q, ck, cv, table.tolist(), lens, 0.0625)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@pytest.mark.parametrize("k_type,v_type,config", [
    ("f16", "f16", None), ("f16", "f16", TRITON_F16), ("q4_0", "q4_0", None),
    ("q4_0", "q4_0", FRAGMENT), ("q8_0", "q8_0", FRAGMENT_Q8),
    ("f16", "f16", dataclasses.replace(FRAGMENT_F16, num_stages=3)), ("q8_0", "q8_0", None),
], ids=["f16", "triton-f16", "q4_0", "fragment-q4_0", "fragment-q8_0", "fragment-f16-s3",
        "q8_0-four"])
def test_contiguous_layout(k_type, v_type, config):
    check_contiguous(k_type, v_type, [4096, 1, 0, 2500], [3, 1, 0, 2], config)


@pytest.mark.parametrize("kv_type", FRAGMENT_TYPES)
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_separate_storages_of_one_type(kv_type, paged):
    """The library's launches over K and V of one type in their own buffers
    (``interleave`` 1; every other same-type case here has them side by side)."""
    if paged:
        check(kv_type, kv_type, EDGE_LENS, config=FRAGMENT_CONFIGS[kv_type], paired=False)
    else:
        check_contiguous(kv_type, kv_type, [4096, 1, 0, 2500], [3, 1, 0, 2], paired=False)


@pytest.mark.parametrize("k_type,v_type", [("q4_0", "q8_0"), ("q8_0", "q8_0")])
def test_write_then_read_on_gpu(k_type, v_type):
    """Triton kv_write into a shuffled pool, then Triton decode, against the oracle (K and
    V as the engine allocates them: side by side when their types match)."""
    from pagedserve.kv.formats import KVBlockStorage

    lens, bs = [300, 17], 16
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(2))[:21].tolist()
    tables = [ids[:19], ids[19:]]  # 19 and 2 blocks, scattered over the pool
    ck, cv = KVBlockStorage.allocate_pair(k_type, v_type, 40, bs, 4, 256, device="cuda")
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = torch.tensor(tables[b])[pos // bs] * bs + pos % bs
        ops.kv_write(ck, torch.randn(n, 4, 256, device="cuda"), slots.cuda())
        ops.kv_write(cv, torch.randn(n, 4, 256, device="cuda"), slots.cuda())
    table = torch.full((2, 19), -1, dtype=torch.int32)
    for b, t in enumerate(tables):
        table[b, :len(t)] = torch.tensor(t)
    q = torch.randn(2, 24, 256).bfloat16()
    out = ops.paged_decode_attention(q.cuda(), ck, cv, table.cuda(),
                                     torch.tensor(lens, dtype=torch.int32, device="cuda"), 0.0625)
    torch.cuda.synchronize()
    assert rel_error(out, decode_oracle(q, ck, cv, tables, lens, 0.0625)) <= 1e-2


def test_cuda_graph_capture_and_replay():
    """Capture once; replay with other lengths and other table contents: exact each time."""
    B, hkv, group, d = 8, 4, 6, 256
    cap_lens = [8192] + [512] * 7
    ck, cv, table, tables = build_pool("q4_0", "q4_0", cap_lens, num_kv_heads=hkv,
                                       head_dim=d, device="cuda")
    q = torch.randn(B, hkv * group, d).bfloat16().cuda()
    seq_lens = torch.tensor(cap_lens, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)
    ws = DecodeWorkspace(B, hkv * group, hkv, d, "cuda")
    run = lambda: ops.paged_decode_attention(q, ck, cv, table, seq_lens, d**-0.5,  # noqa: E731
                                             workspace=ws, out=out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()  # compile and warm up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    gen = torch.Generator().manual_seed(11)
    for _ in range(2):
        order = torch.randperm(B, generator=gen)  # other sequences' tables, same pool
        table.copy_(table[order.cuda()])
        tables = [tables[i] for i in order.tolist()]
        caps = [len(t) * 16 for t in tables]
        lens = [int(torch.randint(0, cap + 1, (1,), generator=gen)) for cap in caps]
        lens[caps.index(max(caps))] = max(caps)
        lens[(caps.index(max(caps)) + 1) % B] = 0
        seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        q.copy_(torch.randn(B, hkv * group, d, generator=gen).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = decode_oracle(q.cpu(), ck, cv, tables, lens, d**-0.5)
        # The queries are bf16 (the model's dtype), so the bf16 bound applies: the kernel's
        # dots run on bf16 operands (measured on the H200: 2.3e-3 against 2e-3 for f16).
        assert rel_error(out, ref) <= bound("bf16", "q4_0")
        assert ws.counters_clear()


@pytest.mark.parametrize("kv_type", FRAGMENT_TYPES)
@pytest.mark.parametrize("hkv,group", [(4, 6), (8, 1), (4, 2), (2, 8)])
def test_fragment_kernel_gqa(hkv, group, kv_type):
    check(kv_type, kv_type, EDGE_LENS, hkv=hkv, group=group, config=FRAGMENT_CONFIGS[kv_type])


@pytest.mark.parametrize("kv_type,config", [
    ("q4_0", FRAGMENT),
    ("q4_0", dataclasses.replace(FRAGMENT, num_stages=3)),
    ("q4_0", DecodeConfig(block_n=64, num_warps=2, num_stages=2, min_partition=64,
                          quant_dot="fragment")),
    # The wide launches without their own budget, so that the forced one splits.
    ("q4_0", dataclasses.replace(WIDE_Q4, occupancy=None)),
    ("q4_0", DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_partition=64,
                          quant_dot="fragment")),
    ("q8_0", FRAGMENT_Q8),
    ("q8_0", DecodeConfig(block_n=32, num_warps=2, num_stages=3, min_partition=64,
                          quant_dot="fragment")),
    ("q8_0", dataclasses.replace(WIDE_Q8, occupancy=None)),
    ("f16", FRAGMENT_F16),
    ("f16", dataclasses.replace(FRAGMENT_F16, num_stages=3)),
    ("f16", DecodeConfig(block_n=32, num_warps=2, num_stages=4, min_partition=64,
                         quant_dot="fragment")),
    ("f16", DecodeConfig(block_n=128, num_warps=8, num_stages=1, min_partition=128,
                         quant_dot="fragment")),
], ids=["q4-w4", "q4-w4-s3", "q4-w2", "q4-w8", "q4-w4-t16", "q8-w4", "q8-w2-s3", "q8-w8",
        "f16-w4-s2", "f16-w4-s3", "f16-w2-s4", "f16-w8-s1"])
def test_fragment_kernel_many_partitions(kv_type, config):
    check(kv_type, kv_type, EDGE_LENS, config=config, ws_kwargs=dict(chunks_per_head=1024))


@pytest.mark.parametrize("kv_type,table_ahead", [
    *itertools.product(FRAGMENT_TYPES, [True, False])],
    ids=lambda v: {True: "ahead", False: "just-in-time"}.get(v, v))
@pytest.mark.parametrize("block_size", [8, 16, 32, 64, 48])
def test_fragment_kernel_block_sizes(block_size, table_ahead, kv_type):
    """Rows from two block ids per warp (16 with 32 tokens per warp: a warp's tokens span
    two blocks; 32, 64: one, at an offset in it), and from one id per row (8, 48: not a
    power of 2 >= 16; the f16 ring then falls back to the Triton kernel), with many
    partitions so that chunks start mid-block. (The rings read ids ahead either way,
    the q4_0 / q8_0 one through its copies.)"""
    cfg = dataclasses.replace(FRAGMENT_CONFIGS[kv_type], table_ahead=table_ahead)
    check(kv_type, kv_type, EDGE_LENS, config=cfg, block_size=block_size,
          ws_kwargs=dict(chunks_per_head=64))


@pytest.mark.parametrize("kv_type", FRAGMENT_TYPES)
def test_fragment_kernel_ragged_and_bf16_queries(kv_type):
    lens = [131072] + [8192] * 7
    ck, cv, table, tables = build_pool(kv_type, kv_type, lens, num_kv_heads=4, head_dim=256,
                                       device="cuda")
    q = torch.randn(8, 24, 256, generator=torch.Generator().manual_seed(3)).bfloat16()
    out = ops.paged_decode_attention(q.cuda(), ck, cv, table,
                                     torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     0.0625, config=FRAGMENT_CONFIGS[kv_type])
    torch.cuda.synchronize()
    assert rel_error(out, decode_oracle(q, ck, cv, tables, lens, 0.0625)) <= bound("bf16", kv_type)


@pytest.mark.parametrize("k_type,v_type,config", [
    ("f16", "f16", TRITON_F16),  # the Triton kernel's paged f16 launch (masked loads)
    ("f16", "f16", DecodeConfig(block_n=128, num_stages=2, min_partition=128)),
    ("q4_0", "q8_0", DecodeConfig(block_n=64, quant_dot="packed", table_read="block")),
], ids=["f16-default", "f16-row", "packed-clamped"])
def test_triton_kernel_masks_invalid_block_ids(k_type, v_type, config):
    """Ids far outside the pool (a 2**30 block would lie terabytes away) read nothing on
    the GPU either: masked loads, or the packed tiles' clamp to row 0. Wide tables so
    that the default f16 launch is the 8K+ one."""
    lens = [3000, 700]
    ck, cv, table, tables = build_pool(k_type, v_type, lens, num_kv_heads=4, head_dim=256,
                                       device="cuda", table_cols=512)
    bad = table.clone()
    bad[0, 3] = 2**30  # tokens 48..63 of sequence 0
    bad[1, 1] = -7  # tokens 16..31 of sequence 1
    q = torch.randn(2, 24, 256).to(q_dtype_for(k_type, v_type))
    out = ops.paged_decode_attention(q.cuda(), ck, cv, bad,
                                     torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     0.0625, config=config, validate=False)
    torch.cuda.synchronize()
    for b, hole in ((0, range(48, 64)), (1, range(16, 32))):
        live = [[t not in hole for t in range(lens[b])]]
        ref = decode_oracle(q[b:b + 1], ck, cv, [tables[b]], [lens[b]], 0.0625, live=live)
        assert rel_error(out[b:b + 1], ref) <= bound(k_type, v_type)


@pytest.mark.parametrize("kv_type", FRAGMENT_TYPES)
def test_fragment_kernel_masks_invalid_block_ids(kv_type):
    """A table entry outside the pool reads nothing: its tokens drop out of the softmax
    exactly as if the sequence ended before them (validate=False, the hot path)."""
    lens = [100, 40]
    ck, cv, table, tables = build_pool(kv_type, kv_type, lens, num_kv_heads=4, head_dim=256,
                                       device="cuda")
    bad = table.clone()
    bad[0, 3] = ck.num_blocks + 5  # tokens 48..63 of sequence 0
    bad[1, 1] = -7  # tokens 16..31 of sequence 1
    q = torch.randn(2, 24, 256).half()
    out = ops.paged_decode_attention(q.cuda(), ck, cv, bad,
                                     torch.tensor(lens, dtype=torch.int32, device="cuda"),
                                     0.0625, config=FRAGMENT_CONFIGS[kv_type], validate=False)
    torch.cuda.synchronize()
    for b, hole in ((0, range(48, 64)), (1, range(16, 32))):
        live = [[t not in hole for t in range(lens[b])]]
        ref = decode_oracle(q[b:b + 1], ck, cv, [tables[b]], [lens[b]], 0.0625, live=live)
        assert rel_error(out[b:b + 1], ref) <= bound(kv_type, kv_type)


@pytest.mark.parametrize("kv_type", ["q4_0", "q8_0", "f16", "triton-f16"])
def test_kernel_trace_records(kv_type):
    """``trace=`` (benchmarks/tools/trace_decode.py; the Gluon kernels for q4_0, q8_0 and f16,
    the Triton kernel's f16 launch) changes the output by rounding at most (a separate
    compile; within one f16 ulp of the largest output), and each program's record agrees
    with the host mirror of the plan (the chunk it takes, reversed for the upper heads
    where the kernel says so): its tile count, the order of its six timestamps, an SM in
    range; programs beyond the plan record only their entry."""
    from pagedserve.kernels import float_fragments, paged_decode, quant_fragments
    from pagedserve.kernels.decode_plan import plan_chunks, program_chunk
    from pagedserve.kernels.decode_trace import TRACE_FIELDS

    lens, hkv, block_size = [3000, 0, 700, 129, 16], 4, 16
    cfg = FRAGMENT_CONFIGS.get(kv_type, TRITON_F16)
    kernel = {"q4_0": quant_fragments, "q8_0": quant_fragments, "f16": float_fragments}
    reversed_upper = kv_type in kernel and bool(kernel[kv_type].UPPER_HEADS_REVERSED)
    kv_type = kv_type.removeprefix("triton-")
    ck, cv, table, _ = build_pool(kv_type, kv_type, lens, num_kv_heads=hkv, head_dim=256,
                                  block_size=block_size, device="cuda")
    q = torch.randn(len(lens), 24, 256, generator=torch.Generator().manual_seed(5)).half().cuda()
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    ws = DecodeWorkspace(len(lens), 24, hkv, 256, "cuda", chunks_per_head=9)
    plain = ops.paged_decode_attention(q, ck, cv, table, seq_lens, 0.0625, workspace=ws,
                                       config=cfg)
    trace = torch.zeros(math.prod(paged_decode.decode_grid(ws, len(lens), cfg)), 8,
                        dtype=torch.int64, device="cuda")
    traced = paged_decode.paged_decode_attention(q, ck, cv, table, seq_lens, 0.0625,
                                                 workspace=ws, config=cfg, trace=trace)
    torch.cuda.synchronize()
    assert (plain.float() - traced.float()).abs().max() <= 2**-10 * plain.float().abs().max()
    assert ws.counters_clear()

    capacity = table.shape[1] * block_size
    _, chunks = plan_chunks(lens, capacity, 9, cfg.block_n, cfg.min_partition)
    per_head = trace.shape[0] // hkv
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    fields = {name: i for i, name in enumerate(TRACE_FIELDS)}
    stamps = [fields[n] for n in ("entry", "planned", "loop", "looped", "stored", "merged")]
    for h in range(hkv):
        for pid in range(per_head):
            rec = trace[h * per_head + pid].tolist()
            assert rec[fields["entry"]] > 0
            chunk = program_chunk(pid, h, hkv, len(chunks), reversed_upper)
            if chunk >= len(chunks):
                assert rec[1:] == [0] * 7, (h, pid, rec)
                continue
            _, lo, hi = chunks[chunk]
            assert rec[fields["tiles"]] == -(-(hi - lo) // cfg.block_n), (h, pid, rec)
            times = [rec[i] for i in stamps]
            assert times == sorted(times), (h, pid, rec)
            assert 0 <= rec[fields["sm"]] < num_sms
