"""Tensor parallelism on the CPU (gloo, 2 ranks): greedy tokens against transformers and
against one rank, on tiny checkpoints of both layouts and every K/V storage type.

Each engine spawns one worker process (a few seconds), so the grid is chosen: every shape
and layout with f16 and exact f32 K/V against transformers, then the other types (K and V
independent) against the same engine at one rank, as ``test_kv_types.py`` does, since
quantized K/V cannot match transformers' float cache.
"""

from __future__ import annotations

import pytest
from engine_greedy import engine_greedy
from hybrid_checkpoints import NEW_TOKENS, to_published_layout

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine

TP_CHECKPOINTS = ("d64-mha-tied", "d256-gqa4-kv1-untied")


def generate(path, prompt: list[int], tp: int, kv: tuple[str, str] = ("f16", "f16"),
             n: int = NEW_TOKENS) -> list[int]:
    """Greedy tokens of an engine at ``tp`` ranks (its workers stopped at the end)."""
    engine = LLMEngine(EngineConfig(
        model=str(path), dtype="float32", progress=False, tensor_parallel_size=tp,
        cache_type_k=kv[0], cache_type_v=kv[1], max_model_len=128, max_num_seqs=2,
        check_integrity=True))
    try:
        tokens = engine_greedy(engine, prompt, n)
        if tp > 1:
            assert [r.num_used_state_slots for r in engine.runner.workers.report()] == [0]
        return tokens
    finally:
        engine.close()


@pytest.fixture(scope="module", params=["text", "published"])
def layout(request):
    return request.param


def checkpoint_path(ckpt, layout: str, tmp_path_factory):
    if layout == "text":
        return ckpt.path
    return to_published_layout(ckpt.path, tmp_path_factory.mktemp(f"{ckpt.name}-vl"))


@pytest.mark.parametrize("shape", TP_CHECKPOINTS)
@pytest.mark.parametrize("kv", [("f16", "f16"), ("f32", "f32")], ids=["f16", "f32"])
def test_two_ranks_match_transformers(checkpoints, tmp_path_factory, shape, layout, kv) -> None:
    if kv[0] == "f32" and (layout == "published" or shape == "d64-mha-tied"):
        pytest.skip("exact K/V once: the layouts differ in loading only, and f16 covers both")
    ckpt = checkpoints(shape)
    path = checkpoint_path(ckpt, layout, tmp_path_factory)
    expected = ckpt.reference.tokens
    assert generate(path, ckpt.prompt, tp=1, kv=kv) == expected
    assert generate(path, ckpt.prompt, tp=2, kv=kv) == expected


# With the f16 and f32 runs above, each type is used for K and for V at least once.
@pytest.mark.parametrize("kv", [("bf16", "bf16"), ("q8_0", "q4_0")],
                         ids=lambda kv: f"{kv[0]}-{kv[1]}")
def test_two_ranks_match_one_rank_for_each_kv_type(checkpoints, kv) -> None:
    ckpt = checkpoints("d256-gqa4-kv1-untied")
    one = generate(ckpt.path, ckpt.prompt, tp=1, kv=kv)
    assert generate(ckpt.path, ckpt.prompt, tp=2, kv=kv) == one
