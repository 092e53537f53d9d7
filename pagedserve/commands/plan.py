"""``pagedserve plan``: K/V blocks and state slots that fit a memory budget.

Every flag is checked before anything is planned: ``--max-model-len`` must be in
``[2, max_position_embeddings]`` and no ``--seq-lens`` entry may exceed it."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve import presets
from pagedserve.kv.type_names import KV_TYPES
from pagedserve.quant.names import QUANTIZATIONS

if TYPE_CHECKING:
    import torch

    from pagedserve.config import ModelConfig
    from pagedserve.engine.speculative import SpeculativeConfig
    from pagedserve.plan import SpeculativeFootprint

HELP = "capacity plan: K/V blocks and state slots that fit a memory budget"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="config.json path, checkpoint directory, or preset:NAME "
                        f"(presets: {', '.join(presets.names())})")
    p.add_argument("--cache-type-k", default="f16", choices=KV_TYPES)
    p.add_argument("--cache-type-v", default="f16", choices=KV_TYPES)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16",
                   help="model dtype of the weights (default bfloat16)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="fp8: count the linear weights as FP8 128x128 block weights (a "
                        "checkpoint with an FP8 quantization_config is counted as FP8 anyway)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--memory", help="K/V + state budget, e.g. 40GiB, 3.5e9")
    budget.add_argument("--gpu-memory-fraction", type=float,
                        help="budget as a fraction of the GPU's free memory, in (0, 1]")
    budget.add_argument("--device-memory",
                        help="the device's total memory, e.g. 141GiB: the K/V + state budget "
                             "is what the engine leaves, --gpu-memory-utilization of it less "
                             "the weights and the activation reserve")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                   help="with --device-memory: the share the engine may use (default 0.90)")
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
    p.add_argument("--speculative-config", default=None,
                   help='as serve\'s, e.g. \'{"method": "mtp", "num_speculative_tokens": 3, '
                        '"draft_vocab_size": 32768}\': count the MTP head\'s weights and K/V, '
                        "the spare state slots and the checkpoints' hidden rows; with "
                        "--device-memory also the draft vocabulary's LM-head rows and the "
                        "speculative CUDA graphs' buffers (for --max-num-seqs sequences)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def read_raw_config(model: str) -> dict[str, Any]:
    preset = presets.preset_name(model)
    path = presets.config_path(preset) if preset is not None else Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {model!r}")
    with open(path) as f:
        raw: dict[str, Any] = json.load(f)
    return raw


def resolve_config(model: str) -> ModelConfig:
    from pagedserve.config import ModelConfig

    return ModelConfig.from_hf_dict(read_raw_config(model))


def check_lengths(max_model_len: int | None, max_position_embeddings: int,
                  seq_lens: list[int]) -> int:
    """The length to plan for; ``ValueError`` naming the flag that is out of range."""
    if max_model_len is not None and not 2 <= max_model_len <= max_position_embeddings:
        raise ValueError(f"--max-model-len must be in [2, {max_position_embeddings}] (the "
                         f"model's max_position_embeddings), got {max_model_len}")
    max_len = max_model_len or max_position_embeddings
    too_long = [n for n in seq_lens if n > max_len]
    if too_long:
        raise ValueError(f"--seq-lens {too_long[0]} is longer than the planned maximum "
                         f"length {max_len} (--max-model-len, or the model's "
                         "max_position_embeddings)")
    return max_len


def checkpoint_dir(model: str) -> Path:
    """The directory of ``--model``'s config.json (a preset's: the presets folder)."""
    preset = presets.preset_name(model)
    path = presets.config_path(preset) if preset is not None else Path(model)
    return path if path.is_dir() else path.parent


def speculation_footprint(model_arg: str, spec: SpeculativeConfig, model: ModelConfig,
                          dtype: torch.dtype, max_num_seqs: int) -> SpeculativeFootprint:
    """What the engine allocates for ``spec`` on a GPU with CUDA graphs: the draft
    vocabulary as the engine takes it (the checkpoint's tokenizer and EOS ids; a preset
    loads neither), its LM-head rows, and the speculative graphs' buffers."""
    from pagedserve.engine.draft_vocab import draft_vocab, subset_bytes
    from pagedserve.engine.runner import speculative_graph_bytes
    from pagedserve.model.loader import generation_defaults, load_tokenizer
    from pagedserve.plan import SpeculativeFootprint

    ids = None
    if spec.draft_vocab_size is not None:
        tok: Any = None
        eos: tuple[int, ...] = ()
        if presets.preset_name(model_arg) is None:
            path = checkpoint_dir(model_arg)
            tok = load_tokenizer(path)
            eos = generation_defaults(path, model, tok).eos_token_ids
        ids = draft_vocab(spec.draft_vocab_size, model.vocab_size, tok, eos)
    rows = model.vocab_size if ids is None else len(ids)
    k = spec.num_speculative_tokens
    return SpeculativeFootprint(
        num_speculative_tokens=k, vocab_size=model.vocab_size, draft_vocab_rows=rows,
        draft_head_bytes=0 if ids is None else subset_bytes(rows, model.hidden_size, dtype),
        graph_bytes=speculative_graph_bytes(model, k + 1, max_num_seqs, dtype, rows),
        max_graph_seqs=max_num_seqs)


