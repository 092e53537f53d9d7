"""Paged decode attention against a float64 oracle: reference and Triton backends.

Error bounds (``kernel_oracle.BOUNDS``, max |out - oracle| / max |oracle|): 2e-3 when K
and V are f16, q8_0 or q4_0; 1e-2 when either is bf16. Outputs are poisoned with NaN
before every run, so an element a kernel forgets to write fails the test.

The Triton cases run on small shapes under ``TRITON_INTERPRET=1`` on the CPU, and on
CUDA when present; ``test_paged_decode_gpu.py`` holds the real-size GPU grid. Pools are in
the library's layout (``build_pool``'s ``paired``: K and V of one type side by side, of
different types in their own buffers); the ``separate`` cases put K and V of one type in
their own buffers too.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from gluon_checks import LaunchRecorder
from kernel_oracle import (
    TRITON_DEVICE,
    bound,
    build_pool,
    decode_oracle,
    needs_triton,
    q_dtype_for,
    rel_error,
)

from pagedserve.kernels import guards, ops
from pagedserve.kernels.decode_plan import (
    CONTIGUOUS_TILE_TOKENS,
    MERGE_GROUP,
    WIDE_MAX_BATCH,
    WIDE_MAX_TOKENS,
    DecodeConfig,
    DecodeWorkspace,
    default_config,
    device_num_sms,
    plan_chunks,
)
from pagedserve.kernels.paged_decode import MERGE_UNROLL
from pagedserve.kv.formats import KVBlockStorage

TYPES = ["f16", "q8_0", "q4_0"]
COMBOS = [*itertools.product(TYPES, TYPES), ("bf16", "bf16")]
# With a budget of 20 chunks per head, 16-token partitions: every sequence longer than 16
# tokens is split, and one of 150 tokens (10 chunks) merges in two levels.
SPLIT = DecodeConfig(block_n=16, min_partition=16)
BUDGET = 20
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]


def _backend_device(backend: str) -> str:
    """Where a backend's pools live: the Triton kernels' device, or the CPU."""
    return TRITON_DEVICE if backend == "triton" else "cpu"


def chunks_of(lens, budget=BUDGET):
    """Chunks per sequence under the forced-split plan (the tests' premise)."""
    _, chunks = plan_chunks(lens, 1 << 20, budget, 16, 16)
    return [sum(1 for c in chunks if c[0] == b) for b in range(len(lens))]


def run(k_type, v_type, lens, *, hkv=2, group=2, d=64, backend="triton", config=SPLIT,
        chunks_per_head=BUDGET, seed=0, validate=None, table_cols=None, block_size=16,
        paired=True):
    device = _backend_device(backend)
    ck, cv, table, tables = build_pool(k_type, v_type, lens, num_kv_heads=hkv, head_dim=d,
                                       seed=seed, device=device, table_cols=table_cols,
                                       block_size=block_size, paired=paired)
    assert ck.interleave == cv.interleave == (2 if paired and k_type == v_type else 1)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(len(lens), hkv * group, d, generator=gen).to(q_dtype_for(k_type, v_type))
    scale = d**-0.5
    ws = DecodeWorkspace(len(lens), hkv * group, hkv, d, device,
                         chunks_per_head=chunks_per_head)
    ws.part_acc.fill_(float("nan"))
    ws.part_ml.fill_(float("nan"))
    out = torch.full_like(q, float("nan")).to(device)
    ops.paged_decode_attention(
        q.to(device), ck, cv, table, torch.tensor(lens, dtype=torch.int32, device=device),
        scale, workspace=ws, out=out, config=config, backend=backend, validate=validate,
    )
    ref = decode_oracle(q, ck, cv, tables, lens, scale)
    assert ws.counters_clear(), "merge counters must be reset"
    return out, ref


@pytest.mark.parametrize("k_type,v_type", [*COMBOS, ("f32", "f32"), ("f32", "q4_0")])
def test_reference_matches_oracle(k_type, v_type):
    out, ref = run(k_type, v_type, [0, 1, 17, 40], backend="reference")
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
def test_triton_rejects_cpu_only_types():
    with pytest.raises(ValueError, match="Triton kernels do not take K/V type 'f32'"):
        run("f32", "f16", [5])


@needs_triton
@pytest.mark.parametrize("k_type,v_type", COMBOS)
def test_triton_all_type_pairs_split_and_merge(k_type, v_type):
    lens = [0, 1, 50, 150]
    # 0 and 1 take the direct path; 50 merges 4 partials; 150 merges 10 in two levels.
    assert chunks_of(lens) == [1, 1, 4, 10] and 10 > MERGE_GROUP
    out, ref = run(k_type, v_type, lens)
    assert rel_error(out, ref) <= bound(k_type, v_type)
    assert float(out[0].abs().max()) == 0.0  # zero length -> zeros


@needs_triton
@pytest.mark.parametrize("kv_type", TYPES)
def test_triton_separate_storages_of_one_type(kv_type):
    """K and V of one type in their own buffers (``interleave`` 1), as well as side by side
    (the library's layout, every other same-type case here): rows of one (block, head)
    one block apart, not two."""
    out, ref = run(kv_type, kv_type, [0, 1, 50, 150], paired=False)
    assert rel_error(out, ref) <= bound(kv_type, kv_type)


@needs_triton
@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q4_0", "q8_0")])
def test_triton_block_boundary_lengths(k_type, v_type):
    lens = [1, 15, 16, 17, 31, 32, 33]
    assert chunks_of(lens) == [1, 1, 1, 2, 2, 2, 3]
    out, ref = run(k_type, v_type, lens)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
@pytest.mark.parametrize("group", [1, 2, 6, 8])
def test_triton_gqa_ratios(group):
    out, ref = run("q4_0", "q8_0", [9, 40], hkv=1, group=group)
    assert rel_error(out, ref) <= bound("q4_0", "q8_0")


@needs_triton
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q8_0", "q4_0")])
def test_triton_head_dims(d, k_type, v_type):
    out, ref = run(k_type, v_type, [20, 37], hkv=1, group=6, d=d)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
@pytest.mark.parametrize("mode", ["element", "packed"])
@pytest.mark.parametrize("k_type,v_type", [("q4_0", "q8_0"), ("q8_0", "q4_0"), ("q4_0", "q4_0"),
                                           ("q8_0", "f16")])
def test_triton_quant_dot_modes(mode, k_type, v_type):
    # Split into 3 chunks of 16-row tiles, so partials are merged. On an H200 this case
    # (q8_0 K, packed q4_0 V) once gave outputs twice the oracle's with the joined
    # natural-order V tile; the half-tile V path replaced it (kv_tiles).
    cfg = DecodeConfig(block_n=16, min_partition=16, quant_dot=mode)
    out, ref = run(k_type, v_type, [3, 45], config=cfg)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
def test_triton_many_partials_merge_in_several_trips():
    # 300 tokens in 16-token chunks: 19 partials in 3 groups (8, 8, 3). The merge takes
    # MERGE_UNROLL partials per loop trip: full groups loop twice, the group of 3 and
    # the final merge of 3 groups end in a trip with masked slots.
    assert chunks_of([300, 2]) == [19, 1]
    assert MERGE_GROUP == 2 * MERGE_UNROLL
    out, ref = run("f16", "q4_0", [300, 2], d=128, group=6, hkv=1)
    assert rel_error(out, ref) <= bound("f16", "q4_0")


@needs_triton
@pytest.mark.parametrize("k_type,v_type,d", [("q4_0", "q4_0", 64), ("q4_0", "q4_0", 256),
                                             ("q8_0", "q8_0", 256), ("q8_0", "q4_0", 64),
                                             ("f16", "f16", 256), ("f16", "bf16", 64)])
def test_triton_fragment_mode_falls_back_off_gpu(k_type, v_type, d):
    """``fragment`` is a Gluon kernel for q4_0, q8_0 or f16 K and V at head_dim 256 on a
    GPU; the interpreter (and other types or shapes) run the Triton kernel (the packed
    path for quantized types), still exact."""
    cfg = DecodeConfig(block_n=32, num_warps=1, min_partition=32, quant_dot="fragment")
    out, ref = run(k_type, v_type, [3, 45, 70], d=d, group=3, config=cfg)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
@pytest.mark.parametrize("kv_type", ["q4_0", "q8_0"])
def test_triton_default_config(kv_type):
    out, ref = run(kv_type, kv_type, [70, 5], config=None, chunks_per_head=None)
    assert rel_error(out, ref) <= bound(kv_type, kv_type)


@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("bf16", "f16"), ("q8_0", "f16"),
                                           ("q4_0", "q4_0")])
