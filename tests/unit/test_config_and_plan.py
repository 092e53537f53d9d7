"""Model/cache configs and capacity planning, checked against the seed's published numbers."""

import json

import pytest
import torch

from pagedserve import cli, presets
from pagedserve import plan as planning
from pagedserve.config import CacheConfig, ModelConfig
from pagedserve.kv.memory import GiB, KVFootprint, MiB

SEED_LENS = [131072] + [8192] * 7


def qwen27b() -> ModelConfig:
    return ModelConfig.from_path(presets.config_path("qwen3.5-27b"))


def test_27b_shape_has_16_full_attention_layers():
    cfg = qwen27b()
    assert cfg.num_full_attention_layers == 16
    assert cfg.num_linear_attention_layers == 48
    assert cfg.full_attention_layers[:2] == (3, 7)
    assert cfg.rotary_dim == 64
    assert cfg.conv_dim == 2 * 16 * 128 + 48 * 128


def test_seed_memory_numbers_for_128k_plus_7x8k_q4_0():
    kv = KVFootprint(16, 4, 256, "q4_0", "q4_0", 16)
    rep = planning.workload_report(kv, SEED_LENS)
    assert rep.live_tokens == 188_416
    assert rep.padded_tokens == 1_048_576
    assert rep.paged_bytes_per_layer == 188_416 * 4 * 144 * 2
    assert round(rep.paged_bytes_per_layer / MiB) == 207
    assert rep.padded_bytes_per_layer == 1152 * MiB
    assert f"{rep.paged_bytes / GiB:.3f}" == "3.234"
    assert f"{rep.padded_bytes / GiB:.3f}" == "18.000"
    assert f"{rep.ratio:.2f}" == "5.57"
    assert f"{100 * rep.saving:.2f}" == "82.03"


@pytest.mark.parametrize("kv_type,row", [("f16", 512), ("bf16", 512), ("q8_0", 272),
                                         ("q4_0", 144)])
def test_bytes_per_row_at_d256(kv_type, row):
    kv = KVFootprint(1, 1, 256, kv_type, kv_type, 16)
    assert kv.bytes_per_token_per_layer == 2 * row


def test_plan_splits_budget_into_slots_and_blocks():
    cfg, cache = qwen27b(), CacheConfig("q4_0", "q4_0")
    p = planning.plan_capacity(cfg, cache, 40 * GiB, max_num_seqs=8, max_model_len=131072)
    assert p.bytes_per_token == 16 * 4 * 144 * 2
    assert p.bytes_per_block == 16 * p.bytes_per_token
    state = p.state_bytes_per_slot
    assert state == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4)
    assert p.num_blocks == (40 * GiB - 8 * state) // p.bytes_per_block
    assert p.padded_max_len_seqs == 40 * GiB // (131072 * p.bytes_per_token + state)


def test_plan_refuses_a_budget_below_one_max_len_sequence():
    with pytest.raises(ValueError, match="one sequence of max_model_len=131072 tokens needs"):
        planning.plan_capacity(qwen27b(), CacheConfig("f16", "f16"), 1 * GiB, 1, 131072)


def test_parsers_name_bad_values():
    assert planning.parse_bytes("4GiB") == 4 * GiB
    assert planning.parse_bytes("1.5e9") == 1_500_000_000
    assert planning.parse_seq_lens("131072,8192x7") == SEED_LENS
    with pytest.raises(ValueError, match="'4 parsecs' is not a size"):
        planning.parse_bytes("4 parsecs")
    with pytest.raises(ValueError, match="sequence length '0'"):
        planning.parse_seq_lens("0")


