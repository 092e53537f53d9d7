"""The engine's failure policy in-process (``engine/failures.py``), in both scheduling
modes: a request whose own work raises ends with ``finish_reason: "error"``, its blocks and
slot freed, while its neighbours produce exactly the tokens they produce alone; a device
error is fatal. Also ``min_tokens``, which bans EOS and stop ids in the sampler."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.failures import is_fatal
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.engine.request import SamplingParams

PROMPT = [72, 101, 108, 108, 111]


def run(engine: LLMEngine) -> dict:
    outs: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


@pytest.mark.parametrize("where", ["post_process", "sampling"])
def test_a_failing_request_ends_alone_and_frees_its_blocks(make_engine, monkeypatch, where):
    engine = make_engine()
    engine.add_request("alone", PROMPT, greedy(8, ignore_eos=True))
    alone = [t for o in run(engine)["alone"] for t in o.new_token_ids]
    if where == "post_process":
        original = LLMEngine._stop_status

        def faulty(self, req, token):
            if req.request_id == "bad" and len(req.output_token_ids) >= 3:
                raise KeyError("injected")
            return original(self, req, token)

        monkeypatch.setattr(LLMEngine, "_stop_status", faulty)
        bad_params = greedy(8, ignore_eos=True)
    else:
        from pagedserve.engine import sampler

        original_from = sampler.SamplingTensors.from_requests.__func__

        def faulty_from(cls, requests, *args, **kw):
            if any(r.request_id == "bad" for r in requests):
                raise KeyError("injected")
            return original_from(cls, requests, *args, **kw)

        monkeypatch.setattr(sampler.SamplingTensors, "from_requests",
                            classmethod(faulty_from))
        bad_params = SamplingParams(max_tokens=8, temperature=0.7, ignore_eos=True)
    engine.add_request("good", PROMPT, greedy(8, ignore_eos=True))
    engine.add_request("bad", PROMPT, bad_params)
    outs = run(engine)
    last = outs["bad"][-1]
    assert last.finished and last.finish_reason == "error" and "injected" in last.error
    assert [t for o in outs["good"] for t in o.new_token_ids] == alone
    assert outs["good"][-1].finish_reason == "length"
    assert engine.kv.pool.utilization == 0.0 and not engine.requests
    engine.scheduler.check_integrity()


def test_a_device_error_is_fatal_even_inside_one_request(make_engine, monkeypatch):
    engine = make_engine()

    def faulty(self, req, token):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(LLMEngine, "_stop_status", faulty)
    engine.add_request("r", PROMPT, greedy(4))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run(engine)


def test_is_fatal():
    assert is_fatal(MemoryError())
    assert is_fatal(KeyboardInterrupt())
    assert is_fatal(torch.AcceleratorError("device-side assert triggered"))
    assert is_fatal(RuntimeError("CUDA error: out of memory"))
    assert not is_fatal(RuntimeError("the prompt mentions a CUDA error: boo"))
    assert not is_fatal(ValueError("CUDA error"))
    assert not is_fatal(KeyError("x"))


def test_min_tokens_bans_eos_and_stop_ids(make_engine):
    engine = make_engine()
    engine.add_request("probe", PROMPT, greedy(6, ignore_eos=True))
    first = run(engine)["probe"][0].new_token_ids[0]
    engine.add_request("stopped", PROMPT, greedy(6, stop_token_ids=(first,)))
    engine.add_request("held", PROMPT, greedy(6, stop_token_ids=(first,), min_tokens=4))
    outs = run(engine)
    assert [t for o in outs["stopped"] for t in o.new_token_ids] == [first]
    held = [t for o in outs["held"] for t in o.new_token_ids]
    assert len(held) >= 4 and first not in held[:4]


def test_ban_tokens_clears_exactly_the_banned_bits():
    from pagedserve.engine.sampler import apply_token_bitmask, ban_tokens

    B, V = 3, 70
    bans = [(0, [0, 31, 32, 69, 70, -1]), (2, [5, 5, 63])]
    mask = ban_tokens(None, bans, B, V, "cpu")
    banned = apply_token_bitmask(torch.zeros(B, V), mask) == float("-inf")
    want = torch.zeros(B, V, dtype=torch.bool)
    for row, ids in ((0, [0, 31, 32, 69]), (2, [5, 63])):
        want[row, ids] = True
    assert torch.equal(banned, want)
    grammar = torch.full((B, 3), -1, dtype=torch.int32)
    grammar[1, 0] = 0  # the grammar bans tokens 0..31 of row 1
    both = apply_token_bitmask(torch.zeros(B, V), ban_tokens(grammar, bans, B, V, "cpu"))
    assert torch.equal(both == float("-inf"), want | (torch.arange(V) < 32) * (
        torch.arange(B) == 1)[:, None])
    assert ban_tokens(grammar, [], B, V, "cpu") is grammar


def test_offline_generate_reports_the_failed_prompt(model_dir, monkeypatch):
    from pagedserve.engine.llm import LLM

    original = LLMEngine._stop_status

    def faulty(self, req, token):
        if req.request_id == "llm-1":
            raise KeyError("injected")
        return original(self, req, token)

    monkeypatch.setattr(LLMEngine, "_stop_status", faulty)
    llm = LLM(str(model_dir), dtype="float32", progress=False)
    outs = llm.generate([PROMPT, PROMPT], greedy(4, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "error"]
    assert len(outs[0].token_ids) == 4
