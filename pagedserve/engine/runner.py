"""``ModelRunner``: the model's weights and every tensor a step reads or writes.

It owns the decoder, one K and one V ``KVBlockStorage`` per full-attention layer (sharing
one buffer when their types match: ``KVBlockStorage.allocate_pair``), and the
``StatePool`` of the linear-attention layers. ``execute(batch)`` runs one ``ForwardBatch``
and returns the logits of each sequence's last new token. Decode-only batches on CUDA
replay a captured CUDA graph (``DecodeGraphs``), and so do steps that prefill one short
chunk (``PrefillGraphs``), with or without decode rows beside it (each part replays its
own graph); everything else runs eagerly, and on the CPU everything is eager
with the torch reference ops. With speculation, ``verify(batch)`` replays a captured
graph for pure verify steps (``VerifyGraphs``), ``roll_back_verify`` rolls such a
step's sequences back by another (``RollbackGraphs``), and the MTP drafter's passes
replay theirs (``DraftGraphs``), with the drafter's logits over its draft vocabulary
(``draft_head``, ``engine/draft_vocab.py``).

Layouts (``CacheConfig.kv_layout``)::

    paged       num_blocks blocks of block_size rows; a sequence owns ceil(len / block_size)
                blocks through its block-table row (max_blocks_per_seq columns)
    contiguous  one block of max_model_len rows per sequence (num_blocks = max_num_seqs,
                max_blocks_per_seq = 1): the padded baseline, on the same storage and ops

The runner does not decide who runs; the engine builds batches with a ``KVCacheManager``
(``create_kv_manager``) and state slots from ``state_pool``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.engine.decode_graphs import DecodeGraphs, graph_batch_sizes
from pagedserve.engine.draft_graphs import DraftGraphs, ObserveGraphs, ProposeGraphs
from pagedserve.engine.draft_vocab import DraftHead
from pagedserve.engine.prefill_graphs import PrefillGraphs
from pagedserve.engine.rollback_graphs import RollbackGraphs
from pagedserve.engine.verify_graphs import VerifyGraphs, VerifyOutput, verify_graph_sizes
from pagedserve.kernels.ops import (
    DecodeWorkspace,
    RollbackLayers,
    default_occupancy,
    gdn_roll_back,
    rollback_layers,
)
from pagedserve.kv import formats
from pagedserve.kv.block_pool import BlockPool
from pagedserve.kv.checkpoint_pool import CheckpointPool
from pagedserve.kv.formats import KVBlockStorage
from pagedserve.kv.kv_manager import BlockCopy, KVCacheManager
from pagedserve.kv.memory import KVFootprint
from pagedserve.kv.state_pool import StatePool, StateShapes
from pagedserve.model import elementwise
from pagedserve.model.forward_batch import ForwardBatch, GdnRecord
from pagedserve.model.qwen3_5 import ModelCaches, Qwen3_5Model
from pagedserve.parallel.sharding import num_local_kv_heads

log = logging.getLogger(__name__)

# Memory kept free on CUDA for activations of the largest eager step and the allocator.
DEFAULT_ACTIVATION_RESERVE = 2 << 30
# The most prefill chunks a step replays one graph each for (``_split_for_graphs``). A
# graph replay of a 512-row chunk takes about 47 ms on the 27B shape, a short chunk's
# about a decode step's (the weights read once); the same step run eagerly takes about
# 170 ms of host launches whatever its chunk count (docs/kernel-decisions.md, "Prefill
# CUDA graphs"). Two chunks and the decode rows replay in about 110 ms at worst; three
# 512-row chunks would be about as slow as the eager step. The scheduler puts at most this
# many prompt chunks beside decode rows (``SchedulerConfig.max_mixed_prompt_chunks``).
MAX_SPLIT_PREFILL_CHUNKS = 2


def speculative_graph_bytes(cfg: ModelConfig, rows_per_seq: int, max_seqs: int,
                            dtype: torch.dtype, draft_rows: int | None = None) -> int:
    """Bytes of the speculative graphs' static outputs and captured activations, counted
    by the rows that dominate them, for verify steps of up to ``max_seqs`` sequences of
    ``rows_per_seq`` (``k + 1``) rows. Each verify row holds a float32 logits row over the
    vocabulary twice (the output and the head's own), a hidden row and every GDN layer's
    recorded inputs; each propose pass (``k``) and the observe pass's tail hold a draft
    logits row (``draft_rows`` columns, the draft vocabulary's ``N'``; ``None``: the whole
    vocabulary) and a hidden row per sequence twice. Beyond the decode activations
    ``DEFAULT_ACTIVATION_RESERVE`` covers, they grow with ``max_seqs x rows_per_seq x
    vocabulary``: about 0.3 GB at 16 sequences and ``k = 3`` on the 27B shape, about 5 GB
    at 256. A draft head's own rows are not here: the runner gathers them before the
    K/V pool is sized (``draft_vocab.subset_bytes``)."""
    width = dtype.itemsize
    logits_row = cfg.vocab_size * 4
    draft_logits_row = (draft_rows or cfg.vocab_size) * 4
    hidden_row = cfg.hidden_size * width
    record_row = cfg.num_linear_attention_layers * (
        cfg.conv_dim + 2 * cfg.linear_num_value_heads) * width
    verify = max_seqs * rows_per_seq * (2 * logits_row + hidden_row + record_row)
    draft = rows_per_seq * max_seqs * 2 * (draft_logits_row + hidden_row)
    return verify + draft


@dataclass(frozen=True)
class RunnerConfig:
    """Capacity of the runner.

    Attributes:
        max_model_len: most tokens (prompt + generated) one sequence may hold.
        max_num_seqs: live sequences at once: state slots and block-table rows.
        num_blocks: paged layout only: blocks in the pool. ``None`` sizes the pool to hold
            every sequence at ``max_model_len`` on the CPU, and from free memory on CUDA
            (``gpu_memory_utilization``), capped at that same size.
        gpu_memory_utilization: fraction of the GPU's memory the process may use in total.
        cuda_graphs: capture decode-only steps as CUDA graphs (CUDA only).
        compile_elementwise: run the norms, RoPE and gates as ``torch.compile``d fused
            kernels (CUDA only; falls back to eager, with a warning, if compiling fails).
            This changes the model passed in, for every runner that shares it.
        max_graph_batch_size: largest decode batch run as a graph (default ``max_num_seqs``).
        prefill_graph_tokens: largest one-sequence prefill chunk run as a graph
            (``PrefillGraphs``, which caps it at ``max_model_len``; 0: none).
        num_checkpoints: recurrent-state checkpoints kept for prefix caching
            (``CheckpointPool``; 0: none), allocated before the K/V pool is sized.
        state_tap_slots: state slots beyond ``max_num_seqs``, for the prefix cache's
            checkpoints inside prefill chunks (``model/state_taps.py``).
        state_snapshots: keep one spare copy of every state slot, for speculative
            decoding's rollback (``save_states`` / ``restore_states``).
        checkpoint_hidden: each checkpoint keeps a hidden-state row too (speculative
            decoding's drafter, ``engine/prefix_cache.py``).
        verify_rows: rows per sequence of a speculative verify step that checks every
            draft (``k + 1``); with ``cuda_graphs``, such steps of up to
            ``max_graph_batch_size`` sequences are captured (``VerifyGraphs``), and so are
            the MTP head's passes, when the model has one (``DraftGraphs``). 0: none.
        verify_graph_tokens: the most rows of a verify step (the scheduler's token
            budget): no verify graph is captured past the size that holds them.
            ``None``: no cap.
    """

    max_model_len: int = 4096
    max_num_seqs: int = 8
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.90
    cuda_graphs: bool = True
    compile_elementwise: bool = True
    max_graph_batch_size: int | None = None
    prefill_graph_tokens: int = 512
    num_checkpoints: int = 0
    state_tap_slots: int = 0
    state_snapshots: bool = False
    checkpoint_hidden: bool = False
    verify_rows: int = 0
    verify_graph_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {self.num_checkpoints}")
        if self.state_tap_slots < 0:
            raise ValueError(f"state_tap_slots must be >= 0, got {self.state_tap_slots}")
        if self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be > 0, got {self.max_num_seqs}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {self.num_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.verify_rows < 0 or self.verify_rows == 1:
            raise ValueError(f"verify_rows must be 0 (none) or >= 2, got {self.verify_rows}")
        if self.max_graph_batch_size is not None and self.max_graph_batch_size <= 0:
            raise ValueError(
                f"max_graph_batch_size must be > 0, got {self.max_graph_batch_size}"
            )


@dataclass(frozen=True)
class MemoryUsage:
    """Bytes on the device, by owner."""

    weights_bytes: int
    kv_bytes: int
    state_bytes: int
    checkpoint_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes + self.checkpoint_bytes


class ModelRunner:
    """Runs steps of one model on one device.

    Args:
        model: the decoder with its weights loaded (``loader.load_model(...).model``).
        cache_config: K/V types, block size and layout.
        config: capacity (``RunnerConfig``).
        draft_vocab: with the MTP head, the ids it drafts over (``draft_vocab.draft_vocab``;
            ``None``: the whole vocabulary). Their LM-head rows are gathered before the K/V
            pool is sized, so its free-memory reading counts them.
    """

    def __init__(
        self, model: Qwen3_5Model, cache_config: CacheConfig, config: RunnerConfig | None = None,
        draft_vocab: Sequence[int] | None = None,
    ) -> None:
        self.model = model
        self.model_config = cfg = model.config
        self.cache_config = cache_config
        self.config = config = config or RunnerConfig()
        first = next(model.parameters())
        self.device, self.dtype = first.device, first.dtype
        cache_config.check_head_dim(cfg.head_dim)
        for kv_type in (cache_config.cache_type_k, cache_config.cache_type_v):
            formats.check_device_support(kv_type, self.device)
        if config.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's "
                f"max_position_embeddings {cfg.max_position_embeddings}"
            )
        if draft_vocab is not None and not self.has_mtp:
            raise ValueError("a draft vocabulary needs a model loaded with its MTP head")
        # The drafter's logits (``engine/draft_vocab.py``): a subset's rows are a copy.
        self.draft_head = DraftHead(model, draft_vocab) if self.has_mtp else None
        self.weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) \
            + (self.draft_head.nbytes if self.draft_head is not None else 0)
        # Under tensor parallelism (``model.tp``) this rank's storage holds its own heads.
        self.tp = model.tp
        self.num_heads = cfg.num_attention_heads // self.tp.size
        self.num_kv_heads = num_local_kv_heads(cfg, self.tp.size)

        contiguous = cache_config.kv_layout == "contiguous"
        self.block_size = config.max_model_len if contiguous else cache_config.block_size
        self.max_blocks_per_seq = 1 if contiguous else -(-config.max_model_len // self.block_size)
        self.state_pool = self._new_state_pool(
            cfg.state_shapes(self.dtype, self.tp.size),
            config.max_num_seqs + config.state_tap_slots)
        self.checkpoint_pool = CheckpointPool(
            cfg.state_shapes(self.dtype, self.tp.size), config.num_checkpoints, self.device,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size if config.checkpoint_hidden else 0,
            hidden_dtype=self.dtype)
        # Spare copies of the state slots, indexed by slot: [L_lin, S + 1, ...] each. The
        # null slot's spare stays zero: a rollback graph's capture restores from it.
        self._snapshots = ((torch.zeros_like(self.state_pool.conv_state),
                            torch.zeros_like(self.state_pool.recurrent_state))
                           if config.state_snapshots else None)
        self.num_blocks = config.max_num_seqs if contiguous else self._paged_num_blocks()
        # One (K, V) storage pair per full-attention layer, all over the same block ids;
        # K and V side by side in one buffer when their types match (``allocate_pair``).
        self.kv_caches = [
            KVBlockStorage.allocate_pair(
                cache_config.cache_type_k, cache_config.cache_type_v, self.num_blocks,
                self.block_size, self.num_kv_heads, cfg.head_dim, self.device,
            )
            for _ in range(self.num_kv_layers)
        ]
        workspace = None
        if self.device.type == "cuda":
            workspace = DecodeWorkspace(
                config.max_num_seqs, self.num_heads, self.num_kv_heads,
                cfg.head_dim, self.device,
                occupancy=default_occupancy(cache_config.cache_type_k, cache_config.cache_type_v),
            )
        # The MTP head's layer takes the last pair: its rows sit under the target's block
        # tables, so every block holds its row i beside the target's row i (``mtp.py``).
        num_target = cfg.num_full_attention_layers
        self.caches = ModelCaches(
            self.kv_caches[:num_target], self.state_pool.conv_state,
            self.state_pool.recurrent_state, workspace,
        )
        self.mtp_caches = ModelCaches(
            self.kv_caches[num_target:], self.state_pool.conv_state,
            self.state_pool.recurrent_state, workspace,
        )
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.draft_graphs: DraftGraphs | None = None
        self.rollback_graphs: RollbackGraphs | None = None
        # The rollback's table of a record's and the GDN layers' addresses, with the
        # record's key (``_rollback_layers``).
        self._rollback_table: tuple[tuple, RollbackLayers] | None = None
        if self.device.type == "cuda":
            self._prepare_cuda()

    def _prepare_cuda(self) -> None:
        """Compile the elementwise ops, then capture the decode, prefill, verify, rollback
        and draft graphs (each optional)."""
        config = self.config
        if config.compile_elementwise:
            ops = elementwise.compiled_ops()
            # Steps run in inference mode; compile (and so guard) under the same mode.
            with torch.inference_mode():
                compiled_ok = elementwise.check_compiled(ops, self.device, self.dtype)
            if compiled_ok:
                self.model.use_compiled_elementwise(ops)
        if config.cuda_graphs:
            max_graph_batch = min(config.max_graph_batch_size or config.max_num_seqs,
                                  config.max_num_seqs)
            self.graphs = DecodeGraphs.try_capture(
                self._forward_logits, self.device, max_graph_batch,
                self.max_blocks_per_seq, self.state_pool.null_slot,
            )
            if config.prefill_graph_tokens > 1:
                self.prefill_graphs = PrefillGraphs.try_capture(
                    self._forward_logits, self.device, config.prefill_graph_tokens,
                    self.max_blocks_per_seq, self.state_pool.null_slot, config.max_model_len,
                )
            if config.verify_rows:
                self.verify_graphs = VerifyGraphs.try_capture(
                    self._verify_pass, self.device,
                    verify_graph_sizes(max_graph_batch, config.verify_rows,
                                       config.verify_graph_tokens),
                    config.verify_rows, self.max_blocks_per_seq, self.state_pool.null_slot,
                    config.max_model_len,
                    pool=self.graphs.pool if self.graphs is not None else None,
                )
            if self.verify_graphs is not None and self._snapshots is not None:
                self.rollback_graphs = RollbackGraphs.try_capture(
                    self._rollback_pass, self.verify_graphs, pool=self.verify_graphs.pool)
            if config.verify_rows and self.has_mtp:
                self.draft_graphs = DraftGraphs.try_capture(
                    *self._draft_graph_parts(max_graph_batch),
                    pool=self.graphs.pool if self.graphs is not None else None)

    def _draft_graph_parts(self, max_graph_batch: int) -> tuple[ProposeGraphs | None,
                                                                 ObserveGraphs]:
        """The drafter's graphs, uncaptured: propose passes of the decode graphs' sizes
        (none for ``k = 1``), observe passes of the verify graphs' sizes."""
        config, cfg = self.config, self.model_config
        r = config.verify_rows
        head = self.draft_head
        assert head is not None
        shapes = (cfg.hidden_size, self.max_blocks_per_seq, self.state_pool.null_slot)
        propose = None
        if r > 2:
            propose = ProposeGraphs(self._mtp_pass, head, self.device, self.dtype,
                                    graph_batch_sizes(max_graph_batch), r - 1, *shapes)
        observe = ObserveGraphs(
            self._mtp_pass, head, self.device, self.dtype,
            verify_graph_sizes(max_graph_batch, r, config.verify_graph_tokens), r, *shapes,
            config.max_model_len)
        return propose, observe

    # ---- sizing ---------------------------------------------------------------------------
    @property
    def has_mtp(self) -> bool:
        return getattr(self.model, "mtp", None) is not None

    @property
    def num_kv_layers(self) -> int:
        """Full-attention layers with K/V storage: the target's, and the MTP head's."""
        return self.model_config.num_full_attention_layers + int(self.has_mtp)

    def _kv_footprint(self, block_size: int) -> KVFootprint:
        cfg = self.model_config
        return KVFootprint(
            max(self.num_kv_layers, 1), self.num_kv_heads, cfg.head_dim,
            self.cache_config.cache_type_k, self.cache_config.cache_type_v, block_size,
        )

    def speculative_graph_bytes(self) -> int:
        """Device memory the speculative graphs take beside the K/V pool (CUDA graphs
        on, with speculation), set aside before the pool is sized."""
        config = self.config
        if not config.verify_rows or not config.cuda_graphs or self.device.type != "cuda":
            return 0
        seqs = min(config.max_graph_batch_size or config.max_num_seqs, config.max_num_seqs)
        draft_rows = self.draft_head.num_rows if self.draft_head is not None else None
        return speculative_graph_bytes(self.model_config, config.verify_rows, seqs, self.dtype,
                                       draft_rows)

    def _paged_num_blocks(self) -> int:
        enough = self.config.max_num_seqs * self.max_blocks_per_seq
        if self.config.num_blocks is not None:
            return self.config.num_blocks
        if self.device.type != "cuda":
            return enough
        # What torch's allocator caches from freed tensors (the bf16 originals of weights
        # quantized while loading, an earlier engine's tensors) is free for the pool.
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        budget = int(total * self.config.gpu_memory_utilization) - used
        budget -= DEFAULT_ACTIVATION_RESERVE + self.speculative_graph_bytes()
        per_block = self._kv_footprint(self.block_size).bytes_per_block
        # Every rank's pool must hold the same block ids: the smallest rank's size wins.
        blocks = self.tp.min_over_ranks(min(enough, max(budget, 0) // per_block), self.device)
        if blocks < self.max_blocks_per_seq:
            raise ValueError(
                f"not enough GPU memory for one sequence of max_model_len "
                f"{self.config.max_model_len}: {budget / 2**30:.2f} GiB left for K/V after "
                f"weights, state and a {DEFAULT_ACTIVATION_RESERVE >> 30} GiB activation "
                f"reserve at gpu_memory_utilization {self.config.gpu_memory_utilization}"
                + (" on some tensor-parallel rank" if self.tp.size > 1 else "")
            )
        return blocks

    def _new_state_pool(self, shapes: StateShapes, num_slots: int) -> StatePool:
        """The state slots (the tensor-parallel runner mirrors their zeroing to its workers)."""
        return StatePool(shapes, num_slots, self.device)

    def close(self) -> None:
        """Release what outlives the runner's tensors: nothing here; the tensor-parallel
        runner stops its workers."""

    @property
    def graphed_prefill_tokens(self) -> int:
        """The longest one-sequence prefill chunk a captured graph replays (0: none)."""
        return self.prefill_graphs.max_tokens if self.prefill_graphs is not None else 0

    def create_kv_manager(self) -> KVCacheManager:
        """A sequence manager whose block ids and table width match this runner's storage."""
        bytes_per_block = self._kv_footprint(self.block_size).bytes_per_block
        return KVCacheManager(
            BlockPool(self.num_blocks, self.block_size, bytes_per_block),
            self.config.max_num_seqs, self.max_blocks_per_seq,
        )

    def memory_usage(self) -> MemoryUsage:
        kv = sum(k.nbytes + v.nbytes for k, v in self.kv_caches)
        state = sum(
            t.numel() * t.element_size()
            for t in (self.state_pool.conv_state, self.state_pool.recurrent_state,
                      *(self._snapshots or ()))
        )
        return MemoryUsage(self.weights_bytes, kv, state, self.checkpoint_pool.total_bytes)

    # ---- steps ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step. Returns float32 logits ``[B, vocab]``, one row per sequence (the
        logits of its last new token). K/V rows and state slots are updated in place."""
        if self.graphs is not None and batch.is_decode_only:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
        if self.prefill_graphs is not None and self.prefill_graphs.fits(batch):
            return self.prefill_graphs.run(batch)
        split = self._split_for_graphs(batch)
        if split is not None:
            return split
        return self._forward_logits(batch)

    def _split_for_graphs(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Decode rows beside a few short prefill chunks, or a few short chunks alone: the
        decode graph, then the prefill graph once per chunk, in the batch's row order.

        Such a step, run eagerly, is bound by the host's launches (several times its GPU
        time); each of its parts fits a captured graph. Every sequence's result is its own
        either way: sequences share no state within a step. ``None`` when the step does
        not split so (``MAX_SPLIT_PREFILL_CHUNKS``).
        """
        if (self.prefill_graphs is None or batch.row_valid is not None
                or batch.gdn_rounds is not None):
            return None
        d, b = batch.num_decode_seqs, batch.num_seqs
        if not 0 < b - d <= MAX_SPLIT_PREFILL_CHUNKS or b == 1:
            return None
        decode = batch.sequences(0, d) if d else None
        if decode is not None and (self.graphs is None or not self.graphs.holds(decode)):
            return None
        chunks = [batch.sequences(i, i + 1) for i in range(d, b)]
        if not all(self.prefill_graphs.fits(c) for c in chunks):
            return None
        logits = []  # [B, vocab] in parts
        if decode is not None:
            assert self.graphs is not None
            decode_logits = self.graphs.run(decode)
            assert decode_logits is not None
            logits.append(decode_logits)
        logits += [self.prefill_graphs.run(c) for c in chunks]
        return torch.cat(logits)

    def _forward_logits(self, batch: ForwardBatch) -> torch.Tensor:
        hidden = self.model(batch, self.caches)  # [T, H]
        return self.model.compute_logits(hidden[batch.logits_indices])  # [B, vocab]

    # ---- speculative decoding (eager, but for the graphs of ``verify`` and the drafter) --
    @torch.inference_mode()
    def verify(self, batch: ForwardBatch) -> VerifyOutput | None:
        """A pure verify step (every sequence holds ``verify_rows`` rows) through its
        captured graph: every row's hidden state, logits and Gated DeltaNet inputs
        (``VerifyGraphs.run``). ``None`` when no graph holds ``batch``."""
        if self.verify_graphs is None or not self.verify_graphs.fits(batch):
            return None
        return self.verify_graphs.run(batch)

    def _verify_pass(self, batch: ForwardBatch) -> VerifyOutput:
        """The pass a verify graph captures: ``forward_hidden`` recording every row,
        then every row's logits."""
        batch.gdn_record = GdnRecord(None, [])
        hidden = self.model(batch, self.caches)  # [T, H]
        return VerifyOutput(hidden, self.model.compute_logits(hidden), batch.gdn_record.inputs)

    @torch.inference_mode()
    def roll_back_verify(self, num_rows: list[int] | torch.Tensor) -> bool:
        """Roll the sequences of the last verify graph replay back to their first
        ``num_rows`` rows each (in the batch's order; ``1 .. verify_rows``, 0: leave the
        sequence as it is; host ints or an int32 device tensor): each such state slot
        back from its spare and advanced over those rows of the replay's record, by one
        replay (``RollbackGraphs.run``).
        ``False`` when no rollback graph is captured (the caller rolls back eagerly)."""
        if self.rollback_graphs is None:
            return False
        self.rollback_graphs.run(num_rows)
        return True

    def _rollback_pass(
        self, num_rows: torch.Tensor, state_slots: torch.Tensor, rows_per_seq: int,
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> None:
        """The pass a rollback graph captures, one launch (``kernels/gdn_rollback.py``):
        in every Gated DeltaNet layer, each sequence's slot of ``state_slots`` (int32
        ``[P]``) set to its spare advanced over the sequence's first ``num_rows`` (int32
        ``[P]``, on the device; 0: the slot is left as it is) of its ``rows_per_seq``
        rows of ``inputs``, a verify step's ``GdnRecord.inputs`` (sequence ``s``'s from
        row ``s rows_per_seq``). What ``restore_states`` and ``advance_linear_states``
        over those rows do."""
        conv, rec = self._spares()
        gdn_roll_back(self._rollback_layers(inputs), num_rows, rows_per_seq, state_slots,
                      self.state_pool.conv_state, self.state_pool.recurrent_state, conv, rec)

    def _rollback_layers(
        self, inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> RollbackLayers:
        """The rollback's table of ``inputs`` and the GDN layers' parameters, built when
        the record first comes (a graph's record buffers stay put): building it copies
        addresses to the device, which a capture cannot, and a capture's warm-up builds
        it first."""
        key = tuple((t.data_ptr(), t.shape, t.stride(), t.dtype) for x in inputs for t in x)
        if self._rollback_table is None or self._rollback_table[0] != key:
            gdn = self.model.linear_attention_layers()
            layers = rollback_layers(
                inputs, [m.conv1d.weight[:, 0] for m in gdn], [m.A_log for m in gdn],
                [m.dt_bias for m in gdn])
            self._rollback_table = (key, layers)
        return self._rollback_table[1]

    @torch.inference_mode()
    def forward_hidden(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one step eagerly and return every row's final-normed hidden state
        ``[T, H]`` (a verify step scores several rows per sequence). With
        ``batch.gdn_record`` set, the Gated DeltaNet layers record their inputs in it."""
        return self.model(batch, self.caches)

    @torch.inference_mode()
    def advance_linear_states(
        self, batch: ForwardBatch, inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        rows: list[int],
    ) -> None:
        """Advance the Gated DeltaNet states of ``batch``'s sequences over rows ``rows``
        of an earlier step's ``GdnRecord.inputs`` (``Qwen3_5Model.advance_linear_states``)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.model.advance_linear_states(batch, self.caches, inputs, index)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, H]`` -> float32 logits ``[N, vocab]`` (the shared head)."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[N, H]`` -> float32 draft logits ``[N, N']`` over the draft
        vocabulary (``draft_head``; ``N' = vocab`` without a subset)."""
        if self.draft_head is None:
            raise ValueError("this model was loaded without its MTP head")
        return self.draft_head.logits(hidden)

    @torch.inference_mode()
    def mtp_forward(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        """One pass of the MTP head (``model/mtp.py``) over ``batch`` from the states
        ``hidden`` ``[T, H]``, eagerly; writes its K/V rows and returns its outputs
        ``[T, H]``. The drafter's graphs (``draft_graphs``) capture this same pass."""
        return self._mtp_pass(batch, hidden)

    def _mtp_pass(self, batch: ForwardBatch, hidden: torch.Tensor) -> torch.Tensor:
        mtp = self.model.mtp
        if mtp is None:
            raise ValueError("this model was loaded without its MTP head")
        return mtp(batch, hidden, self.model.embed_tokens, self.model.rotary, self.mtp_caches)

    @torch.inference_mode()
    def save_states(self, slots: list[int]) -> None:
        """Copy the conv and recurrent state of each slot in ``slots`` to its spare."""
        conv, rec = self._spares()
        _copy_slots(conv, self.state_pool.conv_state, slots)
        _copy_slots(rec, self.state_pool.recurrent_state, slots)

    @torch.inference_mode()
    def restore_states(self, slots: list[int]) -> None:
        """Put back the states ``save_states`` copied for each slot in ``slots``."""
        conv, rec = self._spares()
        _copy_slots(self.state_pool.conv_state, conv, slots)
        _copy_slots(self.state_pool.recurrent_state, rec, slots)

    def _spares(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._snapshots is None:
            raise ValueError("this runner keeps no state snapshots (RunnerConfig.state_snapshots)")
        return self._snapshots

    @torch.inference_mode()
    def copy_blocks(self, copies: list[BlockCopy]) -> None:
        """Copy-on-write: copy block ``src`` to ``dst`` in every layer's K and V storage.

        Run it before the step that writes into ``dst`` (``KVCacheManager.pending_copies``).
        """
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], dtype=torch.long, device=self.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=self.device)
        for pair in self.kv_caches:
            for storage in pair:
                storage.data[dst] = storage.data[src]
                if storage.scales is not None:
                    storage.scales[dst] = storage.scales[src]

    @torch.inference_mode()
    def copy_state_slot(self, src: int, dst: int) -> None:
        """Copy one sequence's conv and recurrent state (every linear layer) to another slot:
        the recurrent half of a fork, next to ``KVCacheManager.fork`` for the K/V half."""
        self.state_pool.conv_state[:, dst] = self.state_pool.conv_state[:, src]
        self.state_pool.recurrent_state[:, dst] = self.state_pool.recurrent_state[:, src]

    def apply_pending_copies(self, kv: KVCacheManager) -> None:
        """Run and clear the manager's pending copy-on-write copies."""
        self.copy_blocks(kv.pending_copies)
        kv.copies_done()


def _copy_slots(dst: torch.Tensor, src: torch.Tensor, slots: list[int]) -> None:
    """``dst[:, s] = src[:, s]`` for each slot ``s`` (states ``[layers, slots, ...]``): one
    strided copy per slot, so nothing the size of the slots' states is gathered first (a
    27B recurrent state is about 150 MB a slot)."""
    for s in slots:
        dst[:, s].copy_(src[:, s])
