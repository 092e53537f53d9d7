"""Capacity planning: how many K/V blocks and state slots fit a memory budget.

The budget covers K/V and recurrent state only (weights and activations are separate).
State slots are taken first, one per concurrently running sequence (``max_num_seqs``)
and the prefix cache's spares for state taps (``prefix_cache.tap_slots_for``), then its
checkpoints (their own budget: a state slot's bytes and a float32
logits row each); the rest of the budget becomes K/V blocks. Speculative decoding's
allocations beside the weights and the pool (``SpeculativeFootprint``) come out of a
device's memory before the budget, as the weights and the activation reserve do.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import torch

from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.kv.checkpoint_pool import checkpoint_bytes
from pagedserve.kv.memory import GiB, KVFootprint, MiB
from pagedserve.model.weight_footprint import WeightFootprint

_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9,
          "kib": 1 << 10, "mib": MiB, "gib": GiB, "tib": 1 << 40, "t": 1e12, "tb": 1e12}


def parse_bytes(text: str) -> int:
    """``"4GiB"``, ``"512MiB"``, ``"3.5e9"``, ``"2GB"`` -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"memory budget {text!r} is not a size; use a number of bytes with an optional "
            "unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB"
        )
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"memory budget must be > 0 bytes, got {text!r}")
    return value


def parse_checkpoint_memory(text: str | None) -> int | None:
    """``--prefix-checkpoint-memory``: ``None`` (the default budget), ``"0"`` (none), or a
    size as ``parse_bytes`` reads it."""
    if text is None:
        return None
    if re.fullmatch(r"\s*0*\.?0*\s*[a-zA-Z]*\s*", text) and any(c == "0" for c in text):
        return 0
    return parse_bytes(text)


def parse_seq_lens(text: str) -> list[int]:
    """``"131072,8192x7"`` -> ``[131072, 8192, 8192, ...]`` (``NxK`` repeats N K times)."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        m = re.fullmatch(r"(\d+)(?:[x*](\d+))?", part)
        if m is None or int(m.group(1)) <= 0:
            raise ValueError(
                f"sequence length {part!r} is not valid; use positive ints, optionally NxK "
                "(e.g. 131072,8192x7)"
            )
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def gpu_free_bytes(fraction: float) -> int:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"gpu memory fraction must be in (0, 1], got {fraction}")
    if not torch.cuda.is_available():
        raise ValueError("a fraction of GPU memory was asked for, but no CUDA device is visible")
    free, _ = torch.cuda.mem_get_info()
    return int(free * fraction)


def budget_after_weights(device_bytes: int, utilization: float, weights_bytes: int,
                         reserve_bytes: int) -> int:
    """The K/V + state budget the engine leaves on a device of ``device_bytes``:
    ``utilization`` of it, less the weights and the activation reserve."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu memory utilization must be in (0, 1], got {utilization}")
    budget = int(device_bytes * utilization) - weights_bytes - reserve_bytes
    if budget <= 0:
        raise ValueError(
            f"weights ({_fmt(weights_bytes)}) and the activation reserve ({_fmt(reserve_bytes)}) "
            f"leave nothing of {_fmt(device_bytes)} at utilization {utilization}"
        )
    return budget


@dataclass(frozen=True)
class SpeculativeFootprint:
    """What speculative decoding allocates on a GPU beside the weights and the K/V pool.

    Attributes:
        draft_vocab_rows: ``N'``, the ids the drafter drafts over (``vocab_size``: all).
        draft_head_bytes: a draft vocabulary subset's copy of the LM head's rows and its
            ids (``engine/draft_vocab.py``; 0 without a subset).
        graph_bytes: the speculative CUDA graphs' buffers for ``max_graph_seqs``
            sequences (``engine/runner.speculative_graph_bytes``), reserved before the
            K/V pool is sized.
    """

    num_speculative_tokens: int
    vocab_size: int
    draft_vocab_rows: int
    draft_head_bytes: int
    graph_bytes: int
    max_graph_seqs: int

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CapacityPlan:
    budget_bytes: int
    block_size: int
    bytes_per_token: int
    bytes_per_block: int
    state_bytes_per_slot: int
    num_state_slots: int
    num_blocks: int
    max_model_len: int
    bytes_per_max_len_seq: int  # K/V of one max_model_len sequence plus its state slot
    max_tokens_in_pool: int
    padded_max_len_seqs: int  # sequences the same budget holds padded to max_model_len
    num_checkpoints: int = 0  # prefix-cache checkpoints (a state slot and a logits row each)
    checkpoint_bytes: int = 0
    bytes_per_checkpoint: int = 0
    speculative: bool = False  # MTP drafting: spare state slots, the head's K/V layer
    num_tap_slots: int = 0  # of num_state_slots: the prefix cache's state-tap spares

    def as_dict(self) -> dict:
        return asdict(self)


