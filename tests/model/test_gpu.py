"""CUDA: bf16 agreement with transformers, CUDA-graph decode, every K/V type and layout.

Run on the GPU machine: ``pytest tests/model/test_gpu.py -m gpu -s``. Skipped without CUDA.
Token agreement is measured step by step with teacher forcing (each step is fed
transformers' token), so one early divergence does not count as a run of mismatches.
"""

from __future__ import annotations

import pytest
import torch
from greedy_driver import GreedyDriver, greedy
from hybrid_checkpoints import SHAPES, hf_reference, prompt_ids

from pagedserve.config import CacheConfig
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.model import default_model, random_checkpoint
from pagedserve.model.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

NEW = 64
# (seed, prompt length, prefill chunk): short, block-unaligned chunked, and a longer prompt.
PROMPTS = [(0, 37, None), (1, 100, 16), (2, 300, 128)]


def _hf(path, dtype: torch.dtype):
    from transformers import Qwen3_5ForCausalLM

    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=dtype).to("cuda").eval()
    hf.generation_config.eos_token_id = None
    return hf


def _agreement_on(path) -> dict:
    """Teacher-forced step agreement of our bf16 argmax with transformers' bf16 greedy
    tokens, over PROMPTS x NEW steps; plus transformers' own fp32-vs-bf16 agreement on the
    same steps (the noise floor of bf16 itself) and the margins at our mismatches."""
    hf = _hf(path, torch.bfloat16)
    hf32 = _hf(path, torch.float32)
    lm = load_model(path, device="cuda", dtype="bfloat16", progress=False)
    runner = ModelRunner(lm.model, CacheConfig(), RunnerConfig(max_model_len=512, max_num_seqs=4))
    assert runner.graphs is not None, "decode CUDA graphs failed to capture (see the log)"
    stats = {"agree": 0, "hf32_agree": 0, "total": 0, "max_diff": 0.0, "margins": []}
    for seed, length, chunk in PROMPTS:
        prompt = prompt_ids(seed, length)
        ref = hf_reference(hf, prompt, NEW)
        want = torch.tensor(ref.tokens)
        ours = torch.stack(greedy(runner, prompt, NEW, chunk=chunk, forced=ref.tokens)
                           .step_logits)  # [NEW, vocab]
        hit = ours.argmax(-1) == want
        stats["agree"] += int(hit.sum())
        stats["total"] += NEW
        stats["max_diff"] = max(stats["max_diff"], (ours - ref.step_logits).abs().max().item())
        top2 = ref.step_logits.topk(2, dim=-1).values
        stats["margins"] += (top2[:, 0] - top2[:, 1])[~hit].tolist()
        ids = torch.tensor([prompt + ref.tokens[:-1]], device="cuda")
        logits32 = hf32(ids).logits[0, len(prompt) - 1:].float().cpu()  # [NEW, vocab]
        stats["hf32_agree"] += int((logits32.argmax(-1) == want).sum())
    return stats


def _print_agreement(name: str, st: dict) -> None:
    margins = ", ".join(f"{m:.1e}" for m in st["margins"]) or "-"
    print(
        f"\n{name} bf16: agreement {st['agree']}/{st['total']} "
        f"({st['agree'] / st['total']:.1%}), max logit diff {st['max_diff']:.3e}; "
        f"transformers fp32 vs its bf16 {st['hf32_agree']}/{st['total']}; "
        f"HF top-2 margins at mismatches: {margins}"
    )


@torch.no_grad()
def test_bf16_token_agreement_with_transformers(checkpoints) -> None:
    """At least 99% of steps agree, over the test checkpoints together (the issue's "same
    checkpoints"). Random tiny models have many near-tied logits, so a flip or two per
    checkpoint is expected; the margins of every mismatch are printed, next to how often
    transformers' own fp32 run agrees with its bf16 run on the same steps.

    Measured with the same test on the CPU (torch reference ops both sides): 572/576, max
    logit diff 8.7e-3; transformers fp32 vs bf16: 570/576."""
    agree = total = 0
    for name in sorted(SHAPES):
        st = _agreement_on(checkpoints(name).path)
        _print_agreement(name, st)
        agree += st["agree"]
        total += st["total"]
    print(f"\nall test checkpoints: {agree}/{total} = {agree / total:.2%}")
    assert agree / total >= 0.99


@torch.no_grad()
def test_bf16_agreement_on_random_checkpoint(tmp_path) -> None:
    """Reported only: the tiny checkpoint's random weights make it sensitive to bf16 rounding
    (on the CPU transformers' own bf16 run moves its logits by 0.08 from fp32; ours vs
    transformers, both bf16: 185/192 steps, max logit diff 0.2), so it is no measure of
    agreement. It must run on CUDA, with graphs, and stay close."""
    random_checkpoint.write_checkpoint(tmp_path)
    st = _agreement_on(tmp_path)
    _print_agreement("random", st)
    assert st["agree"] / st["total"] >= 0.9


