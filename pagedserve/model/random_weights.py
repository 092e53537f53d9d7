"""Random weights of a preset shape, made directly on the device: no files, no download.

``--model preset:qwen3.5-27b`` serves the real Qwen3.5-27B shape with seeded random bf16
weights. Its tokens are noise; it exists so that whole-model benchmarks measure the real
shape's memory traffic without a 54 GB checkpoint. Initialization follows transformers'
scheme for Qwen3.5 (normal(0, 0.02) matrices, zero-centred norms, A_log from U(1, 16)).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.model.mtp import MTPHead
from pagedserve.model.qwen3_5 import Qwen3_5Model
from pagedserve.parallel.group import SINGLE, TensorParallel
from pagedserve.parallel.sharding import param_shard, slice_full


def set_param(root: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = root.get_submodule(owner_name) if owner_name else root
    setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))


@torch.no_grad()
def random_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                 seed: int = 0, mtp: bool = False, tp: TensorParallel = SINGLE) -> Qwen3_5Model:
    """pagedserve's decoder of shape ``cfg`` with seeded random weights on ``device``
    (``mtp``: with an MTP draft head, ``model/mtp.py``). ``tp``: this rank's shard of
    the same weights (every rank draws each whole parameter in turn and keeps its slice)."""
    with torch.device("meta"):
        model = Qwen3_5Model(cfg, tp)
        whole = Qwen3_5Model(cfg) if tp.size > 1 else model
        if mtp:
            model.mtp = MTPHead(cfg)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in list(whole.named_parameters()):
        t = torch.empty(p.shape, dtype=dtype, device=device)
        if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
            t.fill_(1.0)
        elif name.endswith("norm.weight"):
            t.zero_()  # zero-centred RMSNorm: 1 + 0
        elif name.endswith("A_log"):
            a = torch.empty(p.shape, device=device).uniform_(1.0, 16.0, generator=gen)
            t.copy_(a.log())
        elif name.endswith("conv1d.weight"):
            t.uniform_(-0.5, 0.5, generator=gen)  # Conv1d default: 1/sqrt(fan_in = K)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        shard = param_shard(name, cfg, tp)
        set_param(model, name, t if shard is None else slice_full(t, shard))
    return model.to(device).eval()