def test_default_config_by_layout_and_size(k_type, v_type):
    """f16 K and V: the Gluon ring (``fragment``, 64-row tiles, two stages) for both
    layouts at every size. Other float K and V, the Triton launches
    (``triton_float_config``): paged takes 64-row tiles in three stages with one table
    load per block at every size; contiguous takes 64-row tiles (one table load per row:
    it has one block) below CONTIGUOUS_TILE_TOKENS and 128-row tiles in two stages from
    there. Quantized types keep one launch for every case."""
    def tiles(tokens, paged):
        c = default_config(k_type, v_type, tokens, paged=paged)
        return c.block_n, c.num_stages, c.table_read

    sizes = (0, 1, CONTIGUOUS_TILE_TOKENS - 1, CONTIGUOUS_TILE_TOKENS)
    cases = [(n, paged) for n in sizes for paged in (True, False)]
    if "q" in k_type + v_type:
        assert len({tiles(n, paged) for n, paged in cases}) == 1
        return
    if k_type == v_type == "f16":
        assert {default_config(k_type, v_type, n, paged=p) for n, p in cases} == {
            DecodeConfig(block_n=64, num_warps=4, num_stages=2, min_partition=128,
                         quant_dot="fragment", table_read="block")}
        return
    assert [tiles(n, True) for n in sizes] == [(64, 3, "block")] * 4
    assert [tiles(n, False) for n in sizes] == [(64, 3, "row")] * 3 + [(128, 2, "row")]


