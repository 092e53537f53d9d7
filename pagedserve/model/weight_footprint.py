"""Bytes of a model's weights on the device, from its config alone (nothing is loaded).

Counts exactly what the loader allocates: every parameter in the model dtype, except the
linear weights that are FP8 (``quant/config.py`` decides which), which take 1 byte per
parameter plus a float32 scale per 128x128 block of each fused part. ``pagedserve plan``
uses it to size the K/V pool before any weight exists; a loaded model's
``LoadedModel.weights_bytes`` is the same number measured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.config import ModelConfig
from pagedserve.model.mtp import MTPHead
from pagedserve.model.qwen3_5 import Qwen3_5Model
from pagedserve.model.weights import checkpoint_key, packed_sources
from pagedserve.quant import fp8
from pagedserve.quant.config import Fp8Config


@dataclass(frozen=True)
class WeightFootprint:
    """Weight bytes by storage: FP8 data, their block scales, and the model-dtype rest."""

    fp8_bytes: int
    scale_bytes: int
    dense_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.fp8_bytes + self.scale_bytes + self.dense_bytes

    def as_dict(self) -> dict[str, int]:
        return {"fp8_bytes": self.fp8_bytes, "scale_bytes": self.scale_bytes,
                "dense_bytes": self.dense_bytes, "total_bytes": self.total_bytes}


def part_rows(packer: nn.Module, rows: int, num_parts: int) -> tuple[int, ...]:
    """Row count of each fused part of a projection of ``packer`` (the module whose
    ``PACKED`` names the parts): its ``split`` where it has one (attention, GDN), else equal
    parts (gate/up)."""
    split = getattr(packer, "split", None)
    if num_parts > 1 and split is not None:
        return tuple(split)
    return (rows // num_parts,) * num_parts


def weight_footprint(
    cfg: ModelConfig, dtype: torch.dtype, quant: Fp8Config | None = None, mtp: bool = False,
) -> WeightFootprint:
    """The weights of ``cfg`` in ``dtype``, with FP8 linear weights where ``quant`` says;
    with ``mtp``, the MTP head's too (as the loader builds it for speculation)."""
    with torch.device("meta"):
        model = Qwen3_5Model(cfg)
        if mtp:
            model.mtp = MTPHead(cfg)
    dense_size = torch.empty(0, dtype=dtype).element_size()
    fp8_bytes = scale_bytes = dense_bytes = 0
    for name, sources in packed_sources(model).items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        param = getattr(owner, attr)
        if quant is None or not (isinstance(owner, nn.Linear) and attr == "weight"):
            dense_bytes += param.numel() * dense_size
            continue
        cols = param.shape[1]
        packer = model.get_submodule(owner_name.rpartition(".")[0])
        for source, rows in zip(sources, part_rows(packer, param.shape[0], len(sources)),
                                strict=True):
            full = checkpoint_key(source, cfg.weight_prefix).removesuffix(".weight")
            if quant.is_converted(full):
                fp8_bytes += rows * cols
                nb, kb = fp8.scale_shape(rows, cols)
                scale_bytes += nb * kb * 4
            else:
                dense_bytes += rows * cols * dense_size
    return WeightFootprint(fp8_bytes, scale_bytes, dense_bytes)
