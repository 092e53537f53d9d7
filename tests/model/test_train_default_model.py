"""scripts/train_default_model.py end to end in its --smoke mode, on a corpus of the
repository's own docs: the checkpoint it writes loads in transformers and in pagedserve,
and pagedserve's greedy tokens equal transformers'. Also the MTP module's layout and
causality, and the corpus builder's R reader and reST cleaning."""

from __future__ import annotations

import json
import lzma
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from greedy_driver import greedy
from hybrid_checkpoints import hf_reference
from safetensors import safe_open
from transformers import AutoTokenizer, Qwen3_5ForCausalLM

from pagedserve.config import CacheConfig
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.model.loader import load_model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from default_model import corpus as corpus_mod  # noqa: E402
from default_model import tokenizer as tok_mod  # noqa: E402
from default_model.mtp import MTP  # noqa: E402

MTP_LAYER_TENSORS = {
    "input_layernorm.weight", "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
}
MTP_TENSORS = {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
               "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"} | {
    f"mtp.layers.0.{n}" for n in MTP_LAYER_TENSORS}


def _write_docs_corpus(path: Path) -> None:
    """The repository's Markdown files as a corpus, every fourth one held out."""
    files = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    with lzma.open(path, "wt", encoding="utf-8") as f:
        for i, p in enumerate(files):
            record = {"source": "repo", "name": p.name, "split": "val" if i % 4 == 3 else "train",
                      "text": p.read_text(encoding="utf-8")}
            f.write(json.dumps(record) + "\n")


@pytest.fixture(scope="module")
def smoke_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("train-smoke")
    corpus = tmp / "corpus.jsonl.xz"
    _write_docs_corpus(corpus)
    out = tmp / "checkpoint"
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train_default_model.py"), "--smoke",
         "--corpus", str(corpus), "--out", str(out)],
        check=True, cwd=ROOT, timeout=600, capture_output=True,
    )
    return out


def test_writes_a_sharded_checkpoint_with_a_card(smoke_checkpoint: Path) -> None:
    names = {p.name for p in smoke_checkpoint.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json", "mtp.safetensors", "MODEL_CARD.md",
            "train_log.json"} <= names
    for p in smoke_checkpoint.glob("*.safetensors"):
        assert p.stat().st_size < 15_000_000
    with open(smoke_checkpoint / "model.safetensors.index.json") as f:
        weight_map = json.load(f)["weight_map"]
    assert {k for k, v in weight_map.items() if v == "mtp.safetensors"} == MTP_TENSORS
    log = json.loads((smoke_checkpoint / "train_log.json").read_text())
    assert log["steps"] == 20
    assert log["best"]["val_loss"] < log["history"][0]["val_loss"]  # it learned something
    card = (smoke_checkpoint / "MODEL_CARD.md").read_text()
    assert "validation perplexity" in card and "MTP top-1 accuracy" in card


def test_mtp_tensors_in_the_published_layout(smoke_checkpoint: Path) -> None:
    cfg = json.loads((smoke_checkpoint / "config.json").read_text())
    h = cfg["hidden_size"]
    with safe_open(smoke_checkpoint / "mtp.safetensors", framework="pt") as f:
        assert set(f.keys()) == MTP_TENSORS
        assert f.get_slice("mtp.fc.weight").get_shape() == [h, 2 * h]
        assert f.get_slice("mtp.layers.0.self_attn.q_proj.weight").get_shape() == [
            2 * cfg["num_attention_heads"] * cfg["head_dim"], h]
    assert cfg["mtp_num_hidden_layers"] == 1


def test_transformers_loads_it_with_its_tokenizer(smoke_checkpoint: Path) -> None:
    model, info = Qwen3_5ForCausalLM.from_pretrained(
        smoke_checkpoint, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    tok = AutoTokenizer.from_pretrained(smoke_checkpoint)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == model.config.eos_token_id
    for text in ("<|im_start|>", "<think>", "</tool_call>", "<tool_response>"):
        assert len(tok(text).input_ids) == 1
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    ids = tok("Once upon a time, in <think>x</think>").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "Once upon a time, in <think>x</think>"


def test_pagedserve_greedy_equals_transformers(smoke_checkpoint: Path) -> None:
    lm = load_model(smoke_checkpoint, device="cpu", dtype=torch.float32, progress=False)
    hf = Qwen3_5ForCausalLM.from_pretrained(smoke_checkpoint, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # exactly the requested number of tokens
    prompt = lm.require_tokenizer()("It is a truth universally acknowledged that").input_ids
    ref = hf_reference(hf, prompt, new_tokens=24)
    runner = ModelRunner(lm.model, CacheConfig(), RunnerConfig(max_model_len=128,
                                                               max_num_seqs=2))
    assert greedy(runner, prompt, 24).tokens == ref.tokens


def test_mtp_is_causal_and_predicts_from_shared_weights() -> None:
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, linear_num_key_heads=1, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16)
    torch.manual_seed(0)
    lm = Qwen3_5ForCausalLM(cfg).eval()
    mtp = MTP(cfg).eval()
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        hidden = lm.model(input_ids=ids).last_hidden_state
        a = mtp(lm, hidden[:, :-1], ids[:, 1:])
        changed = ids.clone()
        changed[0, -1] = (ids[0, -1] + 1) % 96
        b = mtp(lm, hidden[:, :-1], changed[:, 1:])
    assert a.shape == (1, 11, 96)
    assert torch.equal(a[:, :-1], b[:, :-1])  # only the last position saw the change
    assert not torch.equal(a[:, -1], b[:, -1])
    assert not any(n.startswith(("embed", "lm_head")) for n, _ in mtp.named_parameters())


def test_r_reader_and_rst_cleaning() -> None:
    # An R XDR serialization of c(a = "x", b = NA) -- a named character vector.
    def i32(v: int) -> bytes:
        return v.to_bytes(4, "big", signed=True)

    def charsxp(s: str) -> bytes:
        return i32(0x00040009) + i32(len(s)) + s.encode()

    blob = (b"X\n" + i32(3) + i32(0x040201) + i32(0x030500) + i32(5) + b"UTF-8"
            + i32(0x210) + i32(2) + charsxp("x") + i32(9) + i32(-1)  # STRSXP with attrs
            + i32(0x402) + i32(1) + charsxp("names")  # pairlist: tag symbol "names"
            + i32(16) + i32(2) + charsxp("a") + charsxp("b") + i32(254))
    assert corpus_mod._RReader(blob).item() == {"a": "x", "b": None}
    rst = (".. _label:\n\nTitle\n=====\n\n.. index:: single: x\n   pair: y\n\n"
           ".. function:: f(x)\n\n   Return :func:`g` of *x*, see ``h``.\n")
    assert corpus_mod.clean_rst(rst) == "Title\n\nf(x)\n\n   Return g of *x*, see h."


def test_tokenizer_appends_qwens_added_tokens_in_order() -> None:
    tok = tok_mod.train_tokenizer([(ROOT / "README.md").read_text(encoding="utf-8")], 300)
    assert tok.get_vocab_size() == 300
    first = 300 - len(tok_mod.ADDED_TOKENS)
    for i, (content, _) in enumerate(tok_mod.ADDED_TOKENS):
        assert tok.token_to_id(content) == first + i
