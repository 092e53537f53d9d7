"""Checkpoint tensors -> FP8 block weights: the published FP8 layout, or bf16 quantized on load.

Runs instead of ``weights.load_weights`` when the model is FP8 (``quant/config.py``). Name
mapping, packing and the missing/unexpected/shape checks are ``weights.plan_tensors``'; what
this module adds, per linear weight and per fused part:

- which parts are FP8: in a serialized checkpoint the tensor's own dtype, cross-checked
  against ``modules_to_not_convert``; with ``--quantization fp8`` the conversion policy;
- the checks of the published format: ``F8_E4M3`` data, a ``<name>_scale_inv`` tensor of
  shape ``[ceil(N/128), ceil(K/128)]`` beside every FP8 weight and none beside the others;
- the module swap: ``nn.Linear`` -> ``Fp8Linear`` when every part is FP8, or a
  ``RowConcatLinear`` of ``Fp8Linear`` and ``nn.Linear`` runs when the parts are mixed.

FP8 data and block scales are copied into their slices of the fused weight as stored (each
part keeps its own block rows, see ``quant/fp8.py``); nothing is dequantized.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

from pagedserve.model.fp8_linear import Fp8Linear, RowConcatLinear, weight_nbytes
from pagedserve.model.weight_footprint import part_rows
from pagedserve.model.weights import (
    checkpoint_key,
    index_tensors,
    packed_sources,
    plan_tensors,
    safetensors_files,
    set_parameter,
    skipped_prefixes,
)
from pagedserve.quant import fp8
from pagedserve.quant.config import Fp8Config

SCALE_SUFFIX = "_scale_inv"  # "<module>.weight" + SCALE_SUFFIX
FP8_STORAGE = "F8_E4M3"  # safetensors' name for float8_e4m3fn


@dataclass
class _Part:
    """One checkpoint tensor's destination: rows ``row:row+n`` of ``data`` and, for FP8,
    scale rows ``scale_row:`` of ``scale``."""

    key: str
    file: Path
    rows: int
    data: torch.Tensor
    row: int
    scale: torch.Tensor | None = None
    scale_row: int = 0
    scale_file: Path | None = None


def load_fp8_weights(
    model: nn.Module, checkpoint_dir: Path, weight_prefix: str, tied: bool,
    device: torch.device, dtype: torch.dtype, quant: Fp8Config, progress: bool = True,
) -> int:
    """Materialize ``model`` (built on the meta device) with FP8 linear weights where
    ``quant`` says so. Returns the bytes of weights on ``device``.

    Raises ``ValueError`` naming the tensor for a missing or misshapen scale, an FP8 tensor
    in the wrong format or place, and a stored dtype that contradicts ``quant``.
    """
    tensors = index_tensors(safetensors_files(checkpoint_dir))
    scales = {k: tensors.pop(k) for k in list(tensors)
              if k.endswith(SCALE_SUFFIX) and not k.startswith(skipped_prefixes(model))}
    plan = plan_tensors(model, tensors, weight_prefix, tied)
    used_scales: set[str] = set()
    parts: list[_Part] = []
    for name, entries in plan.items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        linear = isinstance(owner, nn.Linear) and attr == "weight"
        kinds = [_is_fp8(key, tensors[key][2], linear, quant, scales) for key, _, _ in entries]
        for (key, _, shape), is_fp8 in zip(entries, kinds, strict=True):
            if is_fp8 and quant.serialized:
                _check_scale(key, shape, scales)
                used_scales.add(key + SCALE_SUFFIX)
        if any(kinds):
            parts += _swap_linear(model, owner_name, entries, kinds, scales, device, dtype)
        else:
            shape = (sum(e[2][0] for e in entries), *entries[0][2][1:])
            target = torch.empty(shape, dtype=dtype, device=device)
            set_parameter(model, name, target)
            parts += _dense_parts(entries, target)
    orphans = sorted(set(scales) - used_scales)
    if orphans:
        raise ValueError(
            f"unexpected tensors: {', '.join(orphans[:8])} (scales of no FP8 weight)"
        )
    _copy_parts(parts, quant.serialized, device, progress)
    return weight_nbytes(model)


def _is_fp8(
    key: str, storage: str, linear: bool, quant: Fp8Config, scales: Collection[str],
) -> bool:
    """Whether checkpoint tensor ``key`` becomes FP8, after checking it is where it may be."""
    module = key.removesuffix(".weight")
    stored_fp8 = storage.startswith("F8")
    if not quant.serialized:
        return linear and quant.is_converted(module)
    if stored_fp8 and storage != FP8_STORAGE:
        raise ValueError(
            f"{key} is stored as {storage}; quantization_config.fmt 'e4m3' needs {FP8_STORAGE}"
        )
    if stored_fp8 and not linear:
        raise ValueError(
            f"{key} is stored as {storage}, but only linear projection weights may be FP8"
        )
    if stored_fp8 and not quant.is_converted(module):
        raise ValueError(
            f"{key} is stored as {storage}, but quantization_config.modules_to_not_convert "
            "lists it"
        )
    if linear and not stored_fp8 and quant.is_converted(module):
        raise ValueError(
            f"{key} is stored as {storage}, but quantization_config converts it (it is not in "
            f"modules_to_not_convert): expected {FP8_STORAGE} with {key}{SCALE_SUFFIX}"
        )
    if not stored_fp8 and key + SCALE_SUFFIX in scales:
        raise ValueError(f"unexpected tensors: {key}{SCALE_SUFFIX} (its weight is {storage})")
    return stored_fp8


def _check_scale(
    key: str, shape: tuple[int, ...], scales: dict[str, tuple[Path, tuple[int, ...], str]],
) -> None:
    scale_key = key + SCALE_SUFFIX
    if scale_key not in scales:
        raise ValueError(f"missing scale tensor {scale_key} for the FP8 weight {key}")
    _, scale_shape, storage = scales[scale_key]
    expected = fp8.scale_shape(shape[0], shape[1])
    if tuple(scale_shape) != expected:
        raise ValueError(
            f"{scale_key} has shape {list(scale_shape)}; a {list(shape)} weight in "
            f"{fp8.BLOCK}x{fp8.BLOCK} blocks needs {list(expected)}"
        )
    if storage not in ("F32", "BF16", "F16"):
        raise ValueError(f"{scale_key} is stored as {storage}; accepted: F32, BF16, F16")


def runs_of(kinds: list[bool]) -> list[tuple[bool, int, int]]:
    """``[(is_fp8, first part, end part), ...]``: maximal runs of like parts."""
    runs: list[tuple[bool, int, int]] = []
    for i, kind in enumerate(kinds):
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], i + 1)
        else:
            runs.append((kind, i, i + 1))
    return runs


def _swap_linear(
    model: nn.Module, module_name: str, entries: list[tuple[str, Path, tuple[int, ...]]],
    kinds: list[bool], scales: dict[str, tuple[Path, tuple[int, ...], str]],
    device: torch.device, dtype: torch.dtype,
) -> list[_Part]:
    """Replace ``nn.Linear`` ``module_name`` by its FP8 form; returns the copies to make."""
    old = model.get_submodule(module_name)
    assert isinstance(old, nn.Linear) and old.bias is None  # decoder projections are bias-free
    children: list[nn.Module] = []
    parts: list[_Part] = []
    for is_fp8, first, end in runs_of(kinds):
        run = entries[first:end]
        rows = tuple(e[2][0] for e in run)
        if is_fp8:
            child = Fp8Linear(old.in_features, rows, device)
            scale_row = 0
            row = 0
            for (key, file, _), n in zip(run, rows, strict=True):
                scale = scales.get(key + SCALE_SUFFIX)  # None under --quantization fp8
                scale_file = None if scale is None else scale[0]
                parts.append(_Part(key, file, n, child.weight, row, child.weight_scale_inv,
                                   scale_row, scale_file))
                row += n
                scale_row += fp8.num_blocks(n)
        else:
            child = nn.Linear(old.in_features, sum(rows), bias=False, device="meta")
            target = torch.empty(sum(rows), old.in_features, dtype=dtype, device=device)
            child.weight = nn.Parameter(target, requires_grad=False)
            parts += _dense_parts(run, target)
        children.append(child)
    new = children[0] if len(children) == 1 else RowConcatLinear(children)
    owner_name, _, attr = module_name.rpartition(".")
    setattr(model.get_submodule(owner_name) if owner_name else model, attr, new)
    return parts


def _dense_parts(
    entries: list[tuple[str, Path, tuple[int, ...]]], target: torch.Tensor,
) -> list[_Part]:
    out, row = [], 0
    for key, file, shape in entries:
        out.append(_Part(key, file, shape[0], target, row))
        row += shape[0]
    return out


@torch.no_grad()
def _copy_parts(parts: list[_Part], serialized: bool, device: torch.device,
                progress: bool) -> None:
    """Copy (serialized) or quantize (``--quantization fp8``) every part into place, opening
    each file once."""
    jobs: dict[Path, list[tuple[_Part, bool]]] = defaultdict(list)
    for part in parts:
        jobs[part.file].append((part, False))
        if part.scale_file is not None:
            jobs[part.scale_file].append((part, True))
    total = sum(p.rows * _row_bytes(p.data) for p in parts)
    with tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights",
              disable=not progress) as bar:
        for path, items in jobs.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for part, is_scale in items:
                    _copy_one(f, part, is_scale, serialized, device)
                    if not is_scale:
                        bar.update(part.rows * _row_bytes(part.data))


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def _copy_one(f: Any, part: _Part, is_scale: bool, serialized: bool, device: torch.device) -> None:
    rows = slice(part.row, part.row + part.rows)
    if is_scale:
        assert part.scale is not None
        src = f.get_tensor(part.key + SCALE_SUFFIX)
        part.scale[part.scale_row : part.scale_row + src.shape[0]].copy_(src.float())
    elif part.scale is None or serialized:
        part.data[rows].copy_(f.get_tensor(part.key))
    else:  # --quantization fp8: quantize this part on its own block grid
        q, scale = fp8.quantize(f.get_tensor(part.key).to(device))
        part.data[rows].copy_(q)
        part.scale[part.scale_row : part.scale_row + scale.shape[0]].copy_(scale)


@dataclass(frozen=True)
class PackedLinear:
    """A linear layer of ``model`` and the checkpoint parts fused into its rows."""

    name: str  # the module's name in the model
    module: nn.Linear
    rows: tuple[int, ...]  # output rows of each part, in order
    sources: list[str]  # each part's prefix-free weight name
    converted: list[bool]  # which parts the FP8 config converts


def packed_linears(model: nn.Module, weight_prefix: str,
                   quant: Fp8Config) -> Iterator[PackedLinear]:
    """Every linear layer of ``model`` with its parts and which of them ``quant``
    converts."""
    for name, sources in packed_sources(model).items():
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        if not (isinstance(owner, nn.Linear) and attr == "weight"):
            continue
        packer = model.get_submodule(owner_name.rpartition(".")[0])
        rows = part_rows(packer, owner.weight.shape[0], len(sources))
        kinds = [quant.is_converted(checkpoint_key(s, weight_prefix).removesuffix(".weight"))
                 for s in sources]
        yield PackedLinear(owner_name, owner, rows, list(sources), kinds)


@torch.no_grad()
def quantize_linears(model: nn.Module, weight_prefix: str, quant: Fp8Config) -> None:
    """Quantize, in place, the loaded linear weights of ``model`` that ``quant`` converts,
    each fused part on its own block grid (for models made without a checkpoint, such as
    the random-weight presets). The float weights are released as each layer is done."""
    for linear in packed_linears(model, weight_prefix, quant):
        owner_name, owner, rows, kinds = (linear.name, linear.module, linear.rows,
                                          linear.converted)
        if not any(kinds):
            continue
        pieces = owner.weight.split(rows)
        children: list[nn.Module] = []
        for is_fp8, first, end in runs_of(kinds):
            child: nn.Module
            if is_fp8:
                child = Fp8Linear(owner.in_features, rows[first:end], owner.weight.device)
                row = scale_row = 0
                for piece in pieces[first:end]:
                    q, scale = fp8.quantize(piece)
                    child.weight[row : row + q.shape[0]].copy_(q)
                    child.weight_scale_inv[scale_row : scale_row + scale.shape[0]].copy_(scale)
                    row += q.shape[0]
                    scale_row += scale.shape[0]
            else:
                dense = nn.Linear(owner.in_features, sum(rows[first:end]), bias=False,
                                  device="meta")
                dense.weight = nn.Parameter(torch.cat(pieces[first:end]), requires_grad=False)
                child = dense
            children.append(child)
        new = children[0] if len(children) == 1 else RowConcatLinear(children)
        parent_name, _, child_attr = owner_name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child_attr, new)
