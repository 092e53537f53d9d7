"""The tensor-parallel engine on the CPU (gloo, 2 ranks): nothing leaks on any rank after
aborts and preemptions, a dead worker ends the engine with a clear error, workers exit with
the engine (or its process), and start-up refuses what it cannot run before any weight
loads."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from pagedserve.engine.llm_engine import EngineConfig, LLMEngine
from pagedserve.engine.request import SamplingParams
from pagedserve.parallel.launch import WorkerFailedError, WorkerGroup

VOCAB = 259  # the random checkpoint's byte-level tokens


def make(model_dir, **kw) -> LLMEngine:
    kw.setdefault("tensor_parallel_size", 2)
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", progress=False,
                                  check_integrity=True, **kw))


def run_scenario(engine: LLMEngine, seed: int) -> dict[str, list[int]]:
    """40 greedy requests arriving over time, some aborted mid-way; returns each one's
    tokens (aborted ones included, up to their abort)."""
    rng = random.Random(seed)
    got: dict[str, list[int]] = {}
    live: list[str] = []
    submitted = 0
    while submitted < 40 or engine.has_unfinished_requests():
        for _ in range(rng.randrange(3)):
            if submitted < 40:
                rid = f"r{submitted}"
                prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
                engine.add_request(rid, prompt, SamplingParams(
                    max_tokens=rng.randrange(1, 24), temperature=0.0, ignore_eos=True))
                live.append(rid)
                got[rid] = []
                submitted += 1
        if live and rng.random() < 0.15:
            engine.abort_request(live.pop(rng.randrange(len(live))))
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
    return got


def test_no_leaks_on_any_rank_after_aborts_and_preemptions(model_dir, loaded) -> None:
    small = dict(max_num_seqs=4, num_blocks=10, max_model_len=96, prefill_chunk=16,
                 max_num_batched_tokens=48)
    # Prefix caching is off by default with tensor parallelism: off in the reference too,
    # so that both engines take the same schedule.
    one = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", progress=False,
                                 enable_prefix_caching=False, **small), loaded=loaded)
    expected = run_scenario(one, seed=3)
    engine = make(model_dir, **small)
    try:
        assert run_scenario(engine, seed=3) == expected  # the same schedule, the same tokens
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv.pool.num_free_blocks == engine.kv.pool.num_blocks
        assert engine.runner.state_pool.num_used_slots == 0
        assert [r.num_used_state_slots for r in engine.runner.workers.report()] == [0]
        engine.scheduler.check_integrity()
    finally:
        engine.close()
    assert [p.exitcode for p in engine.runner.workers.processes] == [0]


def test_a_dead_worker_ends_the_engine_with_a_clear_error(model_dir) -> None:
    engine = make(model_dir, max_model_len=64, max_num_seqs=2)
    try:
        engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0))
        engine.step()
        worker = engine.runner.workers.processes[0]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(WorkerFailedError, match=r"worker rank 1 .* exited with code -9"):
            while engine.has_unfinished_requests():
                engine.step()
        assert time.monotonic() - start < 10
    finally:
        engine.close()


def test_workers_exit_when_the_engine_process_dies(model_dir) -> None:
    script = (
        "import os, sys\n"
        "from pagedserve.engine.llm_engine import EngineConfig, LLMEngine\n"
        "if __name__ == '__main__':\n"
        f"    e = LLMEngine(EngineConfig(model={str(model_dir)!r}, dtype='float32',\n"
        "        progress=False, tensor_parallel_size=2, max_model_len=64, max_num_seqs=2))\n"
        "    print(e.runner.workers.processes[0].pid, flush=True)\n"
        "    os._exit(0)  # no clean-up: the workers must notice on their own\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=os.getcwd(),
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    pid = int(out.stdout.split()[-1])
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    assert not _alive(pid)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie awaiting its (gone) parent is dead
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize(("size", "message"), [
    (3, r"--tensor-parallel-size 3 must divide num_attention_heads \(4\)"),
    (4, r"--tensor-parallel-size 4 must divide linear_num_key_heads \(2\)"),
])
def test_head_counts_are_checked_before_any_worker_starts(model_dir, monkeypatch, size,
                                                          message) -> None:
    def never(*args, **kwargs):
        raise AssertionError("workers started before the head counts were checked")

    monkeypatch.setattr(WorkerGroup, "start", never)
    with pytest.raises(ValueError, match=message):
        make(model_dir, tensor_parallel_size=size)


def test_more_ranks_than_gpus_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs 2 GPUs, but 1 are "
                                         "visible"):
        EngineConfig(device="cuda", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="pass --device cuda"):
        EngineConfig(device="cuda:1", tensor_parallel_size=2)


@pytest.mark.parametrize(("field", "value", "flag"), [
    ("speculative_config", '{"method": "mtp", "num_speculative_tokens": 1}',
     "--speculative-config"),
    ("quantization", "fp8", "--quantization"),
    ("enable_prefix_caching", True, "--enable-prefix-caching"),
    ("async_scheduling", True, "--async-scheduling"),
])
def test_unsupported_combinations_are_refused(field, value, flag) -> None:
    kw = {field: value}
    if field == "speculative_config":
        kw["enable_prefix_caching"] = False
    with pytest.raises(ValueError, match=f"--tensor-parallel-size 2 does not support {flag}"):
        EngineConfig(tensor_parallel_size=2, **kw)
    assert not EngineConfig(tensor_parallel_size=2).prefix_caching


def test_a_size_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="tensor-parallel-size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