def test_small_short_quantized_batches_take_wide_programs():
    """q8_0 or q4_0 K and V with at most WIDE_MAX_BATCH sequences whose tables address at
    most WIDE_MAX_TOKENS of the type: 8 warps at one program per SM (``occupancy=1``;
    q8_0 16 tokens per warp, q4_0 32), on both layouts; more sequences or tokens, or a
    batch not given, keep 4 warps at the workspace's budget. Other pairs do not look at
    the batch."""
    def shape(kv_type, batch, tokens, paged=True):
        c = default_config(kv_type, kv_type, tokens, paged=paged, batch=batch)
        return c.block_n, c.num_warps, c.num_stages, c.quant_dot, c.occupancy

    for kv_type, wide, narrow in [
        ("q8_0", (128, 8, 2, "fragment", 1.0), (64, 4, 2, "fragment", None)),
        ("q4_0", (256, 8, 2, "fragment", 1.0), (128, 4, 2, "fragment", None)),
    ]:
        most = WIDE_MAX_TOKENS[kv_type]
        for paged in (True, False):
            assert [shape(kv_type, b, n, paged) for b in range(1, WIDE_MAX_BATCH + 1)
                    for n in (4096 * b, most)] == [wide] * 2 * WIDE_MAX_BATCH
            assert [shape(kv_type, b, n, paged)
                    for b, n in [(0, 4096), (WIDE_MAX_BATCH + 1, 20480), (8, 32768),
                                 (64, 1 << 20), (1, most + 16), (4, most + 16)]] == (
                [narrow] * 6)
    assert WIDE_MAX_TOKENS == {"q8_0": 131072, "q4_0": 32768}
    for k_type, v_type in [("f16", "f16"), ("q8_0", "f16"), ("q8_0", "q4_0"),
                           ("q4_0", "q8_0"), ("bf16", "bf16")]:
        assert default_config(k_type, v_type, 4096, batch=1) == default_config(
            k_type, v_type, 4096)