def plan_capacity(
    model: ModelConfig,
    cache: CacheConfig,
    budget_bytes: int,
    max_num_seqs: int,
    max_model_len: int,
    state_dtype: torch.dtype = torch.bfloat16,
    num_checkpoints: int = 0,
    speculative: bool = False,
    num_tap_slots: int = 0,
) -> CapacityPlan:
    """Split ``budget_bytes`` into ``max_num_seqs`` state slots (and ``num_tap_slots``
    spare ones, the prefix cache's state taps), ``num_checkpoints`` prefix-cache state
    checkpoints and K/V blocks.

    With ``speculative`` (MTP drafting), as the engine allocates it: every state slot
    has a spare copy (the rollback's snapshot), the MTP head's attention layer has K/V
    in every block, and a checkpoint keeps its last token's hidden row.

    Raises ``ValueError`` if one ``max_model_len`` sequence (with its slot) cannot fit.
    """
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be > 0, got {max_num_seqs}")
    if max_model_len <= 0:
        raise ValueError(f"max_model_len must be > 0, got {max_model_len}")
    cache.check_head_dim(model.head_dim)
    kv = footprint(model, cache, mtp_layers=1 if speculative else 0)
    state = model.state_shapes(state_dtype).bytes_per_slot * (2 if speculative else 1)
    per_seq = max_model_len * kv.bytes_per_token + state
    if per_seq > budget_bytes:
        raise ValueError(
            f"one sequence of max_model_len={max_model_len} tokens needs {_fmt(per_seq)} "
            f"(K/V {_fmt(max_model_len * kv.bytes_per_token)} + state {_fmt(state)}), above "
            f"the budget of {_fmt(budget_bytes)}; lower --max-model-len or raise the budget"
        )
    slots = max_num_seqs + num_tap_slots
    per_checkpoint = bytes_per_checkpoint(model, state_dtype, speculative)
    all_checkpoints = num_checkpoints * per_checkpoint
    num_blocks = (budget_bytes - slots * state - all_checkpoints) // kv.bytes_per_block
    if num_blocks * cache.block_size < max_model_len:
        raise ValueError(
            f"{slots} state slots ({_fmt(slots * state)}) leave room for "
            f"{num_blocks} blocks ({num_blocks * cache.block_size} tokens) besides "
            f"{num_checkpoints} checkpoints ({_fmt(all_checkpoints)}), fewer than one "
            f"max_model_len={max_model_len} sequence; lower --max-num-seqs or raise the budget"
        )
    return CapacityPlan(
        budget_bytes=budget_bytes,
        block_size=cache.block_size,
        bytes_per_token=kv.bytes_per_token,
        bytes_per_block=kv.bytes_per_block,
        state_bytes_per_slot=state,
        num_state_slots=slots,
        num_blocks=int(num_blocks),
        max_model_len=max_model_len,
        bytes_per_max_len_seq=per_seq,
        max_tokens_in_pool=int(num_blocks) * cache.block_size,
        padded_max_len_seqs=budget_bytes // per_seq,
        num_checkpoints=num_checkpoints,
        checkpoint_bytes=all_checkpoints,
        bytes_per_checkpoint=per_checkpoint,
        speculative=speculative,
        num_tap_slots=num_tap_slots,
    )


def bytes_per_checkpoint(model: ModelConfig, state_dtype: torch.dtype,
                         speculative: bool = False) -> int:
    """One prefix-cache checkpoint: a state slot and a float32 logits row, and with
    speculation the last token's hidden row (the drafter resumes from it)."""
    hidden_row = model.hidden_size * state_dtype.itemsize if speculative else 0
    return checkpoint_bytes(model.state_shapes(state_dtype), model.vocab_size, hidden_row)


def footprint(model: ModelConfig, cache: CacheConfig, mtp_layers: int = 0) -> KVFootprint:
    """K/V bytes of the full-attention layers, plus ``mtp_layers`` MTP head layers."""
    return KVFootprint(
        num_layers=model.num_full_attention_layers + mtp_layers,
        num_kv_heads=model.num_key_value_heads,
        head_dim=model.head_dim,
        cache_type_k=cache.cache_type_k,
        cache_type_v=cache.cache_type_v,
        block_size=cache.block_size,
    )


