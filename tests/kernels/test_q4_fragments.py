"""The Gluon q4_0 kernel's label maps, on the host (the kernel itself runs on a GPU only:
tests/kernels/test_paged_decode_gpu.py, ``fragment``).

The kernel relabels a row's 128 payload bytes by reshaping them into seven bits and
permuting the bits (``K_PERM``, ``V_PERM``, ``Q_PERM``); the module documents the same
maps as formulas (``k_label_to_byte``, ``v_label_to_byte``) and stores the output through
the V formula. These tests apply the permutations to index tensors with torch and check
them against the formulas, and that every map is a bijection of the 128 bytes.
"""

from __future__ import annotations

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


def test_v_labels_match_the_documented_map():
    got = relabelled_bytes(qf.V_PERM.value)
    assert got == [qf.v_label_to_byte(r) for r in range(128)]
    assert sorted(got) == list(range(128))


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