def test_plan_command_prints_seed_numbers(capsys):
    rc = cli.main(["plan", "--model", "preset:qwen3.5-27b", "--cache-type-k", "q4_0",
                   "--cache-type-v", "q4_0", "--memory", "40GiB", "--max-model-len", "131072",
                   "--seq-lens", "131072,8192x7", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["workload"]["live_tokens"] == 188_416
    assert out["workload"]["paged_bytes"] == 16 * 188_416 * 4 * 144 * 2


def test_plan_command_reports_errors_without_traceback(capsys):
    rc = cli.main(["plan", "--model", "preset:nope", "--memory", "1GiB"])
    assert rc == 2
    assert "unknown preset 'nope'" in capsys.readouterr().err


def test_published_layout_and_rejections():
    text = json.loads(presets.config_path("qwen3.5-27b").read_text())
    wrapped = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": {**text, "model_type": "qwen3_5_text"}}
    cfg = ModelConfig.from_hf_dict(wrapped)
    assert cfg.weight_prefix == "model.language_model."
    assert cfg.num_full_attention_layers == 16
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelConfig.from_hf_dict({**text, "num_experts": 256})
    with pytest.raises(ValueError, match="unsupported model_type 'llama'"):
        ModelConfig.from_hf_dict({**text, "model_type": "llama"})
    with pytest.raises(ValueError, match="head_dim 96 is not supported"):
        ModelConfig.from_hf_dict({**text, "head_dim": 96})


def test_cache_config_names_bad_values():
    with pytest.raises(ValueError, match=r"cache-type-k 'q5_0' is not a K/V storage type"):
        CacheConfig("q5_0", "f16")
    with pytest.raises(ValueError, match="kv-layout 'ring'"):
        CacheConfig(kv_layout="ring")
    with pytest.raises(ValueError, match="head_dim 48 cannot be stored as q4_0"):
        CacheConfig("q4_0", "f16").check_head_dim(48)


def test_plan_sets_the_prefix_checkpoints_apart(capsys):
    cfg, cache = qwen27b(), CacheConfig("q4_0", "q4_0")
    none = planning.plan_capacity(cfg, cache, 40 * GiB, 8, 32768)
    some = planning.plan_capacity(cfg, cache, 40 * GiB, 8, 32768, num_checkpoints=10)
    state = cfg.state_shapes(torch.bfloat16).bytes_per_slot
    per = state + 4 * cfg.vocab_size  # a checkpoint keeps a float32 logits row too
    assert some.checkpoint_bytes == 10 * per and some.num_checkpoints == 10
    assert some.bytes_per_checkpoint == per
    assert some.num_blocks == (40 * GiB - 8 * state - 10 * per) // none.bytes_per_block
    tapped = planning.plan_capacity(cfg, cache, 40 * GiB, 8, 32768, num_checkpoints=10,
                                    num_tap_slots=4)
    assert tapped.num_state_slots == 12
    assert tapped.num_blocks == (40 * GiB - 12 * state - 10 * per) // none.bytes_per_block
    assert planning.parse_checkpoint_memory("0") == 0
    assert planning.parse_checkpoint_memory(None) is None
    assert planning.parse_checkpoint_memory("1GiB") == GiB
    assert cli.main(["plan", "--model", "preset:qwen3.5-27b", "--memory", "40GiB",
                     "--max-model-len", "32768", "--prefix-checkpoint-memory", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert f"prefix cache     {2 * GiB // per} state checkpoints" in out
    assert "each: a state slot and a logits row" in out
    # The CUDA step sizes (8192-token idle chunks) over 2048-token intervals: 4 tap spares.
    assert "+ 12 state slots (4 of them spares for state taps)" in out


def test_plan_counts_fp8_weights_and_grows_the_pool(capsys):
    """27B at bf16 is 53.8 GB of weights; FP8 linears leave the K/V pool the difference."""
    base = ["plan", "--model", "preset:qwen3.5-27b", "--device-memory", "141GiB",
            "--max-model-len", "131072", "--json"]
    assert cli.main(base) == 0
    bf16 = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--quantization", "fp8"]) == 0
    fp8 = json.loads(capsys.readouterr().out)
    assert bf16["weights"]["fp8_bytes"] == 0
    assert round(bf16["weights"]["total_bytes"] / 1e9, 1) == 53.8
    w = fp8["weights"]
    # embed_tokens, lm_head and the GDN in_proj_a/b stay bf16 (Qwen's published choice),
    # with conv taps, norms (layer, final, q/k, GDN) and dt_bias/A_log.
    small = 48 * 10240 * 4 + 64 * 2 * 5120 + 5120 + 16 * 2 * 256 + 48 * 128 + 48 * 48 * 2
    assert w["dense_bytes"] == 2 * (2 * 248_320 * 5120 + 48 * 2 * 48 * 5120 + small)
    assert w["total_bytes"] < 0.55 * bf16["weights"]["total_bytes"]
    saved = bf16["weights"]["total_bytes"] - w["total_bytes"]
    assert fp8["plan"]["budget_bytes"] - bf16["plan"]["budget_bytes"] == saved
    assert fp8["plan"]["num_blocks"] > bf16["plan"]["num_blocks"]


def test_plan_with_speculation_counts_what_the_engine_adds(capsys):
    """MTP drafting: the head's weights and its attention layer's K/V, a spare copy of
    every state slot, and a hidden row per checkpoint."""
    cfg, cache = qwen27b(), CacheConfig("q4_0", "q4_0")
    plain = planning.plan_capacity(cfg, cache, 40 * GiB, 8, 32768, num_checkpoints=10)
    spec = planning.plan_capacity(cfg, cache, 40 * GiB, 8, 32768, num_checkpoints=10,
                                  speculative=True)
    layers = cfg.num_full_attention_layers
    assert spec.bytes_per_token * layers == plain.bytes_per_token * (layers + 1)
    assert spec.state_bytes_per_slot == 2 * plain.state_bytes_per_slot
    assert spec.bytes_per_checkpoint == plain.bytes_per_checkpoint + 2 * cfg.hidden_size
    base = ["plan", "--model", "preset:qwen3.5-27b", "--device-memory", "141GiB",
            "--max-model-len", "32768", "--json"]
    assert cli.main(base) == 0
    without = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--speculative-config",
                            '{"method": "mtp", "num_speculative_tokens": 3}']) == 0
    with_mtp = json.loads(capsys.readouterr().out)
    h = cfg.hidden_size
    # fc [H, 2H]; two pre-fc norms and the final norm; one full-attention decoder layer.
    layer = (h * 24 * 256 * 2 + 2 * h * 4 * 256 + 24 * 256 * h + 2 * 256
             + 3 * h * 17408 + 2 * h)
    head = 2 * h * h + 3 * h + layer
    assert with_mtp["weights"]["total_bytes"] - without["weights"]["total_bytes"] == 2 * head
    assert with_mtp["plan"]["speculative"] and not without["plan"]["speculative"]
    eagle = '{"method": "eagle", "num_speculative_tokens": 2}'
    assert cli.main(base + ["--speculative-config", eagle]) != 0
    assert "method 'eagle' is not supported" in capsys.readouterr().err


def test_plan_counts_a_draft_vocabularys_head_rows_and_narrower_buffers(capsys):
    """With --device-memory the speculative graphs' buffers (draft logits rows of N'
    columns) and a subset's LM-head rows come out of the budget; a preset has no
    tokenizer, so its draft vocabulary is exactly the first draft_vocab_size ids."""
    cfg = qwen27b()
    v, h, k, seqs = cfg.vocab_size, cfg.hidden_size, 3, 8
    assert (v, h) == (248_320, 5120)
    base = ["plan", "--model", "preset:qwen3.5-27b", "--device-memory", "141GiB",
            "--max-model-len", "32768", "--max-num-seqs", str(seqs), "--json"]

    def plan(spec: str | None) -> dict:
        assert cli.main(base + ([] if spec is None else ["--speculative-config", spec])) == 0
        return json.loads(capsys.readouterr().out)

    mtp = '{"method": "mtp", "num_speculative_tokens": 3'
    without, whole, subset = plan(None), plan(mtp + "}"), plan(mtp + ', "draft_vocab_size": 32768}')
    assert "speculation" not in without
    w, s = whole["speculation"], subset["speculation"]
    assert (w["draft_vocab_rows"], w["draft_head_bytes"]) == (v, 0)
    assert s["draft_vocab_rows"] == 32768
    assert s["draft_head_bytes"] == 32768 * (h * 2 + 8)  # bf16 rows and int64 ids
    # The draft logits rows shrink from V to N' columns: (k + 1) x seqs x 2 rows of them.
    assert w["graph_bytes"] - s["graph_bytes"] == (k + 1) * seqs * 2 * (v - 32768) * 4
    # The subset's rows are a copy beside the checkpoint's weights, not one of them.
    assert subset["weights"]["total_bytes"] == whole["weights"]["total_bytes"]
    mtp_weights = whole["weights"]["total_bytes"] - without["weights"]["total_bytes"]
    assert without["plan"]["budget_bytes"] - whole["plan"]["budget_bytes"] == \
        mtp_weights + w["graph_bytes"]
    assert whole["plan"]["budget_bytes"] - subset["plan"]["budget_bytes"] == \
        s["draft_head_bytes"] - (w["graph_bytes"] - s["graph_bytes"])
    assert cli.main(base[:-1] + ["--speculative-config", mtp + ', "draft_vocab_size": 32768}']) \
        == 0
    assert "drafts over 32768 of 248320 token ids (their LM-head rows 320.2 MiB)" \
        in capsys.readouterr().out


@pytest.mark.parametrize("size, message", [
    (0, r"draft_vocab_size must be an integer in [1, vocab_size] (the model's vocabulary), "
        r"got 0"),
    (248_321, r"draft_vocab_size must be an integer in [1, 248320] (the model's vocab_size), "
              r"got 248321"),
])
def test_plan_rejects_a_draft_vocab_size_outside_the_vocabulary(capsys, size, message):
    spec = f'{{"method": "mtp", "num_speculative_tokens": 3, "draft_vocab_size": {size}}}'
    assert cli.main(["plan", "--model", "preset:qwen3.5-27b", "--memory", "40GiB",
                     "--speculative-config", spec]) != 0
    assert message in capsys.readouterr().err
