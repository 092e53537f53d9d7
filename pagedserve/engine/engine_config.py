"""``EngineConfig``: everything an engine needs to start, checked before any weight loads.

Errors name the CLI flag of the bad field (``num_blocks`` -> ``--num-blocks``), so that
``pagedserve serve`` and the offline ``LLM`` API refuse a bad combination at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.config import CacheConfig
from pagedserve.engine.prefix_cache import DEFAULT_CHECKPOINT_INTERVAL
from pagedserve.engine.scheduler import SchedulerConfig
from pagedserve.engine.speculative import SpeculativeConfig
from pagedserve.plan import parse_checkpoint_memory
from pagedserve.quant.names import QUANTIZATIONS


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to start an engine; checked once, before any weight is loaded.

    ``model=None`` serves the embedded default model. ``max_model_len=None`` takes the
    smaller of 4096 and the model's ``max_position_embeddings``. Errors name the CLI flag
    of the field (``num_blocks`` -> ``num-blocks``). Prefix caching (``prefix_cache.py``)
    is on by default with the paged layout; its state checkpoints take
    ``prefix_checkpoint_memory`` (a size such as ``"4GiB"``, ``"0"`` for none; ``None``:
    the default budget). Tensor parallelism leaves prefix caching, async scheduling,
    speculative decoding and FP8 weights off (``_check_tensor_parallel``).
    """

    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    # "fp8": FP8 block weights from a bf16 checkpoint (an FP8 checkpoint is FP8 without it).
    quantization: str | None = None
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    kv_layout: str = "paged"
    block_size: int = 16
    max_model_len: int | None = None
    max_num_seqs: int = 8
    # Step sizes; None takes the device's defaults (``scheduler.STEP_SIZES``).
    max_num_batched_tokens: int | None = None
    prefill_chunk: int | None = None
    idle_prefill_chunk: int | None = None
    num_blocks: int | None = None
    gpu_memory_utilization: float = 0.90
    cuda_graphs: bool = True
    async_scheduling: bool | None = None  # None: on for CUDA, off for the CPU
    # Compile and tune every kernel a request can reach before the engine is ready
    # (``warmup.py``). None: on for CUDA; the CPU path runs torch ops, nothing compiles.
    warm_up: bool | None = None
    seed: int = 0
    check_integrity: bool = False  # run the pools' invariant checks after every step
    progress: bool = True
    # None: on (with the paged layout).
    enable_prefix_caching: bool | None = None
    prefix_checkpoint_memory: str | None = None
    prefix_checkpoint_interval: int = DEFAULT_CHECKPOINT_INTERVAL
    # ``--speculative-config``: vLLM's JSON (or its dict), ``engine/speculative.py``.
    speculative_config: str | dict | None = None
    # ``--tensor-parallel-size``: one process per device, each holding 1/N of every layer's
    # heads (``parallel/``, ``docs/tensor-parallel.md``).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name, value, lowest in (
                ("max-num-seqs", self.max_num_seqs, 1),
                ("max-num-batched-tokens", self.max_num_batched_tokens, 1),
                ("prefill-chunk", self.prefill_chunk, 1),
                ("idle-prefill-chunk", self.idle_prefill_chunk, 1),
                ("num-blocks", self.num_blocks, 1),
                ("max-model-len", self.max_model_len, 2),
                ("prefix-checkpoint-interval", self.prefix_checkpoint_interval, 1)):
            if value is not None and (not isinstance(value, int) or value < lowest):
                raise ValueError(f"{name} must be >= {lowest}, got {value!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError("gpu-memory-utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        self.checkpoint_memory_bytes()  # raises on a bad size
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device {self.device!r} is not supported; accepted: cpu, cuda")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for, but CUDA is not available")
        CacheConfig(self.cache_type_k, self.cache_type_v, self.block_size, self.kv_layout)
        self.speculative()  # raises on a bad config or an unsupported combination
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization {self.quantization!r} is not supported; "
                             f"accepted: {QUANTIZATIONS}")
        self._check_tensor_parallel()
        # The step sizes, checked now rather than after the weights load.
        SchedulerConfig.for_device(
            torch.device(self.device).type, max_num_seqs=self.max_num_seqs,
            max_model_len=self.max_model_len or 4096, prefill_chunk=self.prefill_chunk,
            idle_prefill_chunk=self.idle_prefill_chunk,
            max_num_batched_tokens=self.max_num_batched_tokens)

    def _check_tensor_parallel(self) -> None:
        """What ``--tensor-parallel-size`` needs and what it does not cover yet (the head
        counts are checked against the model's config before its weights load)."""
        n = self.tensor_parallel_size
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"tensor-parallel-size must be >= 1, got {n!r}")
        if n == 1:
            return
        flag = f"--tensor-parallel-size {n}"
        if self.device.startswith("cuda"):
            if self.device != "cuda":
                raise ValueError(f"{flag} runs rank r on cuda:r; pass --device cuda, not "
                                 f"{self.device!r}")
            if torch.cuda.device_count() < n:
                raise ValueError(f"{flag} needs {n} GPUs, but {torch.cuda.device_count()} "
                                 f"are visible")
        unsupported = (
            ("--speculative-config", self.speculative_config is not None),
            ("--quantization", self.quantization is not None),
            ("--enable-prefix-caching", bool(self.enable_prefix_caching)),
            ("--async-scheduling", bool(self.async_scheduling)),
        )
        for other, given in unsupported:
            if given:
                raise ValueError(f"{flag} does not support {other} yet")

    def cache_config(self) -> CacheConfig:
        return CacheConfig(self.cache_type_k, self.cache_type_v, self.block_size, self.kv_layout)

    def checkpoint_memory_bytes(self) -> int | None:
        return parse_checkpoint_memory(self.prefix_checkpoint_memory)

    def speculative(self) -> SpeculativeConfig | None:
        """The parsed ``speculative_config``; raises ``ValueError`` for a bad one and for
        what speculative steps do not support (``engine/spec_step.py``)."""
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.parse(self.speculative_config)

    @property
    def prefix_caching(self) -> bool:
        """Whether prefix caching is asked for: ``enable_prefix_caching``, by default on."""
        if self.enable_prefix_caching is None:
            return self.tensor_parallel_size == 1
        return self.enable_prefix_caching
