"""Session-scoped tiny checkpoints and transformers' reference outputs on them.

Building a checkpoint and running transformers' ``generate`` are the slow parts, so each
shape is built and referenced once per session and shared by every test that needs it.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from hybrid_checkpoints import (  # noqa: E402
    SHAPES,
    HFReference,
    build_hf_model,
    hf_reference,
    prompt_ids,
    save_checkpoint,
)

from pagedserve.config import CacheConfig  # noqa: E402
from pagedserve.engine.runner import ModelRunner, RunnerConfig  # noqa: E402
from pagedserve.model.loader import LoadedModel, load_model  # noqa: E402


@dataclass
class Checkpoint:
    name: str
    path: Path
    hf_model: torch.nn.Module
    prompt: list[int]

    @functools.cached_property
    def reference(self) -> HFReference:
        # Lazy: the GPU tests use only the checkpoint, and on a machine with fla installed
        # transformers would route this CPU forward through fla's CUDA-only kernels.
        return hf_reference(self.hf_model, self.prompt)

    @functools.cached_property
    def loaded(self) -> LoadedModel:
        return load_model(self.path, device="cpu", dtype=torch.float32, progress=False)

    def runner(self, cache: CacheConfig | None = None, **kw) -> ModelRunner:
        kw.setdefault("max_model_len", 128)
        kw.setdefault("max_num_seqs", 4)
        return ModelRunner(self.loaded.model, cache or CacheConfig(), RunnerConfig(**kw))


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """``checkpoints(shape) -> Checkpoint``, built on first request."""
    built: dict[str, Checkpoint] = {}

    def get(shape: str) -> Checkpoint:
        if shape not in built:
            model = build_hf_model(shape)
            path = save_checkpoint(model, tmp_path_factory.mktemp(shape))
            prompt = prompt_ids()
            built[shape] = Checkpoint(shape, path, model, prompt)
        return built[shape]

    return get


@pytest.fixture(params=sorted(SHAPES))
def checkpoint(request: pytest.FixtureRequest, checkpoints) -> Checkpoint:
    return checkpoints(request.param)