@needs_triton
@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0", "f16"])
def test_launch_budget_below_the_workspace_is_exact(monkeypatch, kv_type):
    """A config whose ``occupancy`` plans fewer chunks than the workspace's budget (the
    wide launches' premise; here one per 2 SMs per head, 2 against 4 on the interpreter's 4
    SMs, 66 against 132 on an H200's 132): the Triton kernel runs that plan, exact
    against the oracle, every merge counter reset."""
    from pagedserve.kernels import paged_decode

    recorder = LaunchRecorder(paged_decode._paged_decode_kernel)
    monkeypatch.setattr(paged_decode, "_paged_decode_kernel", recorder)
    cfg = DecodeConfig(block_n=16, min_partition=16, occupancy=1.0)
    out, ref = run(kv_type, kv_type, [150], config=cfg, chunks_per_head=None)
    assert rel_error(out, ref) <= bound(kv_type, kv_type)
    # W = ceil(1 x SMs / 2 heads) by 2 K/V heads.
    num_sms = device_num_sms(torch.device(TRITON_DEVICE))
    assert recorder.seen["grid"] == (math.ceil(num_sms / 2), 2)


@needs_triton
@pytest.mark.parametrize("lens,cols", [([150, 33], 16), ([150], 1)])
def test_triton_default_config_by_size(lens, cols):
    """f16 with the library's launch runs exactly off the GPU, where the Gluon ring has
    no interpreter: the Triton launch of ``triton_float_config`` for each layout, paged
    (64-row tiles, one table load per block) and contiguous (one column: 64-row tiles)."""
    block_size = 16 if cols > 1 else 160
    out, ref = run("f16", "f16", lens, config=None, chunks_per_head=None, table_cols=cols,
                   block_size=block_size)
    assert rel_error(out, ref) <= bound("f16", "f16")


@needs_triton
def test_triton_all_zero_lengths():
    out, ref = run("q8_0", "f16", [0, 0, 0])
    assert float(out.abs().max()) == 0.0 and not bool(out.isnan().any())


@needs_triton
@pytest.mark.parametrize("paired", [True, False], ids=["paired", "separate"])
@pytest.mark.parametrize("k_type,v_type", [("f16", "f16"), ("q4_0", "q4_0")])
def test_triton_contiguous_layout(k_type, v_type, paired):
    """One block per sequence of the padded length: the PAGED=False tile path, K and V
    side by side (a sequence's K and V rows, 64 each, adjacent) or in their own buffers."""
    lens = [0, 5, 64, 40]
    ck, cv, _, _ = build_pool(k_type, v_type, [64] * 4, num_kv_heads=2, head_dim=64,
                              block_size=64, extra_blocks=0, device=TRITON_DEVICE,
                              paired=paired)
    assert ck.interleave == (2 if paired else 1)
    table = torch.tensor([[2], [0], [3], [1]], dtype=torch.int32)
    tables = table.tolist()
    q = torch.randn(4, 12, 64).to(q_dtype_for(k_type, v_type))
    ws = DecodeWorkspace(4, 12, 2, 64, TRITON_DEVICE, chunks_per_head=BUDGET)
    out = torch.full_like(q, float("nan")).to(TRITON_DEVICE)
    ops.paged_decode_attention(
        q.to(TRITON_DEVICE), ck, cv, table.to(TRITON_DEVICE),
        torch.tensor(lens, dtype=torch.int32, device=TRITON_DEVICE), 0.125,
        workspace=ws, out=out, config=SPLIT, backend="triton",
    )
    ref = decode_oracle(q, ck, cv, tables, lens, 0.125)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
