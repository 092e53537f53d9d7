"""Starting a tensor-parallel engine: check the model, spawn the workers, load rank 0."""

from __future__ import annotations

import time

import torch

from pagedserve.config import ModelConfig
from pagedserve.engine.engine_config import EngineConfig
from pagedserve.engine.runner import RunnerConfig
from pagedserve.model.loader import (
    LoadedModel,
    check_parallel_support,
    check_supported,
    load_model,
    parse_dtype,
    read_model_config,
)
from pagedserve.parallel.launch import WorkerGroup, cpu_threads_per_rank
from pagedserve.parallel.runner import TensorParallelRunner
from pagedserve.parallel.worker import WorkerSpec
from pagedserve.quant.config import parse_quantization


def tensor_parallel_model(config: EngineConfig) -> tuple[ModelConfig, torch.dtype]:
    """The model's config and dtype, once every check that needs no weight has passed
    (the head counts against ``tensor_parallel_size`` among them)."""
    device = torch.device(config.device)
    dtype = parse_dtype(config.dtype, device)
    path, raw, cfg = read_model_config(config.model)
    check_supported(cfg, raw, device, dtype)
    fp8 = parse_quantization(raw, config.quantization) is not None
    check_parallel_support(cfg, config.tensor_parallel_size, fp8, False,
                           str(config.model or path))
    return cfg, dtype


def start_tensor_parallel(config: EngineConfig, runner_config: RunnerConfig,
                          seconds: dict[str, float]) -> tuple[LoadedModel, TensorParallelRunner]:
    """Spawn ranks 1..N-1, load rank 0's shard here and build its runner; adds the
    loading time to ``seconds["weights"]``. The workers are stopped if anything fails."""
    started = time.perf_counter()
    size = config.tensor_parallel_size
    device_type = torch.device(config.device).type
    threads = cpu_threads_per_rank(size) if device_type == "cpu" else None
    spec = WorkerSpec(config.model, device_type, config.dtype, config.cache_config(),
                      runner_config, threads)
    workers = WorkerGroup.start(size, spec)
    try:
        if threads is not None:
            workers.share_cpu(threads)
        device = torch.device("cuda:0" if device_type == "cuda" else "cpu")
        with workers.watch():
            loaded = load_model(config.model, device, config.dtype, progress=config.progress,
                                tp=workers.tp)
        seconds["weights"] += time.perf_counter() - started
        runner = TensorParallelRunner(loaded.model, config.cache_config(), runner_config,
                                      workers)
    except BaseException:
        workers.close()
        raise
    return loaded, runner