@torch.no_grad()
def test_bf16_agreement_on_default_model() -> None:
    """The trained default model on CUDA, with graphs (head_dim 128, GDN heads of 128, vocab
    8192). Its logits have real margins, so bf16 agrees with transformers' bf16 on at
    least 95% of teacher-forced steps even on PROMPTS' random ids."""
    st = _agreement_on(default_model.DIRECTORY)
    _print_agreement("default", st)
    assert st["agree"] / st["total"] >= 0.95


@torch.no_grad()
def test_long_chunks_match_transformers(checkpoints, monkeypatch) -> None:
    """A 3000-token prompt prefilled in chunks of 1536 and 1464 rows: both are long
    (``ops.LONG_CHUNK_MIN_ROWS``), so on an H100/H200 the full-attention layer takes
    cuDNN's method, the second chunk over a 1536-row prefix (a causal call and a prefix
    call, merged). The logits of the prompt's last position and of 7 teacher-forced steps,
    against transformers' fp32, are no further off than transformers' own bf16 run."""
    from pagedserve.kernels import ops, prefill_cudnn

    calls = []
    attend = prefill_cudnn.attend_chunk
    monkeypatch.setattr(prefill_cudnn, "attend_chunk",
                        lambda q, *a, **kw: calls.append(q.shape[0]) or attend(q, *a, **kw))
    path = checkpoints("d256-gqa3-untied").path
    prompt, new = prompt_ids(5, 3000), 8
    ref = hf_reference(_hf(path, torch.float32), prompt, new)
    ids = torch.tensor([prompt + ref.tokens[:-1]], device="cuda")
    hf16 = _hf(path, torch.bfloat16)(ids).logits[0, len(prompt) - 1:].float().cpu()
    lm = load_model(path, device="cuda", dtype="bfloat16", progress=False)
    cache = CacheConfig(cache_type_k="bf16", cache_type_v="bf16")
    # Eager: the path under test is the long chunks' attention, which never runs in a graph.
    runner = ModelRunner(lm.model, cache, RunnerConfig(
        max_model_len=3072, max_num_seqs=1, cuda_graphs=False, compile_elementwise=False))
    ours = torch.stack(greedy(runner, prompt, new, chunk=1536, forced=ref.tokens)
                       .step_logits).float()  # [new, vocab]
    err, floor = ((x - ref.step_logits).abs().max().item() for x in (ours, hf16))
    print(f"\nlong chunks: max logit diff from transformers fp32 {err:.3e} "
          f"(transformers bf16: {floor:.3e}); cuDNN calls, rows: {calls}")
    if ops.LONG_CHUNK_METHOD == "cudnn" and torch.cuda.get_device_capability() == (9, 0):
        assert calls == [1536, 1464], "long chunks did not take cuDNN's method"
    assert err <= 2 * floor + 1e-2


@torch.no_grad()
def test_cuda_graph_decode_matches_eager(checkpoints) -> None:
    lm = load_model(checkpoints("d256-gqa3-untied").path, device="cuda", progress=False)
    runs = {}
    for graphs in (False, True):
        runner = ModelRunner(
            lm.model, CacheConfig(),
            RunnerConfig(max_model_len=256, max_num_seqs=5, cuda_graphs=graphs),
        )
        assert (runner.graphs is not None) == graphs
        driver = GreedyDriver(runner)
        seqs = [driver.new_sequence() for _ in range(3)]  # decode batch of 3 -> graph of 4
        for i, seq in enumerate(seqs):
            driver.prefill(seq, prompt_ids(i, 20 + 11 * i))
        for _ in range(20):
            logits = driver.step([(s, [s.tokens[-1]]) for s in seqs])
            for row, seq in zip(logits, seqs):
                seq.step_logits.append(row.float().cpu())
                seq.tokens.append(int(row.argmax()))
        runs[graphs] = seqs
    for eager, graphed in zip(runs[False], runs[True]):
        assert graphed.tokens == eager.tokens
        diff = (torch.stack(graphed.step_logits) - torch.stack(eager.step_logits)).abs().max()
        assert diff <= 5e-2, f"graph vs eager logits differ by {diff}"


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@torch.no_grad()
def test_every_kv_type_runs_on_cuda(checkpoints, layout: str) -> None:
    ckpt = checkpoints("d64-gqa3-untied")
    lm = load_model(ckpt.path, device="cuda", progress=False)
    prompt = prompt_ids(3, 70)
    tokens = {}
    for kv_type in ("f16", "bf16", "q8_0", "q4_0"):
        cache = CacheConfig(cache_type_k=kv_type, cache_type_v=kv_type, kv_layout=layout)
        runner = ModelRunner(lm.model, cache, RunnerConfig(max_model_len=256, max_num_seqs=2))
        seq = greedy(runner, prompt, 32, chunk=16)
        assert torch.isfinite(torch.stack(seq.step_logits)).all()
        tokens[kv_type] = seq.tokens
    for kv_type, toks in tokens.items():
        agreement = sum(a == b for a, b in zip(toks, tokens["f16"])) / len(toks)
        print(f"\n{layout} {kv_type}: agreement with f16 {agreement:.0%}")