@pytest.mark.parametrize("table_ahead", [True, False])
@pytest.mark.parametrize("k_type,v_type", [("q8_0", "q8_0"), ("f16", "q4_0"), ("q4_0", "f16")])
def test_triton_per_block_table_read(k_type, v_type, table_ahead):
    # 64-row tiles over 16-token blocks: one table load per block, broadcast to 16 rows,
    # loaded one tile ahead or at the tile itself. Lengths end inside blocks and inside
    # tiles; 150 tokens split into 3 chunks.
    cfg = DecodeConfig(block_n=64, min_partition=64, table_read="block", table_ahead=table_ahead)
    lens = [1, 17, 33, 150, 0, 64]
    out, ref = run(k_type, v_type, lens, config=cfg, chunks_per_head=8)
    assert rel_error(out, ref) <= bound(k_type, v_type)
    assert float(out[4].abs().max()) == 0.0


@needs_triton
@pytest.mark.parametrize("block_size,block_n", [(8, 32), (32, 16)])
def test_triton_per_block_table_read_other_block_sizes(block_size, block_n):
    # 8-token blocks under 32-row tiles: four table loads per tile. 32-token blocks under
    # 16-row tiles: a block spans two tiles, so the launch falls back to a load per row.
    cfg = DecodeConfig(block_n=block_n, min_partition=block_n, table_read="block")
    lens = [5, 40, 97]
    out, ref = run("q8_0", "q4_0", lens, config=cfg, chunks_per_head=6,
                   block_size=block_size)
    assert rel_error(out, ref) <= bound("q8_0", "q4_0")


@needs_triton
@pytest.mark.parametrize("table_read,table_ahead", [("row", True), ("block", True),
                                                    ("row", False), ("block", False)])
@pytest.mark.parametrize("k_type,v_type,mode", [("q4_0", "f16", "element"),
                                                ("f16", "f16", "element"),
                                                ("q4_0", "q8_0", "packed")])
