"""Shared pieces of the speculative GPU tests (verify, rollback and draft graphs): the
tiny checkpoint with an MTP head, the engines, and the greedy requests they compare."""

from __future__ import annotations

import sys
from pathlib import Path

from test_engine import prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))

from hybrid_checkpoints import build_hf_model  # noqa: E402
from mtp_checkpoints import build_mtp, save_with_mtp  # noqa: E402

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine  # noqa: E402
from pagedserve.engine.request import SamplingParams  # noqa: E402

SHAPE = "d256-gqa3-untied"  # head_dim 256: the library's kernels, not fallbacks
NEW = 20


def save_spec_checkpoint(directory: Path) -> Path:
    """The tiny random checkpoint of ``SHAPE`` with a random MTP head, saved in
    ``directory``."""
    hf = build_hf_model(SHAPE)
    return save_with_mtp(hf, build_mtp(hf), directory)


def spec_engine(path: Path, k: int | None, draft_vocab_size: int | None = None,
                **kw) -> LLMEngine:
    """A bf16 CUDA engine on ``path``, speculating ``k`` tokens (``None``: plain), over a
    draft vocabulary of ``draft_vocab_size`` when given."""
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    if spec is not None and draft_vocab_size is not None:
        spec["draft_vocab_size"] = draft_vocab_size
    kw.setdefault("max_num_seqs", 8)
    return LLMEngine(EngineConfig(
        model=str(path), device="cuda", dtype="bfloat16", max_model_len=256,
        check_integrity=True, progress=False, speculative_config=spec, **kw))


def greedy_items(batch: int) -> list:
    """``batch`` greedy requests of different prompt lengths, all arriving at once."""
    params = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True, logprobs=5)
    return [(0, f"r{i}", p, params)
            for i, p in enumerate(prompts(11 + batch, [5 + 9 * i for i in range(batch)]))]
