"""The Gluon q4_0 kernel's label maps, on the host (the kernel itself runs on a GPU only:
tests/kernels/test_paged_decode_gpu.py, ``fragment``).

The kernel relabels a row's 128 payload bytes by reshaping them into seven bits and
permuting the bits (``K_PERM``, ``Q_PERM``; V's pair tiles by ``V_PAIR_PERM``); the
module documents the same maps as formulas (``k_label_to_byte``, ``v_label_to_byte``)
and stores the output through the V formula. These tests apply the permutations to index
tensors with torch and check them against the formulas, and that every map is a
bijection of the 128 bytes; and they compile the kernel for sm_90 on the host, which
checks its layout premises.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve.kernels import q4_fragments as qf


def relabelled_bytes(perm: list[int]) -> list[int]:
    """The byte at each label after the kernel's reshape / permute / reshape of one row
    (``perm`` over ``[W, T, b6 .. b0]``; W = T = 1 here)."""
    byte = torch.arange(128).reshape(1, 1, *[2] * 7)
    return byte.permute(*perm).reshape(128).tolist()


def test_k_labels_match_the_documented_map():
    got = relabelled_bytes(qf.K_PERM.value)
    assert got == [qf.k_label_to_byte(c) for c in range(128)]
    assert sorted(got) == list(range(128))


def pair_tile_labels() -> torch.Tensor:
    """``(token, byte)`` at each ``[label, token]`` of ``V^T`` after ``_pair_fragments``,
    on the host: the rows split into even and odd tokens, ``Q4_PAIRS_ASM``'s outputs at
    each position (its four operand elements are the four bytes of one word), the join
    and the ``V_PAIR_PERM`` relabel. Returns int ``[128, 32, 2]``."""
    a = torch.arange(16)[:, None, None]  # token pair
    g = torch.arange(8)[None, :, None]
    j = torch.arange(16)[None, None, :]  # word j // 4, asm position j % 4
    token = 2 * a + (j % 2)  # the asm pairs rows t, t + 1 at positions (0, 1) and (2, 3)
    outputs = []
    for second_half in (0, 1):  # lo0 / lo1 (and hi0 / hi1): bytes 0, 1 or 2, 3 of the word
        byte = 16 * g + 4 * (j // 4) + 2 * second_half + (j % 4) // 2
        outputs.append(torch.stack(torch.broadcast_tensors(token, byte), -1))
    joined = torch.stack(outputs, -2)  # [16, 8, 16, 2 (x), 2 (token, byte)]
    bits = joined.reshape(1, *[2] * 12, 2)
    perm = qf.V_PAIR_PERM.value + [13]
    return bits.permute(*perm).reshape(128, 32, 2)


def test_v_pair_labels_match_the_documented_map():
    got = pair_tile_labels()
    want_byte = torch.tensor([qf.v_label_to_byte(r) for r in range(128)])
    assert torch.equal(got[..., 0], torch.arange(32).expand(128, 32))
    assert torch.equal(got[..., 1], want_byte[:, None].expand(128, 32))
    assert sorted(want_byte.tolist()) == list(range(128))


def test_q_is_relabelled_like_k():
    """q's labels (``[W, heads, b6 .. b0]``) must pair with K's, value for value."""
    byte = torch.arange(128).reshape(1, 1, *[2] * 7)
    q_bytes = byte.permute(*qf.Q_PERM.value).reshape(128).tolist()
    assert q_bytes == relabelled_bytes(qf.K_PERM.value)


def test_k_fragment_registers_hold_contiguous_bytes():
    """The layout's premise: the labels one thread holds in one k-step (c, c+1, c+8, c+9
    for c = 16 s + 2 t) are four consecutive bytes, so a thread's words need no
    repacking; its 32 labels over the 8 k-steps are 32 contiguous bytes."""
    for t in range(4):
        held = []
        for s in range(8):
            c = 16 * s + 2 * t
            word = [qf.k_label_to_byte(x) for x in (c, c + 1, c + 8, c + 9)]
            assert word == list(range(word[0], word[0] + 4))
            held += word
        assert sorted(held) == list(range(32 * t, 32 * t + 32))


def test_v_rows_map_to_one_group_per_lane_group():
    """V's output rows r and r + 8 k for one lane (r % 8 fixed) come from one 16-byte group,
    whose scale is then one per token for that thread."""
    for g in range(8):
        groups = {qf.v_label_to_byte(r) // 16 for r in range(g, 128, 8)}
        assert groups == {g}


def _compile_for_sm90(paged: bool) -> dict:
    """Loop statistics of the kernel compiled offline for an H100/H200 target by
    ``benchmarks/decode_sass.py`` (Triton's bundled ptxas; no GPU), at the library's q4_0
    launch. A subprocess without ``TRITON_INTERPRET``: under the interpreter, Triton
    functions cannot be compiled into a Gluon kernel."""
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    spec = "q4_0:q4_0:fragment:128:4:1:block-now"
    args = [sys.executable, str(root / "benchmarks" / "decode_sass.py"), spec]
    if not paged:
        args.insert(2, "--contiguous")
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    return {
        "mma": int(re.search(r"\((\d+) MMAs\)", lines[0]).group(1)),
        "memory_ops": ast.literal_eval(lines[2].split("memory ", 1)[1]),
    }


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_kernel_compiles_for_sm90_with_its_layout_premises(paged):
    """Compiling checks the premises that the GPU tests, which check values, cannot see (a
    layout conversion is an identity on values wherever the data lives): every
    conversion the kernel declares free (``assert_trivial``: the relabelled byte
    tiles already sit in the threads that hold those MMA operands; the scores after
    ``movmatrix`` are the B operand of ``P @ V``) moves no data between threads, or
    compilation fails; and the tile loop runs its 64 MMAs per 512 values without
    shared memory. (A wrong lane of ``V_PAIR`` fails this test; a wrong register
    order within a thread does not, and costs only byte shuffles.)"""
    stats = _compile_for_sm90(paged)
    assert stats["mma"] == 64
    assert not any(op.startswith(("LDS", "STS", "LDSM", "STSM")) for op in stats["memory_ops"])


def test_launcher_binds_every_kernel_argument(monkeypatch):
    """The Gluon kernel runs only on a GPU; on the CPU, check that the launcher's
    arguments (shared with the Triton kernel) bind the kernel's signature exactly: each
    run-time argument once, in order, and every compile-time one by name."""
    from pagedserve.kernels import ops
    from pagedserve.kernels.decode_plan import DecodeConfig
    from pagedserve.kv.formats import KVBlockStorage

    arg_names = qf.q4_fragment_decode_kernel.arg_names
    seen = {}

    class Recorder:
        def __getitem__(self, grid):
            def call(*args, **kwargs):
                seen.update(grid=grid, args=args, kwargs=kwargs)
            return call

    monkeypatch.setattr(qf, "q4_fragment_decode_kernel", Recorder())
    monkeypatch.setattr(qf, "supports", lambda q, ck, cv: True)
    ck = KVBlockStorage.allocate("q4_0", 8, 16, 2, 256)
    cv = KVBlockStorage.allocate("q4_0", 8, 16, 2, 256)
    q = torch.zeros(3, 12, 256, dtype=torch.float16)
    table = torch.zeros(3, 2, dtype=torch.int32)
    lens = torch.tensor([5, 0, 20], dtype=torch.int32)
    ops.paged_decode_attention(q, ck, cv, table, lens, 0.0625, backend="triton",
                               config=DecodeConfig(block_n=128, num_warps=4,
                                                   min_partition=128, quant_dot="fragment"))
    n = len(seen["args"])
    assert n == arg_names.index("G")  # the run-time arguments, then the constexprs
    assert seen["args"][0] is q and seen["args"][n - 1] == 0.0625 * 1.4426950408889634
    assert set(seen["kwargs"]) - {"num_warps", "maxnreg"} == set(arg_names[n:])
    assert seen["grid"][1] == 2 and seen["kwargs"]["G"] == 6 and seen["kwargs"]["PAGED"]
