"""Sharded loading: each rank reads only its slices of the checkpoint tensors.

The checkpoint is matched and checked against the whole model's shapes first (built on
the meta device: no memory), exactly as a single-device load checks it; then each rank
copies, part by part, the rows or columns ``sharding.param_shard`` gives it, through
``safe_open``'s memory-mapped slices, so no rank reads another's share of a weight.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from pagedserve.config import ModelConfig
from pagedserve.model.weights import plan_checkpoint, safetensors_files, set_parameter
from pagedserve.parallel.group import TensorParallel
from pagedserve.parallel.sharding import ParamShard, param_shard


def load_sharded_weights(
    model: nn.Module, whole: nn.Module, checkpoint_dir: Path, cfg: ModelConfig,
    tp: TensorParallel, device: torch.device, dtype: torch.dtype, progress: bool = True,
) -> int:
    """Materialize ``model`` (this rank's shard, on the meta device) from the checkpoint;
    ``whole`` is the unsharded model on the meta device, for the checks. Returns the bytes
    of weights this rank holds."""
    plan = plan_checkpoint(whole, safetensors_files(checkpoint_dir), cfg.weight_prefix,
                           cfg.tie_word_embeddings)
    params = dict(model.named_parameters())
    targets = {name: torch.zeros(params[name].shape, dtype=dtype, device=device)
               for name in plan}
    # file -> (name, key, part, first row of the part's rows in this rank's parameter)
    jobs: dict[Path, list[tuple[str, str, int, int]]] = defaultdict(list)
    for name, entries in plan.items():
        shard, row = param_shard(name, cfg, tp), 0
        for part, (key, path, shape) in enumerate(entries):
            jobs[path].append((name, key, part, row))
            if shard is None:
                row += shape[0]
            elif shard.dim == 0:
                row += sum(len(r) for r in shard.ranges[part])
    total = sum(t.numel() * t.element_size() for t in targets.values())
    with tqdm(total=total, unit="B", unit_scale=True, disable=not progress,
              desc=f"Loading weights (rank {tp.rank})") as bar:
        for path, items in jobs.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name, key, part, row in items:
                    shard, dst = param_shard(name, cfg, tp), targets[name]
                    if shard is None:
                        src = f.get_tensor(key)
                        dst[row:row + src.shape[0]].copy_(src)
                    else:
                        _copy_slices(f.get_slice(key), shard, part, dst, row)
                    bar.update(dst.numel() * dst.element_size() // len(plan[name]))
    for name, tensor in targets.items():
        set_parameter(model, name, tensor)
    return total


def _copy_slices(src: Any, shard: ParamShard, part: int, dst: torch.Tensor, row: int) -> None:
    """Copy this rank's ranges of checkpoint part ``part`` (``src``, a safetensors slice:
    only the slices read are materialized) into ``dst`` from row ``row`` (dim 0), or into
    its columns (dim 1, one part)."""
    if shard.dim == 1:
        col = 0
        for r in shard.ranges[0]:
            dst[:, col:col + len(r)].copy_(src[:, r.start:r.stop])
            col += len(r)
        return
    for r in shard.ranges[part]:
        if len(r):
            dst[row:row + len(r)].copy_(src[r.start:r.stop])
        row += len(r)