def test_triton_masks_invalid_block_ids_without_validate(monkeypatch, table_read,
                                                         table_ahead, k_type, v_type, mode):
    """Garbage ids inside a sequence are skipped, never read; the rest is exact. Masked
    loads (float and ``element`` tiles) and the packed tiles' clamp to row 0 alike."""
    monkeypatch.delenv("PAGEDSERVE_VALIDATE", raising=False)
    lens = [48, 20]
    ck, cv, table, tables = build_pool(k_type, v_type, lens, num_kv_heads=2, head_dim=64,
                                       device=TRITON_DEVICE)
    table[0, 1] = 10**6
    table[1, 0] = -3
    q = torch.randn(2, 4, 64).half()
    ws = DecodeWorkspace(2, 4, 2, 64, TRITON_DEVICE, chunks_per_head=BUDGET)
    out = torch.full_like(q, float("nan")).to(TRITON_DEVICE)
    cfg = DecodeConfig(block_n=32, min_partition=32, table_read=table_read,
                       table_ahead=table_ahead, quant_dot=mode)
    ops.paged_decode_attention(q.to(TRITON_DEVICE), ck, cv, table,
                               torch.tensor(lens, dtype=torch.int32, device=TRITON_DEVICE),
                               0.125, workspace=ws, out=out, config=cfg, backend="triton")
    live = [[p // 16 != 1 for p in range(48)], [p >= 16 for p in range(20)]]
    ref = decode_oracle(q, ck, cv, tables, lens, 0.125, live=live)
    assert rel_error(out, ref) <= bound(k_type, v_type)


@needs_triton
def test_triton_clamps_lengths_beyond_the_table(monkeypatch):
    monkeypatch.delenv("PAGEDSERVE_VALIDATE", raising=False)
    ck, cv, table, tables = build_pool("f16", "q8_0", [32], num_kv_heads=1, head_dim=64,
                                       device=TRITON_DEVICE)
    q = torch.randn(1, 2, 64).half()
    out = torch.full_like(q, float("nan")).to(TRITON_DEVICE)
    ws = DecodeWorkspace(1, 2, 1, 64, TRITON_DEVICE, chunks_per_head=BUDGET)
    ops.paged_decode_attention(q.to(TRITON_DEVICE), ck, cv, table,
                               torch.tensor([10**6], dtype=torch.int32, device=TRITON_DEVICE),
                               0.125, workspace=ws, out=out, config=SPLIT, backend="triton")
    ref = decode_oracle(q, ck, cv, tables, [32], 0.125)
    assert rel_error(out, ref) <= bound("f16", "q8_0")


@needs_triton
def test_triton_workspace_reuse_with_new_lengths():
    """A second call on the same workspace (as a CUDA-graph replay would) is exact too."""
    lens_a, lens_b = [70, 3], [5, 66]
    ck, cv, table, tables = build_pool("q8_0", "q8_0", [80, 80], num_kv_heads=1,
                                       head_dim=64, device=TRITON_DEVICE)
    q = torch.randn(2, 2, 64).half()
    ws = DecodeWorkspace(2, 2, 1, 64, TRITON_DEVICE, chunks_per_head=BUDGET)
    for lens in (lens_a, lens_b):
        out = torch.full_like(q, float("nan")).to(TRITON_DEVICE)
        ops.paged_decode_attention(
            q.to(TRITON_DEVICE), ck, cv, table,
            torch.tensor(lens, dtype=torch.int32, device=TRITON_DEVICE), 0.125,
            workspace=ws, out=out, config=SPLIT, backend="triton")
        assert rel_error(out, decode_oracle(q, ck, cv, tables, lens, 0.125)) <= 2e-3


# ---- bounds guard -----------------------------------------------------------------------


def guarded_call(backend, mutate, validate=True):
    device = _backend_device(backend)
    lens = [20, 40]
    ck, cv, table, _ = build_pool("q4_0", "q4_0", lens, num_kv_heads=2, head_dim=64,
                                  device=device, table_cols=4)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 64, dtype=torch.float16, device=device)
    mutate(table, seq_lens)
    return ops.paged_decode_attention(q, ck, cv, table, seq_lens, 0.125, backend=backend,
                                      validate=validate)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mutate,message", [
    (lambda t, s: t.__setitem__((1, 2), 8), r"block_tables\[1, 2\] = 8 is outside the pool "
                                            r"of 8 blocks \(sequence 1 has 40 tokens in 3"),
    (lambda t, s: t.__setitem__((0, 0), -1), r"block_tables\[0, 0\] = -1 is outside"),
    (lambda t, s: s.__setitem__(1, 65), r"seq_lens\[1\] = 65 is outside \[0, 64\]: the table "
                                        r"holds 4 blocks of 16 tokens"),
    (lambda t, s: s.__setitem__(0, -2), r"seq_lens\[0\] = -2 is outside"),
], ids=["id-past-pool", "id-negative", "len-past-table", "len-negative"])
def test_validate_rejects_bad_metadata(backend, mutate, message):
    with pytest.raises(ValueError, match=message):
        guarded_call(backend, mutate)