def default_tap_slots(num_checkpoints: int, max_num_seqs: int, max_model_len: int) -> int:
    """The spare state slots the engine adds for state taps at its CUDA step sizes and
    checkpoint interval (none without checkpoints)."""
    from pagedserve.engine.prefix_cache import DEFAULT_CHECKPOINT_INTERVAL, tap_slots_for
    from pagedserve.engine.scheduler import SchedulerConfig

    if num_checkpoints == 0:
        return 0
    sizes = SchedulerConfig.for_device("cuda", max_num_seqs=max_num_seqs,
                                       max_model_len=max_model_len)
    return tap_slots_for(sizes.longest_chunk, DEFAULT_CHECKPOINT_INTERVAL)


def run(args: argparse.Namespace) -> int:
    import torch

    from pagedserve import plan as planning
    from pagedserve.config import CacheConfig, ModelConfig
    from pagedserve.engine.prefix_cache import num_checkpoints_for
    from pagedserve.engine.runner import DEFAULT_ACTIVATION_RESERVE
    from pagedserve.engine.speculative import SpeculativeConfig
    from pagedserve.model.loader import parse_dtype
    from pagedserve.model.mtp import SUPPORTED_MTP_LAYERS
    from pagedserve.model.weight_footprint import weight_footprint
    from pagedserve.quant.config import parse_quantization

    if args.max_num_seqs < 1:
        raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    seq_lens = planning.parse_seq_lens(args.seq_lens) if args.seq_lens else []
    raw = read_raw_config(args.model)
    model = ModelConfig.from_hf_dict(raw)
    max_len = check_lengths(args.max_model_len, model.max_position_embeddings, seq_lens)
    cache = CacheConfig(args.cache_type_k, args.cache_type_v, args.block_size)
    dtype = parse_dtype(args.dtype, torch.device("cuda"))
    speculative = args.speculative_config is not None
    spec = None
    if speculative:
        spec = SpeculativeConfig.parse(args.speculative_config)  # errors name the bad field
        spec.check_draft_vocab(model.vocab_size)
        if args.model.startswith("preset:"):  # a preset's random weights add the head
            model = dataclasses.replace(model, mtp_num_hidden_layers=SUPPORTED_MTP_LAYERS)
        elif model.mtp_num_hidden_layers != SUPPORTED_MTP_LAYERS:
            raise ValueError(f"--speculative-config method 'mtp' runs a "
                             f"{SUPPORTED_MTP_LAYERS}-layer MTP module; {args.model} has "
                             f"mtp_num_hidden_layers {model.mtp_num_hidden_layers}")
    weights = weight_footprint(model, dtype, parse_quantization(raw, args.quantization),
                               mtp=speculative)
    spec_bytes = None
    if spec is not None:
        spec_bytes = speculation_footprint(args.model, spec, model, dtype, args.max_num_seqs)
    if args.memory is not None:
        budget = planning.parse_bytes(args.memory)
    elif args.device_memory is not None:
        head, graphs = (0, 0) if spec_bytes is None else (spec_bytes.draft_head_bytes,
                                                          spec_bytes.graph_bytes)
        budget = planning.budget_after_weights(
            planning.parse_bytes(args.device_memory), args.gpu_memory_utilization,
            weights.total_bytes + head, DEFAULT_ACTIVATION_RESERVE + graphs)
    else:
        budget = planning.gpu_free_bytes(args.gpu_memory_fraction)
    per_checkpoint = planning.bytes_per_checkpoint(model, torch.bfloat16, speculative)
    checkpoints = num_checkpoints_for(
        planning.parse_checkpoint_memory(args.prefix_checkpoint_memory), per_checkpoint,
        args.max_num_seqs)
    result = planning.plan_capacity(model, cache, budget, args.max_num_seqs, max_len,
                                    num_checkpoints=checkpoints, speculative=speculative,
                                    num_tap_slots=default_tap_slots(checkpoints,
                                                                    args.max_num_seqs, max_len))
    report = None
    if seq_lens:
        report = planning.workload_report(planning.footprint(model, cache), seq_lens)
    if args.json:
        out = {"plan": result.as_dict(), "weights": weights.as_dict()}
        if spec_bytes is not None:
            out["speculation"] = spec_bytes.as_dict()
        if report is not None:
            out["workload"] = report.as_dict()
        print(json.dumps(out))
    else:
        print(planning.format_weights(weights, dtype))
        print(planning.format_plan(model, cache, result))
        if spec_bytes is not None:
            print(planning.format_speculation(spec_bytes))
        if report is not None:
            print(planning.format_workload(report))
    return 0
