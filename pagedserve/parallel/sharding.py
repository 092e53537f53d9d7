"""What each rank holds: the start-up checks of a tensor-parallel size, each rank's head
counts, and the sharding rule of every weight.

Heads are split in contiguous runs: rank r of N holds query heads ``[r Hq/N, (r+1) Hq/N)``
and the K/V heads they read, which is its own ``Hkv/N`` heads when N divides Hkv, else the
one K/V head its query heads share (replicated on ``N/Hkv`` ranks). Gated DeltaNet key and
value heads split alike (a value head reads key head ``j // (Hv/Hk)``, so a rank's value
heads read only its own key heads), and so do the MLP's intermediate rows and the vocabulary.

Column-parallel weights (outputs split: the fused q/k/v, GDN in-projection, conv taps and
per-head gates, MLP gate/up, embedding and LM head) take rows; row-parallel ones (o_proj,
GDN out_proj, MLP down_proj) take columns, and their partial outputs are summed over the
ranks. Fused weights are cut per component, so each rank's slice holds its own heads of
every component::

    qkv_proj   [ q|gate: Hq x 2D ][ k: Hkv x D ][ v: Hkv x D ]      rank r: its heads of each
    in_proj    [ q: Hk x Dk | k: Hk x Dk | v: Hv x Dv ][ z: Hv x Dv ][ b: Hv ][ a: Hv ]
    conv1d     [ q | k | v ] channels, as in_proj's first part
    gate_up    [ gate: I ][ up: I ]

The split of matrices into column- and row-parallel halves, so that one all-reduce closes
each block, is Megatron-LM's; the per-component cut of fused projections follows vLLM's
``MergedColumnParallelLinear`` / ``QKVParallelLinear`` (ideas only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import ModelConfig
from pagedserve.parallel.group import TensorParallel

FLAG = "--tensor-parallel-size"


def check_tensor_parallel(cfg: ModelConfig, size: int, model: str = "the model") -> None:
    """Raise ``ValueError`` unless ``size`` ranks can split every head count of ``cfg``."""
    if size == 1:
        return
    counts = (
        ("num_attention_heads", cfg.num_attention_heads),
        ("linear_num_key_heads", cfg.linear_num_key_heads),
        ("linear_num_value_heads", cfg.linear_num_value_heads),
        ("intermediate_size", cfg.intermediate_size),
    )
    for name, count in counts:
        if count % size:
            raise ValueError(f"{FLAG} {size} must divide {name} ({count}) of {model}")
    hkv = cfg.num_key_value_heads
    if hkv % size and size % hkv:
        raise ValueError(f"{FLAG} {size} must divide num_key_value_heads ({hkv}) of {model}, "
                         f"or be a multiple of it (K/V heads are then replicated)")


def num_local_kv_heads(cfg: ModelConfig, size: int) -> int:
    """K/V heads one rank stores: ``Hkv / N``, or one replicated head when N > Hkv."""
    return max(1, cfg.num_key_value_heads // size)


def kv_heads(cfg: ModelConfig, tp: TensorParallel) -> range:
    """The K/V heads this rank's query heads read."""
    n = num_local_kv_heads(cfg, tp.size)
    first = tp.rank * cfg.num_key_value_heads // tp.size
    return range(first, first + n)


