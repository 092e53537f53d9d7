"""Checkpoint tensors -> model parameters: name mapping, validation, streaming load.

Checkpoint names carry a layout prefix that is stripped to get the module's names::

    text-only  Qwen3_5ForCausalLM                model.<name>                  lm_head.weight
    published  Qwen3_5ForConditionalGeneration   model.language_model.<name>   lm_head.weight
                                                 model.visual.*                (skipped)
    both                                         mtp.<name>                    mtp.<name>

``mtp.*`` (the MTP draft head, ``mtp.py``) loads only into a model that has one
(``Qwen3_5Model.mtp``); otherwise it is skipped with the vision tower. Its names are the
module's own, prefix and all.

Three module parameters are row-wise concatenations of checkpoint tensors (``PACKED`` on
the module that owns them); every other parameter is one tensor of the same name. The
safetensors files are memory-mapped and each tensor is copied straight into its slice of
the parameter, on the target device and in the target dtype, so no second full copy of
the weights is ever held. FP8 models load through ``fp8_weights.py`` on the same plan.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm.auto import tqdm

# Tensors of the published checkpoints that a text-only server does not use.
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
MTP_PREFIX = "mtp."
LM_HEAD = "lm_head.weight"
_MAX_LISTED = 8


def packed_sources(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """Module parameter name -> the checkpoint names (prefix removed) it is built from."""
    packed: dict[str, tuple[str, ...]] = {}
    for mod_name, module in model.named_modules():
        base = f"{mod_name}." if mod_name else ""
        for name, parts in getattr(module, "PACKED", {}).items():
            packed[base + name] = tuple(base + p for p in parts)
    return {name: packed.get(name, (name,)) for name, _ in model.named_parameters()}


def skipped_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Checkpoint prefixes ``model`` does not load: ``mtp.`` too unless it has the head."""
    if getattr(model, "mtp", None) is not None:
        return tuple(p for p in SKIPPED_PREFIXES if p != MTP_PREFIX)
    return SKIPPED_PREFIXES


def checkpoint_key(name: str, weight_prefix: str) -> str:
    """The checkpoint name of prefix-free module name ``name``."""
    return name if name == LM_HEAD or name.startswith(MTP_PREFIX) else weight_prefix + name


def safetensors_files(checkpoint_dir: Path) -> list[Path]:
    """The weight files: those named by ``model.safetensors.index.json``, else every
    ``*.safetensors`` file in the directory."""
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map") or {}
        files = sorted({checkpoint_dir / name for name in weight_map.values()})
        absent = [str(p.name) for p in files if not p.is_file()]
        if absent:
            raise ValueError(f"{index} names shard(s) that are not there: {absent}")
    else:
        files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {checkpoint_dir}")
    return files


def index_tensors(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...], str]]:
    """Checkpoint tensor name -> (file, shape, safetensors dtype such as ``"BF16"``,
    ``"F8_E4M3"``), read from the headers only."""
    found: dict[str, tuple[Path, tuple[int, ...], str]] = {}
    for path in files:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                info = f.get_slice(key)
                found[key] = (path, tuple(info.get_shape()), info.get_dtype())
    return found


def _listing(names: list[str]) -> str:
    names = sorted(names)
    more = f" (and {len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def plan_checkpoint(
    model: nn.Module, files: list[Path], weight_prefix: str, tied: bool,
) -> dict[str, list[tuple[str, Path, tuple[int, ...]]]]:
    """Match checkpoint tensors to parameters and check that they fit.

    Returns ``{param name: [(checkpoint key, file, shape), ...]}`` in row order. Raises
    ``ValueError`` naming missing tensors, unexpected tensors and shape mismatches.
    """
    return plan_tensors(model, index_tensors(files), weight_prefix, tied)


def plan_tensors(
    model: nn.Module, tensors: dict[str, tuple[Path, tuple[int, ...], str]],
    weight_prefix: str, tied: bool,
) -> dict[str, list[tuple[str, Path, tuple[int, ...]]]]:
    """``plan_checkpoint`` over an index of the checkpoint's tensors (``index_tensors``)."""
    by_name: dict[str, str] = {}  # prefix-free name -> checkpoint key
    unexpected: list[str] = []
    skipped = skipped_prefixes(model)
    for key in tensors:
        if key.startswith(skipped):
            continue
        if key == LM_HEAD:
            if not tied:  # a tied checkpoint may still carry a copy; the embedding wins
                by_name[LM_HEAD] = key
        elif key.startswith(MTP_PREFIX):
            by_name[key] = key
        elif key.startswith(weight_prefix):
            by_name[key[len(weight_prefix):]] = key
        else:
            unexpected.append(key)
    sources = packed_sources(model)
    needed = {s for srcs in sources.values() for s in srcs}
    missing = sorted(n for n in needed if n not in by_name)
    unexpected += [by_name[n] for n in by_name if n not in needed]
    if missing or unexpected:
        parts = []
        if missing:
            keys = [checkpoint_key(m, weight_prefix) for m in missing]
            parts.append(f"missing tensors: {_listing(keys)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_listing(unexpected)}")
        raise ValueError(
            "checkpoint does not match a dense Qwen3.5 decoder of its config.json; "
            + "; ".join(parts)
        )
    params = dict(model.named_parameters())
    plan: dict[str, list[tuple[str, Path, tuple[int, ...]]]] = {}
    for name, srcs in sources.items():
        entries = [(by_name[s], *tensors[by_name[s]][:2]) for s in srcs]
        _check_fit(name, tuple(params[name].shape), entries)
        plan[name] = entries
    return plan


def _check_fit(
    name: str, shape: tuple[int, ...], entries: list[tuple[str, Path, tuple[int, ...]]]
) -> None:
    rows = sum(e[2][0] for e in entries)
    tails = {e[2][1:] for e in entries}
    if rows != shape[0] or tails != {shape[1:]}:
        got = ", ".join(f"{key} {list(s)}" for key, _, s in entries)
        raise ValueError(f"checkpoint tensor shape mismatch for {name} {list(shape)}: {got}")


def load_weights(
    model: nn.Module,
    checkpoint_dir: Path,
    weight_prefix: str,
    tied: bool,
    device: torch.device,
    dtype: torch.dtype,
    progress: bool = True,
) -> int:
    """Materialize every parameter of ``model`` (built on the meta device) from the
    checkpoint, on ``device`` in ``dtype``. Returns the bytes of weights loaded."""
    plan = plan_checkpoint(model, safetensors_files(checkpoint_dir), weight_prefix, tied)
    params = dict(model.named_parameters())
    targets = {
        name: torch.empty(params[name].shape, dtype=dtype, device=device) for name in plan
    }
    # Group copies by file so that each file is opened (and mapped) once.
    jobs: dict[Path, list[tuple[str, str, int]]] = defaultdict(list)
    for name, entries in plan.items():
        row = 0
        for key, path, shape in entries:
            jobs[path].append((name, key, row))
            row += shape[0]
    total = sum(t.numel() * t.element_size() for t in targets.values())
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="Loading weights", disable=not progress
    ) as bar:
        for path, items in jobs.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for name, key, row in items:
                    src = f.get_tensor(key)
                    dst = targets[name]
                    dst[row : row + src.shape[0]].copy_(src)
                    bar.update(src.numel() * dst.element_size())
    for name, tensor in targets.items():
        set_parameter(model, name, tensor)
    return total


def set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    owner_name, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    setattr(owner, attr, nn.Parameter(tensor, requires_grad=False))
