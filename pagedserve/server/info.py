"""What a server runs on and with: the ``/server_info`` body, the start-up line, and the
facts a benchmark report records (device name, source commit)."""

from __future__ import annotations

import functools
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

import pagedserve
from pagedserve.server.context import ServingContext

READY_PREFIX = "pagedserve ready at "  # launchers wait for this, then read the URL after it


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_name()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.cache  # asked once per process: /server_info must not block the loop on git
def source_commit() -> str | None:
    """The git commit of pagedserve's source tree (``+dirty`` if edited), if it is one.

    ``$PAGEDSERVE_COMMIT`` overrides it, for machines that get the tree without ``.git``
    (as the benchmark scripts under ``benchmarks/`` do).
    """
    if os.environ.get("PAGEDSERVE_COMMIT"):
        return os.environ["PAGEDSERVE_COMMIT"]
    root = Path(pagedserve.__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"],
                                capture_output=True, text=True, timeout=5, check=True)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def server_info(ctx: ServingContext) -> dict[str, Any]:
    """Model, engine and cache configuration of a running server."""
    llm = ctx.llm
    cfg, runner = llm.config, llm.runner
    return {
        "model": ctx.model_name,
        "served_model_names": list(ctx.served_model_names),
        "model_path": str(llm.loaded.path),
        "vocab_size": llm.vocab_size,
        "max_model_len": ctx.max_model_len,
        "device": str(runner.device),
        "device_name": device_name(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_layout": cfg.kv_layout,
        "cache_type_k": cfg.cache_type_k,
        "cache_type_v": cfg.cache_type_v,
        "block_size": runner.block_size,
        "num_blocks": runner.num_blocks,
        "num_state_slots": runner.state_pool.num_slots,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": llm.scheduler.config.max_num_batched_tokens,
        "prefill_chunk": llm.scheduler.config.prefill_chunk,
        "idle_prefill_chunk": llm.scheduler.config.idle_prefill_chunk,
        "max_queue": ctx.admission.max_queue,
        "cuda_graphs": runner.graphs is not None,
        "prefix_caching": llm.prefix is not None,
        "prefix_checkpoints": runner.checkpoint_pool.num_checkpoints,
        "prefix_checkpoint_bytes": runner.checkpoint_pool.bytes_per_checkpoint,
        "prefix_checkpoint_interval": llm.config.prefix_checkpoint_interval,
        "reasoning_parser": ctx.reasoning_parser,
        "tool_call_parser": ctx.tool_call_parser,
        "pagedserve_version": pagedserve.__version__,
        "torch_version": torch.__version__,
        "commit": source_commit(),
        "startup_seconds": dict(llm.startup_seconds),
    }


def ready_line(ctx: ServingContext, url: str) -> str:
    """The one line logged when the server accepts connections."""
    i = server_info(ctx)
    queue = "unbounded" if i["max_queue"] is None else i["max_queue"]
    return (f"{READY_PREFIX}{url} | model {i['model']} ({i['model_path']}) on "
            f"{i['device']} {i['dtype']} | kv {i['kv_layout']}, K {i['cache_type_k']} / "
            f"V {i['cache_type_v']}, {i['num_blocks']} blocks x {i['block_size']} tokens | "
            f"{i['num_state_slots']} state slots, max-num-seqs {i['max_num_seqs']}, "
            f"max-model-len {i['max_model_len']}, max-queue {queue} | prefix caching "
            + (f"on, {i['prefix_checkpoints']} state checkpoints" if i["prefix_caching"]
               else "off")
            + " | started in " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s"
                                           for k, v in i["startup_seconds"].items()))