def vocab_rows(cfg: ModelConfig, size: int) -> int:
    """Rows of one rank's vocabulary shard: the vocabulary rounded up to ``size`` rows."""
    return -(-cfg.vocab_size // size)


@dataclass(frozen=True)
class ParamShard:
    """This rank's slice of one parameter.

    ``dim`` 0 (column-parallel): the parameter is the row-wise concatenation of parts of
    ``sizes[i]`` rows (the checkpoint tensors of a fused parameter, else one), and the rank
    keeps rows ``ranges[i]`` of part i, in order. ``dim`` 1 (row-parallel): one part; the
    rank keeps its columns ``ranges[0]``. ``rows`` pads the result with zero rows (the last
    vocabulary shard).
    """

    dim: int
    sizes: tuple[int, ...]
    ranges: tuple[tuple[range, ...], ...]
    rows: int | None = None

    def local_size(self) -> int:
        """Rows (dim 0) or columns (dim 1) the rank keeps, padding excluded."""
        return sum(len(r) for part in self.ranges for r in part)


def _span(heads: range, width: int, offset: int = 0) -> range:
    return range(offset + heads.start * width, offset + heads.stop * width)


def param_shard(name: str, cfg: ModelConfig, tp: TensorParallel) -> ParamShard | None:
    """The rank's slice of parameter ``name`` (prefix-free); ``None``: kept whole
    (norms, which act on one head or on the hidden state)."""
    if tp.size == 1:
        return None
    D = cfg.head_dim
    q, kv = tp.share(cfg.num_attention_heads), kv_heads(cfg, tp)
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    k, v = tp.share(cfg.linear_num_key_heads), tp.share(cfg.linear_num_value_heads)
    dk, dv, hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    key_dim, value_dim = cfg.linear_key_dim, cfg.linear_value_dim
    conv = (_span(k, dk), _span(k, dk, key_dim), _span(v, dv, 2 * key_dim))
    mlp = tp.share(cfg.intermediate_size)
    vocab = vocab_rows(cfg, tp.size)
    rows: dict[str, ParamShard] = {
        "self_attn.qkv_proj.weight": ParamShard(
            0, (2 * hq * D, hkv * D, hkv * D),
            ((_span(q, 2 * D),), (_span(kv, D),), (_span(kv, D),))),
        "self_attn.o_proj.weight": ParamShard(1, (hq * D,), ((_span(q, D),),)),
        "linear_attn.in_proj.weight": ParamShard(
            0, (cfg.conv_dim, value_dim, hv, hv),
            (conv, (_span(v, dv),), (_span(v, 1),), (_span(v, 1),))),
        "linear_attn.conv1d.weight": ParamShard(0, (cfg.conv_dim,), (conv,)),
        "linear_attn.dt_bias": ParamShard(0, (hv,), ((_span(v, 1),),)),
        "linear_attn.A_log": ParamShard(0, (hv,), ((_span(v, 1),),)),
        "linear_attn.out_proj.weight": ParamShard(1, (value_dim,), ((_span(v, dv),),)),
        "mlp.gate_up_proj.weight": ParamShard(
            0, (cfg.intermediate_size,) * 2, ((mlp,), (mlp,))),
        "mlp.down_proj.weight": ParamShard(1, (cfg.intermediate_size,), ((mlp,),)),
    }
    if name in ("embed_tokens.weight", "lm_head.weight"):
        first = tp.rank * vocab
        mine = range(min(first, cfg.vocab_size), min(first + vocab, cfg.vocab_size))
        return ParamShard(0, (cfg.vocab_size,), ((mine,),), rows=vocab)
    for suffix, shard in rows.items():
        if name.endswith("." + suffix) and not name.startswith("mtp."):
            return shard
    return None


def slice_full(full: torch.Tensor, shard: ParamShard) -> torch.Tensor:
    """This rank's slice of a whole parameter ``full`` (random weights, made whole on
    every rank from one seed): the same rule as the checkpoint loader's."""
    if shard.dim == 1:
        return torch.cat([full[:, r.start:r.stop] for r in shard.ranges[0]], dim=1)
    parts = full.split(shard.sizes, dim=0)
    kept = torch.cat([p[r.start:r.stop] for p, rs in zip(parts, shard.ranges) for r in rs])
    if shard.rows is not None and kept.shape[0] < shard.rows:
        pad = kept.new_zeros((shard.rows - kept.shape[0], *kept.shape[1:]))
        kept = torch.cat([kept, pad])
    return kept