@dataclass(frozen=True)
class WorkloadReport:
    seq_lens: tuple[int, ...]
    live_tokens: int  # block-rounded
    padded_tokens: int
    paged_bytes_per_layer: int
    padded_bytes_per_layer: int
    paged_bytes: int
    padded_bytes: int

    @property
    def ratio(self) -> float:
        return self.padded_bytes / self.paged_bytes

    @property
    def saving(self) -> float:
        return 1.0 - self.paged_bytes / self.padded_bytes

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(ratio=self.ratio, saving=self.saving)
        return d


def workload_report(
    kv: KVFootprint, seq_lens: list[int], max_len: int | None = None
) -> WorkloadReport:
    """Paged vs padded-contiguous K/V for a set of live sequences."""
    width = max(seq_lens) if max_len is None else max_len
    return WorkloadReport(
        seq_lens=tuple(seq_lens),
        live_tokens=kv.block_rounded_tokens(seq_lens),
        padded_tokens=len(seq_lens) * width,
        paged_bytes_per_layer=kv.paged_bytes(seq_lens, per_layer=True),
        padded_bytes_per_layer=kv.padded_bytes(seq_lens, width, per_layer=True),
        paged_bytes=kv.paged_bytes(seq_lens),
        padded_bytes=kv.padded_bytes(seq_lens, width),
    )


def _fmt(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.3f} GiB"
    if n >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.1f} KiB"


def format_weights(weights: WeightFootprint, dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if not weights.fp8_bytes:
        return f"weights          {_fmt(weights.total_bytes)} in {name}"
    return (f"weights          {_fmt(weights.total_bytes)}: FP8 {_fmt(weights.fp8_bytes)} + "
            f"block scales {_fmt(weights.scale_bytes)} + {name} {_fmt(weights.dense_bytes)}")


def format_plan(model: ModelConfig, cache: CacheConfig, plan: CapacityPlan) -> str:
    kv_pt = plan.bytes_per_token
    lines = [
        f"model            {model.architecture}: {model.num_full_attention_layers} full-attention "
        f"+ {model.num_linear_attention_layers} linear-attention layers, "
        f"Hkv={model.num_key_value_heads}, D={model.head_dim}",
        f"K/V types        K={cache.cache_type_k} V={cache.cache_type_v}, "
        f"block_size={plan.block_size}",
        f"budget           {_fmt(plan.budget_bytes)} ({plan.budget_bytes} B) for K/V + state",
        f"bytes per token  {kv_pt} B K/V over all full-attention layers",
        f"bytes per block  {plan.bytes_per_block} B",
        f"state per slot   {_fmt(plan.state_bytes_per_slot)}"
        + (" (with its speculative spare)" if plan.speculative else ""),
        f"per sequence     {_fmt(plan.bytes_per_max_len_seq)} at max_model_len="
        f"{plan.max_model_len} (K/V + state)",
        f"fits             {plan.num_blocks} blocks ({plan.max_tokens_in_pool} tokens) + "
        f"{plan.num_state_slots} state slots"
        + (f" ({plan.num_tap_slots} of them spares for state taps)"
           if plan.num_tap_slots else ""),
        f"padded equiv.    {plan.padded_max_len_seqs} sequences padded to max_model_len",
        f"prefix cache     {plan.num_checkpoints} state checkpoints "
        f"({_fmt(plan.checkpoint_bytes)}, {_fmt(plan.bytes_per_checkpoint)} each: a state "
        f"slot and a logits row{', and a hidden row' if plan.speculative else ''})",
    ]
    return "\n".join(lines)


def format_speculation(spec: SpeculativeFootprint) -> str:
    head = f" (their LM-head rows {_fmt(spec.draft_head_bytes)})" \
        if spec.draft_head_bytes else ""
    return (f"speculation      k={spec.num_speculative_tokens}, drafts over "
            f"{spec.draft_vocab_rows} of {spec.vocab_size} token ids{head}; graph buffers "
            f"{_fmt(spec.graph_bytes)} for {spec.max_graph_seqs} sequences")


def format_workload(rep: WorkloadReport) -> str:
    return "\n".join([
        f"workload         {len(rep.seq_lens)} sequences, {sum(rep.seq_lens)} tokens",
        f"live tokens      {rep.live_tokens} block-rounded; padded slots {rep.padded_tokens}",
        f"one layer        paged {rep.paged_bytes_per_layer / MiB:.0f} MiB vs padded "
        f"{rep.padded_bytes_per_layer / MiB:.0f} MiB",
        f"all layers       paged {rep.paged_bytes / GiB:.3f} GiB vs padded "
        f"{rep.padded_bytes / GiB:.3f} GiB",
        f"paged uses       {rep.ratio:.2f}x less ({100 * rep.saving:.2f}% saving)",
    ])