def test_validate_env_var_turns_the_check_on(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_VALIDATE", "1")
    with pytest.raises(ValueError, match="outside the pool"):
        guarded_call("reference", lambda t, s: t.__setitem__((1, 1), 99), validate=None)


def test_entries_past_the_last_block_are_not_checked():
    guarded_call("reference", lambda t, s: t.__setitem__((0, 3), 12345))


@pytest.mark.parametrize("change,message", [
    (dict(table_dtype=torch.int64), "block_tables must be int32"),
    (dict(lens_dtype=torch.int64), "seq_lens must be contiguous int32"),
    (dict(hq=6), r"Hq \(6\) must be a multiple of Hkv \(4\)"),
    (dict(d=128), "cache_k.head_dim 64 != q head_dim 128"),
])
def test_hot_path_checks_name_the_problem(change, message):
    ck, cv, table, _ = build_pool("f16", "f16", [8], num_kv_heads=4, head_dim=64)
    table = table.to(change.get("table_dtype", torch.int32))
    seq_lens = torch.tensor([8], dtype=change.get("lens_dtype", torch.int32))
    q = torch.randn(1, change.get("hq", 8), change.get("d", 64)).half()
    with pytest.raises(ValueError, match=message):
        ops.paged_decode_attention(q, ck, cv, table, seq_lens, 0.1, backend="reference")


def test_empty_pool_is_rejected():
    ck, cv = (KVBlockStorage.allocate("q4_0", 0, 16, 1, 64) for _ in range(2))
    with pytest.raises(ValueError, match="the K/V pool has no blocks"):
        ops.paged_decode_attention(torch.randn(1, 1, 64).half(), ck, cv,
                                   torch.full((1, 1), -1, dtype=torch.int32),
                                   torch.zeros(1, dtype=torch.int32), 0.1, backend="reference")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    ck, cv, table, _ = build_pool("f16", "f16", [8], num_kv_heads=1, head_dim=64)
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1"):
        ops.paged_decode_attention(torch.randn(1, 1, 64).half(), ck, cv, table,
                                   torch.tensor([8], dtype=torch.int32), 0.1, backend="triton")


@pytest.mark.parametrize("kv_type", ["f16", "q4_0"])
def test_trace_buffer_is_checked_before_launch(kv_type):
    """A trace buffer of the wrong shape or dtype is refused by name, for either kernel
    (the traced variants themselves run on the GPU: ``test_paged_decode_gpu.py``)."""
    from pagedserve.kernels import paged_decode
    from pagedserve.kernels.decode_plan import DecodeWorkspace

    ck, cv, table, _ = build_pool(kv_type, kv_type, [40], num_kv_heads=2, head_dim=64,
                                  device=TRITON_DEVICE)
    seq_lens = torch.tensor([40], dtype=torch.int32, device=TRITON_DEVICE)
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=TRITON_DEVICE)
    ws = DecodeWorkspace(1, 4, 2, 64, TRITON_DEVICE, chunks_per_head=3)
    programs = 3 * 2  # decode_grid: 3 chunks per head, 2 heads
    for bad in (torch.zeros(programs, 7, dtype=torch.int64, device=TRITON_DEVICE),
                torch.zeros(programs, 8, dtype=torch.int32, device=TRITON_DEVICE)):
        with pytest.raises(ValueError, match=rf"trace must be int64 \[{programs}, 8\]"):
            paged_decode.paged_decode_attention(q, ck, cv, table, seq_lens, 0.125,
                                                workspace=ws, trace=bad)


# ---- storage strides ----------------------------------------------------------------------


def _decode(ck, cv, backend):
    """One decode call over a pool of ``ck``/``cv``'s shape: the argument checks run first."""
    device = ck.data.device
    q = torch.randn(1, 2 * ck.num_kv_heads, ck.head_dim, dtype=torch.float16, device=device)
    return ops.paged_decode_attention(q, ck, cv, torch.zeros(1, 1, dtype=torch.int32,
                                                             device=device),
                                      torch.ones(1, dtype=torch.int32, device=device), 0.125,
                                      backend=backend)


def _f16(data):
    return KVBlockStorage("f16", data, None, 64)


