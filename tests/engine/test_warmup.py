"""Warm-up: every kind of step runs once, and the engine is left exactly as it was.

On the CPU this checks the bookkeeping (pools empty, counters reset, later requests
unchanged); that no request compiles after it is checked on CUDA
(``test_prefill_graphs_gpu.py``).
"""

from __future__ import annotations

from test_engine import greedy, prompts

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine


def _run(engine: LLMEngine, items: list[tuple[str, list[int]]]) -> dict[str, list[int]]:
    for rid, prompt in items:
        engine.add_request(rid, prompt, greedy(12))
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_warm_up_leaves_the_engine_as_it_was(loaded, model_dir):
    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", progress=False,
                                      max_num_seqs=4, prefill_chunk=16,
                                      max_num_batched_tokens=32, max_model_len=128,
                                      check_integrity=True), loaded=loaded)

    items = [(f"r{i}", p) for i, p in enumerate(prompts(3, [7, 30, 50]))]
    cold = _run(engine(), items)
    warm = engine()
    seconds = warm.warm_up()
    assert seconds > 0 and warm.startup_seconds["warm_up"] == seconds
    assert warm.kv.pool.num_used_blocks == 0
    assert warm.runner.state_pool.num_used_slots == 0
    assert not warm.requests and warm.stats.num_steps == 0
    assert _run(warm, items) == cold


def test_warm_up_fills_a_step_when_prompts_are_shorter_than_the_budget(loaded, model_dir):
    """With ``max_model_len`` below the token budget, several prompts fill one step
    together, as the scheduler does when they arrive at once: the warm-up reaches the
    largest step's row count."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", progress=False,
                                    max_num_seqs=8, prefill_chunk=16,
                                    max_num_batched_tokens=96, max_model_len=40),
                       loaded=loaded)
    sizes: list[int] = []
    schedule = engine.scheduler.schedule

    def recording():
        plan = schedule()
        sizes.append(sum(c.num_tokens for c in plan.chunks))
        return plan

    engine.scheduler.schedule = recording
    engine.warm_up()
    assert max(sizes) == 96
