"""Engine options shared by ``generate``, ``serve`` and ``bench``: one mapping onto
``EngineConfig``, which checks them all before any weight loads. Nothing here imports
torch until ``engine_config`` runs, so ``--help`` stays fast."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from pagedserve.kv.type_names import KV_TYPES
from pagedserve.quant.names import QUANTIZATIONS

if TYPE_CHECKING:
    from pagedserve.engine.engine_config import EngineConfig


def add_engine_arguments(p: argparse.ArgumentParser, default_max_num_seqs: int = 8) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory or cached hub id (default: the embedded model)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default=None,
                   help="float32, bfloat16 or float16 (default: float32 on cpu, bfloat16 on cuda)")
    p.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                   help="fp8: quantize the linear weights of a bf16 checkpoint to FP8 128x128 "
                        "blocks while loading (FP8 checkpoints are FP8 without it; what runs "
                        "where: docs/fp8.md)")
    p.add_argument("--kv-layout", default="paged", choices=("paged", "contiguous"))
    kv_help = "K/V storage type (default f16; f32 is exact and CPU-only)"
    p.add_argument("--cache-type-k", default="f16", choices=KV_TYPES, help=kv_help)
    p.add_argument("--cache-type-v", default="f16", choices=KV_TYPES, help=kv_help)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=default_max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens a step may carry (default: 8192 on cuda, 2048 on cpu)")
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="prompt tokens a step takes, all prompts together (in at most two "
                        "chunks), while other sequences decode and do not number fewer "
                        "than the prompts (default 512)")
    p.add_argument("--idle-prefill-chunk", type=int, default=None,
                   help="prompt tokens a step takes per prompt while none decodes, or while "
                        "prompts outnumber the decoding sequences (default: 8192 on cuda, "
                        "512 on cpu)")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="K/V blocks in the pool (default: sized from memory)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    p.add_argument("--no-cuda-graphs", action="store_true")
    timing = p.add_mutually_exclusive_group()
    timing.add_argument("--async-scheduling", action="store_true",
                        help="launch each steady step before the previous one's tokens are "
                             "read back (the default on one CUDA GPU; with speculative "
                             "decoding only where CUDA graphs are on, and then its steady "
                             "verify steps go ahead)")
    timing.add_argument("--no-async-scheduling", action="store_true",
                        help="read each step's tokens back before launching the next")
    p.add_argument("--speculative-config", default=None,
                   help='speculative decoding, vLLM\'s JSON: {"method": "mtp", '
                        '"num_speculative_tokens": K} with K in 1..4 (drafts with the '
                        'checkpoint\'s MTP head); optional "draft_vocab_size": N in '
                        '1..vocab_size drafts over the first N token ids plus the special '
                        'and EOS ids only')
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split every layer's heads over N devices, one process each "
                        "(NCCL on cuda, gloo on cpu; docs/tensor-parallel.md)")
    p.add_argument("--engine-seed", type=int, default=0,
                   help="seed for requests that bring none")
    add_prefix_arguments(p)


def add_prefix_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="reuse the K/V blocks and recurrent state of earlier requests' "
                        "prefixes (default on; off with the contiguous layout)")
    p.add_argument("--prefix-checkpoint-memory", default=None,
                   help="memory for recurrent-state checkpoints, e.g. 4GiB, 0 for none "
                        "(default: at most 4 GiB and max(64, 8 x max-num-seqs) checkpoints)")
    p.add_argument("--prefix-checkpoint-interval", type=int, default=None,
                   help="tokens between state checkpoints inside a long prompt (default "
                        "2048)")


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    from pagedserve.engine.engine_config import EngineConfig

    fields = dict(
        model=args.model, device=args.device, dtype=args.dtype,
        quantization=args.quantization, kv_layout=args.kv_layout,
        cache_type_k=args.cache_type_k, cache_type_v=args.cache_type_v,
        block_size=args.block_size, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_chunk=args.prefill_chunk, idle_prefill_chunk=args.idle_prefill_chunk,
        num_blocks=args.num_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
        cuda_graphs=not args.no_cuda_graphs, seed=args.engine_seed,
        async_scheduling=(False if args.no_async_scheduling
                          else True if args.async_scheduling else None),
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_checkpoint_memory=args.prefix_checkpoint_memory,
        speculative_config=args.speculative_config,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.prefix_checkpoint_interval is not None:
        fields["prefix_checkpoint_interval"] = args.prefix_checkpoint_interval
    fields.update(overrides)
    return EngineConfig(**fields)