# Pools of 2 blocks, 2 K/V heads, 16-token blocks, head_dim 64 (q4_0: W = 32, 2 scales),
# each made on the device given (strided views: moving one would make it contiguous).
BAD_STRIDES = {
    # [nb, bs, Hkv, D] seen as [nb, Hkv, bs, D]: token-major rows.
    "token-major": lambda dev: _f16(
        torch.zeros(2, 16, 2, 64, dtype=torch.float16, device=dev).transpose(1, 2)),
    "padded-rows": lambda dev: _f16(
        torch.zeros(2, 2, 16, 128, dtype=torch.float16, device=dev)[..., :64]),
    "three-pieces": lambda dev: _f16(
        torch.zeros(2, 2, 3, 16, 64, dtype=torch.float16, device=dev)[:, :, 0]),
    # A pair's payload with scales in their own buffer.
    "scales-apart": lambda dev: KVBlockStorage(
        "q4_0", KVBlockStorage.allocate_pair("q4_0", "q4_0", 2, 16, 2, 64, dev)[0].data,
        torch.zeros(2, 2, 16, 2, dtype=torch.float16, device=dev), 64),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case,message", [
    ("token-major", r"cache_k.data \(2, 2, 16, 64\) has strides \(2048, 64, 128, 1\)"),
    ("padded-rows", r"cache_k.data \(2, 2, 16, 64\) has strides \(4096, 2048, 128, 1\)"),
    ("three-pieces", r"cache_k.data \(2, 2, 16, 64\) has strides \(6144, 3072, 64, 1\)"),
    ("scales-apart", r"cache_k.scales \(2, 2, 16, 2\) has strides \(64, 32, 2, 1\)"),
])
def test_storage_with_other_strides_is_rejected(backend, case, message):
    """Decode takes rows W apart and (block, head) pieces I * block_size rows apart, I = 1
    or 2, scales like data; anything else is refused by name, with what is accepted."""
    device = _backend_device(backend)
    ck = BAD_STRIDES[case](device)
    cv = KVBlockStorage.allocate(ck.kv_type, 2, 16, 2, 64, device)
    width = ck.data.shape[-1] if case != "scales-apart" else 2
    accepted = (rf"decode takes strides \({2 * 16 * width}, {16 * width}, {width}, 1\) \(its "
                rf"own buffer\) or \({4 * 16 * width}, {2 * 16 * width}, {width}, 1\) \(K and "
                rf"V side by side, KVBlockStorage.allocate_pair\)")
    with pytest.raises(ValueError, match=message + ".*; " + accepted):
        _decode(ck, cv, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_k_and_v_with_different_interleave_are_rejected(backend):
    """The kernels step K's and V's rows by one ``INTERLEAVE``: a pair's K with a V in its
    own buffer (or the reverse) is refused."""
    device = _backend_device(backend)
    k, v = KVBlockStorage.allocate_pair("q8_0", "q8_0", 2, 16, 2, 64, device)
    alone = KVBlockStorage.allocate("q8_0", 2, 16, 2, 64, device)
    for ck, cv, ik, iv in ((k, alone, 2, 1), (alone, v, 1, 2)):
        with pytest.raises(ValueError, match=rf"K and V must share their buffers alike: "
                                             rf"cache_k interleave {ik}, cache_v interleave "
                                             rf"{iv}"):
            _decode(ck, cv, backend)


def test_row_limit_counts_the_rows_a_pair_spans():
    """A pair's row index steps over the other storage's rows too: 2**26 blocks of 16
    rows of one head are 2**30 rows alone (accepted) but span 2**31 in a pair. (Meta
    tensors: shapes and strides without memory.)"""
    nb, d = 2**26, 64
    q = torch.empty(1, 2, d, dtype=torch.float16, device="meta")
    table = torch.empty(1, 1, dtype=torch.int32, device="meta")
    lens = torch.empty(1, dtype=torch.int32, device="meta")
    alone = [KVBlockStorage.allocate("q4_0", nb, 16, 1, d, device="meta") for _ in range(2)]
    guards.check_decode_args(q, *alone, table, lens, None)
    pair = KVBlockStorage.allocate_pair("q4_0", "q4_0", nb, 16, 1, d, device="meta")
    with pytest.raises(ValueError, match=r"cache_k spans 2147483648 rows; decode addresses at "
                                         r"most 2\*\*31 - 1"):
        guards.check_decode_args(q, *pair, table, lens, None)
