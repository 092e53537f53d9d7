"""The compiled elementwise twins (what CUDA runs) trace whole and match the eager forms.

Compiling on the CPU (inductor's C++ backend) checks the part that can break on any device:
that every function traces as one graph (``fullgraph=True``) with dynamic token counts.
About a minute of compilation on a busy CPU, hence ``slow``.
"""

from __future__ import annotations

import pytest
import torch
from greedy_driver import greedy
from hybrid_checkpoints import hf_reference

from pagedserve.config import CacheConfig
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.model import elementwise
from pagedserve.model.loader import load_model

pytestmark = pytest.mark.slow


def test_compiled_ops_trace_and_match(checkpoints) -> None:
    ckpt = checkpoints("d64-gqa3-untied")
    ops = elementwise.compiled_ops()
    assert elementwise.check_compiled(ops, torch.device("cpu"), torch.float32)
    model = load_model(ckpt.path, progress=False).model  # a private copy to switch
    model.use_compiled_elementwise(ops)
    ref = hf_reference(ckpt.hf_model, ckpt.prompt, 12)
    runner = ModelRunner(model, CacheConfig(cache_type_k="f32", cache_type_v="f32"),
                         RunnerConfig(max_model_len=128))
    # 37 prompt tokens, then 1 per decode step (a separate specialization of each op).
    seq = greedy(runner, ckpt.prompt, 12, forced=ref.tokens)
    assert (torch.stack(seq.step_logits) - ref.step_logits).abs().max() <= 1e-4
