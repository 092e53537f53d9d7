"""Each rank's slice of a fused weight holds its own heads of every component, and the
start-up checks name the head count that a tensor-parallel size does not divide."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pagedserve.config import ModelConfig
from pagedserve.parallel.group import TensorParallel
from pagedserve.parallel.sharding import check_tensor_parallel, kv_heads, param_shard, slice_full

CFG = ModelConfig(
    vocab_size=101, hidden_size=8, intermediate_size=6, num_hidden_layers=2,
    layer_types=("linear_attention", "full_attention"), num_attention_heads=4,
    num_key_value_heads=1, head_dim=64, partial_rotary_factor=0.25, rope_theta=1e4,
    rms_norm_eps=1e-6, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=3, linear_value_head_dim=5, linear_conv_kernel_dim=4,
    tie_word_embeddings=False, max_position_embeddings=64)


def rows_kept(name: str, total: int, rank: int, size: int = 2) -> list[int]:
    labels = torch.arange(total, dtype=torch.float32)[:, None]  # row i holds i
    shard = param_shard(name, CFG, TensorParallel(rank, size))
    assert shard is not None
    return slice_full(labels, shard)[:, 0].long().tolist()


def test_gdn_in_proj_rank_1_holds_its_heads_of_each_component() -> None:
    dk, dv, key_dim, value_dim, conv = 3, 5, 6, 20, 32  # 2 key heads of 3, 4 value heads of 5
    total = conv + value_dim + 4 + 4
    expected = ([*range(3, 6)]                                  # q of key head 1
                + [*range(key_dim + 3, key_dim + 6)]            # k of key head 1
                + [*range(2 * key_dim + 10, 2 * key_dim + 20)]  # v of value heads 2, 3
                + [*range(conv + 10, conv + 20)]                # z of value heads 2, 3
                + [conv + value_dim + 2, conv + value_dim + 3]  # b
                + [conv + value_dim + 6, conv + value_dim + 7])  # a
    assert (dk, dv) == (CFG.linear_key_head_dim, CFG.linear_value_head_dim)
    assert rows_kept("layers.0.linear_attn.in_proj.weight", total, rank=1) == expected
    assert rows_kept("layers.0.linear_attn.conv1d.weight", conv, rank=1) == expected[:16]
    assert rows_kept("layers.0.linear_attn.A_log", 4, rank=1) == [2, 3]


def test_attention_replicates_the_single_kv_head() -> None:
    D = 64
    total = 4 * 2 * D + 2 * D  # q|gate of 4 heads, then k and v of one head
    got = rows_kept("layers.1.self_attn.qkv_proj.weight", total, rank=1)
    assert got == [*range(2 * 2 * D, 4 * 2 * D), *range(8 * D, 10 * D)]
    assert kv_heads(CFG, TensorParallel(0, 2)) == kv_heads(CFG, TensorParallel(1, 2)) == range(1)


def test_vocabulary_shards_pad_the_last_one() -> None:
    assert rows_kept("lm_head.weight", 101, rank=0) == [*range(51)]
    assert rows_kept("lm_head.weight", 101, rank=1) == [*range(51, 101), 0]  # one zero row


def test_row_parallel_weights_take_columns() -> None:
    full = torch.arange(8 * 6).view(8, 6)
    shard = param_shard("layers.0.mlp.down_proj.weight", CFG, TensorParallel(1, 2))
    assert torch.equal(slice_full(full, shard), full[:, 3:])


@pytest.mark.parametrize(("change", "size", "message"), [
    ({}, 2, None),
    ({}, 4, r"linear_num_key_heads \(2\)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3}, 2,
     r"num_key_value_heads \(3\) of m, or be a multiple of it"),
    ({"intermediate_size": 7}, 2, r"intermediate_size \(7\)"),
])
def test_check_tensor_parallel(change, size, message) -> None:
    cfg = dataclasses.replace(CFG, **change)
    if message is None:
        check_tensor_parallel(cfg, size, "m")
    else:
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel(cfg, size, "m")
