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


def test_one_graph_across_token_counts_with_static_features() -> None:
    """``token_dynamic``: the token dim is symbolic, every other dim a constant of the
    graph, and one graph serves every token count from 2 up (1 is dynamo's own
    specialization); a new feature shape gets a graph of its own."""
    graphs = []  # per graph: each tensor input's shape, "T" where the dim is symbolic

    def backend(gm, example_inputs):
        shapes = []
        for node in gm.graph.nodes:
            value = node.meta.get("example_value")
            if node.op == "placeholder" and isinstance(value, torch.Tensor):
                shapes.append(tuple(d if isinstance(d, int) else "T" for d in value.shape))
        graphs.append(sorted(shapes, key=str))
        return gm.forward

    silu_mul = elementwise.token_dynamic(elementwise.silu_mul, backend=backend)
    rope = elementwise.token_dynamic(elementwise.qk_norm_rope, backend=backend)
    w = torch.ones(16)
    for t in (5, 7, 300, 2):
        gate_up = torch.randn(t, 64)
        torch.testing.assert_close(silu_mul(gate_up), elementwise.silu_mul(gate_up))
        q, k, cos = torch.randn(t, 4, 16), torch.randn(t, 2, 16), torch.randn(t, 8)
        torch.testing.assert_close(rope(q, k, w, w, cos, cos, 1e-6),
                                   elementwise.qk_norm_rope(q, k, w, w, cos, cos, 1e-6))
    silu_mul(torch.randn(1, 64))
    silu_mul(torch.randn(3, 32))
    assert graphs == [
        [("T", 64)],
        sorted([("T", 4, 16), ("T", 2, 16), (16,), ("T", 8)], key=str),  # w, cos used twice
        [(1, 64)],
        [("T", 32)],
    ]
