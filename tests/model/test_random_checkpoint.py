"""The tiny random checkpoint: deterministic, atomic, a real checkpoint transformers can load."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from greedy_driver import greedy
from transformers import Qwen3_5ForCausalLM

from pagedserve.config import CacheConfig
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.model import random_checkpoint
from pagedserve.model.loader import load_model


def _digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
    }


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pagedserve-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDSERVE_CACHE", str(root))
        return random_checkpoint.random_model_path()


def test_created_once_atomically_and_deterministically(random_dir, tmp_path, monkeypatch):
    assert random_dir.name == random_checkpoint.NAME
    # Nothing but the final directory is left in the cache root (no temporary leftovers).
    assert [p.name for p in random_dir.parent.iterdir()] == [random_checkpoint.NAME]
    files = _digests(random_dir)
    assert set(files) == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    }
    # A second use reuses it; a fresh cache gets byte-identical files.
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(random_dir.parent))
    assert random_checkpoint.random_model_path() == random_dir
    other = tmp_path / "other"
    other.mkdir()
    random_checkpoint.write_checkpoint(other)
    assert _digests(other) == files


def test_loads_as_a_real_hybrid(random_dir) -> None:
    lm = load_model(random_dir, progress=False)
    cfg = lm.config
    assert lm.path == random_dir
    assert cfg.num_full_attention_layers >= 2 and cfg.num_linear_attention_layers >= 2
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA
    assert lm.generation.eos_token_ids[:2] == (258, 256)
    assert lm.generation.temperature == 0.7
    chat = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Grüße 👋"}], tokenize=False, add_generation_prompt=True
    )
    # Qwen3.5's layout: the generation prompt opens the thinking block.
    assert chat == "<|im_start|>user\nGrüße 👋<|im_end|>\n<|im_start|>assistant\n<think>\n"


@pytest.mark.parametrize(
    "text", ["", "plain ascii", "ünïcödé ✓ 新年快乐 🎉\x00\t\r\n", "<|im_end|>"]
)
def test_tokenizer_round_trips_utf8(random_dir, text: str) -> None:
    lm_tok = load_model(random_dir, progress=False).tokenizer
    assert lm_tok.decode(lm_tok.encode(text, add_special_tokens=False)) == text


@torch.no_grad()
def test_transformers_loads_it_and_agrees(random_dir) -> None:
    hf, info = Qwen3_5ForCausalLM.from_pretrained(
        random_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    hf.eval()
    hf.generation_config.eos_token_id = None
    prompt = list(b"Hello, pagedserve!")
    ids = torch.tensor([prompt])
    want = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    lm = load_model(random_dir, progress=False)
    runner = ModelRunner(lm.model, CacheConfig(), RunnerConfig(max_model_len=64, max_num_seqs=1))
    assert greedy(runner, prompt, 24, chunk=7).tokens == want
