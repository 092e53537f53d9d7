"""``pagedserve plan``: K/V blocks and state slots that fit a memory budget."""

from __future__ import annotations

import argparse
import json

import torch

from pagedserve import plan as planning
from pagedserve import presets
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.engine.prefix_cache import num_checkpoints_for
from pagedserve.kv import formats

HELP = "capacity plan: K/V blocks and state slots that fit a memory budget"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="config.json path, checkpoint directory, or preset:NAME "
                        f"(presets: {', '.join(presets.names())})")
    p.add_argument("--cache-type-k", default="f16", choices=formats.KV_TYPES)
    p.add_argument("--cache-type-v", default="f16", choices=formats.KV_TYPES)
    p.add_argument("--block-size", type=int, default=16)
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", help="K/V + state budget, e.g. 40GiB, 3.5e9")
    budget.add_argument("--gpu-memory-fraction", type=float,
                        help="budget as a fraction of the GPU's free memory, in (0, 1]")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="longest sequence to plan for (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--max-num-seqs", type=int, default=8,
                   help="concurrent sequences, one state slot each (default 8)")
    p.add_argument("--seq-lens", default=None,
                   help="also compare paged vs padded K/V for these live sequences, "
                        "e.g. 131072,8192x7")
    p.add_argument("--prefix-checkpoint-memory", default=None,
                   help="prefix-cache state checkpoint budget, e.g. 4GiB, 0 for none "
                        "(default: the engine's, at most 4 GiB and max(64, 8 x "
                        "max-num-seqs) checkpoints)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def resolve_config(model: str) -> ModelConfig:
    preset = presets.preset_name(model)
    if preset is not None:
        return ModelConfig.from_path(presets.config_path(preset))
    return ModelConfig.from_path(model)


def run(args: argparse.Namespace) -> int:
    model = resolve_config(args.model)
    cache = CacheConfig(args.cache_type_k, args.cache_type_v, args.block_size)
    if args.memory is not None:
        budget = planning.parse_bytes(args.memory)
    else:
        budget = planning.gpu_free_bytes(args.gpu_memory_fraction)
    max_len = args.max_model_len or model.max_position_embeddings
    per_checkpoint = model.state_shapes(torch.bfloat16).bytes_per_slot
    checkpoints = num_checkpoints_for(
        planning.parse_checkpoint_memory(args.prefix_checkpoint_memory), per_checkpoint,
        args.max_num_seqs)
    result = planning.plan_capacity(model, cache, budget, args.max_num_seqs, max_len,
                                    num_checkpoints=checkpoints)
    report = None
    if args.seq_lens:
        report = planning.workload_report(
            planning.footprint(model, cache), planning.parse_seq_lens(args.seq_lens)
        )
    if args.json:
        out = {"plan": result.as_dict()}
        if report is not None:
            out["workload"] = report.as_dict()
        print(json.dumps(out))
    else:
        print(planning.format_plan(model, cache, result))
        if report is not None:
            print(planning.format_workload(report))
    return 0
