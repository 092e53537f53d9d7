"""The model on the Triton attention kernels (K/V write, paged decode), under the Triton
interpreter on the CPU: the CUDA integration of those ops, checked without a GPU.

The kernels' own tests check them against an oracle; this checks how the model calls
them (strided K/V rows, decode rows first, block tables, the contiguous one-column form)
by comparing with the torch-reference path step by step.
"""

from __future__ import annotations

import os

import pytest
import torch
from greedy_driver import greedy

from pagedserve.config import CacheConfig
from pagedserve.kernels import ops

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1"
)


@pytest.mark.parametrize("kv_type, layout", [("f16", "paged"), ("q4_0", "contiguous")])
def test_triton_attention_ops_match_reference(checkpoints, monkeypatch, kv_type, layout):
    ckpt = checkpoints("d64-gqa3-untied")
    cache = CacheConfig(cache_type_k=kv_type, cache_type_v=kv_type, kv_layout=layout)
    ref = greedy(ckpt.runner(cache), ckpt.prompt, 4, chunk=16)
    monkeypatch.setattr(ops, "_pick", lambda backend, device: "triton")
    tri = greedy(ckpt.runner(cache), ckpt.prompt, 4, chunk=16)
    assert tri.tokens == ref.tokens
    torch.testing.assert_close(
        torch.stack(tri.step_logits), torch.stack(ref.step_logits), atol=2e-3, rtol=0
    )
