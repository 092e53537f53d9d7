"""FP8 block weights: the published ``*-FP8`` layout and ``--quantization fp8``, on the CPU.

The checkpoints are written in the published format by an independent float64 oracle
(``hybrid_checkpoints.oracle_quantize``) on a shape whose blocks are partial on both axes and
whose fused parts end inside a 128-row block. Loaded weights are held bit for bit to the
oracle's dequantization; tokens and logits to transformers' Qwen3.5 holding the same
dequantized weights.

transformers loads FP8 checkpoints itself only with ``accelerate`` installed (its
FineGrainedFP8 integration imports it); on a machine without a GPU it dequantizes every FP8
weight while loading. That dequantization takes the block size as ``rows // scale rows``, so
it is right only where every dimension is a multiple of 128: the comparison with it runs on
``h128-fp8-tied``, and the partial-block shape is held to the float64 oracle instead.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from engine_greedy import engine_greedy
from greedy_driver import greedy
from hybrid_checkpoints import (
    NEW_TOKENS,
    build_hf_model,
    fp8_oracle_weights,
    hf_config,
    hf_reference,
    oracle_dequantize,
    oracle_quantize,
    to_fp8_checkpoint,
    to_published_layout,
)
from mtp_checkpoints import build_mtp, save_with_mtp
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM

from pagedserve.config import CacheConfig
from pagedserve.engine.runner import ModelRunner, RunnerConfig
from pagedserve.model.fp8_linear import Fp8Linear, RowConcatLinear, split_outputs
from pagedserve.model.loader import LoadedModel, load_model
from pagedserve.model.mtp import MTPHead
from pagedserve.model.qwen3_5 import Qwen3_5Model
from pagedserve.model.weight_footprint import weight_footprint
from pagedserve.model.weights import packed_sources
from pagedserve.quant import fp8
from pagedserve.quant.config import parse_quantization

SHAPE = "h200-fp8-untied"
EXACT = CacheConfig(cache_type_k="f32", cache_type_v="f32")
TOLERANCE = 1e-4


# ---- the format ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(200, 136), (128, 256), (64, 300), (300, 1), (1, 129)])
def test_quantize_matches_the_float64_oracle_bit_for_bit(shape) -> None:
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    w = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen) * 3
    w[: min(shape[0], 128), : min(shape[1], 128)] *= 1e-3  # blocks of different magnitude
    q, scale = fp8.quantize(w)
    q_ref, scale_ref = oracle_quantize(w)
    assert scale.shape == fp8.scale_shape(*shape) == scale_ref.shape
    assert torch.equal(scale, scale_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(fp8.dequantize(q, scale), oracle_dequantize(q_ref, scale_ref).float())


def test_zero_block_quantizes_to_zero() -> None:
    q, scale = fp8.quantize(torch.zeros(130, 5))
    assert torch.equal(scale, torch.ones(2, 1)) and not q.float().any()


def test_fused_parts_keep_their_own_block_rows() -> None:
    """Parts of 200 and 72 rows: part 1's rows use scale row 2, not part 0's partial row 1."""
    assert fp8.scale_rows((200, 72)).tolist() == [0] * 128 + [1] * 72 + [2] * 72
    a, b = torch.randn(200, 136), torch.randn(72, 136) * 100
    (qa, sa), (qb, sb) = fp8.quantize(a), fp8.quantize(b)
    fused = fp8.dequantize(torch.cat([qa, qb]), torch.cat([sa, sb]), (200, 72))
    assert torch.equal(fused, torch.cat([fp8.dequantize(qa, sa), fp8.dequantize(qb, sb)]))


# ---- checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(5, 3, 2, 2), (8, 2, 2), (4, 4, 2, 2), (6, 6)],
                         ids=["on-boundaries", "fewer-splits", "split-inside-a-child",
                              "child-inside-a-split"])
def test_row_concat_split_outputs_are_the_float64_product_split(sizes) -> None:
    """``split_outputs`` of a ``RowConcatLinear`` (8 rows in one child, 4 in the other)
    equals the float64 product with the children's rows stacked, split by ``sizes``,
    whether or not the children end on the split's boundaries."""
    gen = torch.Generator().manual_seed(3)
    children = [torch.nn.Linear(16, n, bias=False) for n in (8, 4)]
    for child in children:
        child.weight.data = torch.randn(child.weight.shape, generator=gen)
    x = torch.randn(5, 16, generator=gen)
    got = split_outputs(RowConcatLinear(children), x, sizes)
    w = torch.cat([c.weight.data for c in children]).double()
    want = (x.double() @ w.T).split(sizes, dim=-1)
    assert [t.shape for t in got] == [t.shape for t in want]
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def fp8_checkpoint(checkpoints, tmp_path_factory) -> Path:
    return to_fp8_checkpoint(checkpoints(SHAPE).path, tmp_path_factory.mktemp("fp8") / "c")


@pytest.fixture(scope="module")
def fp8_loaded(fp8_checkpoint) -> LoadedModel:
    return load_model(fp8_checkpoint, progress=False)


def effective_weight(module: torch.nn.Module) -> torch.Tensor:
    """A linear layer's weight as float32 ``[N, K]``, whatever its storage."""
    if isinstance(module, Fp8Linear):
        return module.dequantized(torch.float32)
    if isinstance(module, RowConcatLinear):
        return torch.cat([effective_weight(p) for p in module.pieces])
    return module.weight.float()


def assert_weights_equal(model: Qwen3_5Model, expected: dict[str, torch.Tensor],
                         prefix: str) -> None:
    """Every parameter of ``model`` equals ``expected`` (checkpoint names, float64) rounded
    to float32, bit for bit; fused parameters against their parts in row order."""
    with torch.device("meta"):
        fresh = Qwen3_5Model(model.config)
    for name, parts in packed_sources(fresh).items():
        owner, _, attr = name.rpartition(".")
        module = model.get_submodule(owner)
        linear = isinstance(module, (torch.nn.Linear, Fp8Linear, RowConcatLinear))
        got = effective_weight(module) if linear else getattr(module, attr)
        keys = [p if p == "lm_head.weight" else prefix + p for p in parts]
        want = torch.cat([expected[k] for k in keys]).float()
        assert torch.equal(got.float(), want), name


def test_published_layout_loads_bit_for_bit(fp8_checkpoint, fp8_loaded) -> None:
    model = fp8_loaded.model
    assert fp8_loaded.quantization == "fp8"
    gdn = model.layers[0].linear_attn.in_proj
    # in_proj_qkv and in_proj_z in FP8 as one fused weight, in_proj_b and in_proj_a in float.
    assert isinstance(gdn, RowConcatLinear)
    assert isinstance(gdn.pieces[0], Fp8Linear) and gdn.pieces[0].parts == (160, 96)
    assert type(gdn.pieces[1]) is torch.nn.Linear and gdn.pieces[1].weight.shape == (6, 200)
    qkv = model.layers[1].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.parts == (384, 64, 64)
    assert qkv.weight_scale_inv.shape == (3 + 1 + 1, 2)  # every part its own block rows
    assert type(model.lm_head) is torch.nn.Linear  # modules_to_not_convert
    assert_weights_equal(model, fp8_oracle_weights(fp8_checkpoint), "model.")


def test_fp8_data_is_stored_not_dequantized(fp8_checkpoint, fp8_loaded) -> None:
    """The fused weight holds the checkpoint's bytes and scales as they are."""
    raw = load_file(str(fp8_checkpoint / "model.safetensors"))
    up = fp8_loaded.model.layers[2].mlp.gate_up_proj
    assert up.weight.dtype == torch.float8_e4m3fn
    p = "model.layers.2.mlp."
    want = torch.cat([raw[p + "gate_proj.weight"], raw[p + "up_proj.weight"]])
    assert torch.equal(up.weight.view(torch.uint8), want.view(torch.uint8))
    scales = torch.cat([raw[p + "gate_proj.weight_scale_inv"], raw[p + "up_proj.weight_scale_inv"]])
    assert torch.equal(up.weight_scale_inv, scales)


def test_weight_bytes_count_one_byte_per_fp8_parameter(fp8_checkpoint, fp8_loaded) -> None:
    raw = load_file(str(fp8_checkpoint / "model.safetensors"))
    expected = sum(t.numel() * (1 if t.dtype == torch.float8_e4m3fn else 4)
                   for t in raw.values())
    assert fp8_loaded.weights_bytes == expected
    runner = ModelRunner(fp8_loaded.model, CacheConfig(), RunnerConfig(max_model_len=64))
    assert runner.memory_usage().weights_bytes == expected


def test_vl_layout_loads_the_same_weights(checkpoints, fp8_loaded, tmp_path) -> None:
    vl = to_published_layout(checkpoints(SHAPE).path, tmp_path / "vl")
    vl_fp8 = to_fp8_checkpoint(vl, tmp_path / "vl-fp8")
    qc = json.loads((vl_fp8 / "config.json").read_text())["quantization_config"]
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in qc["modules_to_not_convert"]
    loaded = load_model(vl_fp8, progress=False)
    assert loaded.config.weight_prefix == "model.language_model."
    ref = dict(fp8_loaded.model.named_parameters())
    for name, p in loaded.model.named_parameters():
        assert p.dtype == ref[name].dtype and torch.equal(p.view(torch.uint8), ref[name].view(
            torch.uint8)) if p.dtype == torch.float8_e4m3fn else torch.equal(p, ref[name]), name


# ---- against transformers -----------------------------------------------------------------


def hf_with_weights(weights: dict[str, torch.Tensor]) -> Qwen3_5ForCausalLM:
    """transformers' Qwen3.5 of ``SHAPE`` holding ``weights`` (checkpoint names) in float32."""
    model = build_hf_model(SHAPE)
    state = {k: v.float() for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(state)
    return model


def test_tokens_match_transformers_on_the_dequantized_weights(
    checkpoints, fp8_checkpoint, fp8_loaded,
) -> None:
    prompt = checkpoints(SHAPE).prompt
    ref = hf_reference(hf_with_weights(fp8_oracle_weights(fp8_checkpoint)), prompt)
    runner = ModelRunner(fp8_loaded.model, EXACT, RunnerConfig(max_model_len=128))
    seq = greedy(runner, prompt, NEW_TOKENS, chunk=7, forced=ref.tokens)
    assert (torch.stack(seq.step_logits) - ref.step_logits).abs().max() <= TOLERANCE
    runner = ModelRunner(fp8_loaded.model, CacheConfig(), RunnerConfig(max_model_len=128))
    assert greedy(runner, prompt, NEW_TOKENS, chunk=16).tokens == ref.tokens
    # FP8 moved the weights: the float checkpoint's tokens are a different reference.
    assert (ref.prompt_logits - checkpoints(SHAPE).reference.prompt_logits).abs().max() > 0


def test_transformers_loads_the_fp8_checkpoint_itself(checkpoints, tmp_path) -> None:
    pytest.importorskip("accelerate", reason="transformers' FP8 loader needs accelerate")
    shape = "h128-fp8-tied"
    path = to_fp8_checkpoint(checkpoints(shape).path, tmp_path / "fp8")
    hf = Qwen3_5ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 256
    loaded = load_model(path, progress=False)
    # transformers' dequantized weights are ours, bit for bit.
    assert_weights_equal(loaded.model, {"model." + k.removeprefix("model."): v.double()
                                        for k, v in hf.state_dict().items()}, "model.")
    prompt = checkpoints(shape).prompt
    ref = hf_reference(hf, prompt)
    runner = ModelRunner(loaded.model, EXACT, RunnerConfig(max_model_len=128))
    seq = greedy(runner, prompt, NEW_TOKENS, forced=ref.tokens)
    assert seq.tokens == ref.tokens
    assert (torch.stack(seq.step_logits) - ref.step_logits).abs().max() <= TOLERANCE


# ---- --quantization fp8 -------------------------------------------------------------------


def test_quantization_fp8_quantizes_a_float_checkpoint_on_load(checkpoints, fp8_loaded) -> None:
    ckpt = checkpoints(SHAPE)
    loaded = load_model(ckpt.path, progress=False, quantization="fp8")
    assert loaded.quantization == "fp8"
    raw = load_file(str(ckpt.path / "model.safetensors"))
    expected = {}
    for name, t in raw.items():
        module = name.removesuffix(".weight")
        if t.ndim == 2 and "embed_tokens" not in name and not module.endswith(
                ("lm_head", "in_proj_a", "in_proj_b")):
            expected[name] = oracle_dequantize(*oracle_quantize(t))
        else:
            expected[name] = t.double()
    assert_weights_equal(loaded.model, expected, "model.")
    assert isinstance(loaded.model.layers[2].mlp.down_proj, Fp8Linear)
    assert type(loaded.model.lm_head) is torch.nn.Linear
    # The very bytes of the FP8 checkpoint the oracle writes from the same float tensors.
    published = dict(fp8_loaded.model.named_parameters())
    for name, p in loaded.model.named_parameters():
        assert torch.equal(p.view(torch.uint8), published[name].view(torch.uint8)), name


def test_quantization_fp8_in_bf16_model_dtype(checkpoints) -> None:
    """Activations in bf16; FP8 weights dequantize to bf16 per call."""
    loaded = load_model(checkpoints(SHAPE).path, dtype="bfloat16", progress=False,
                        quantization="fp8")
    layer = loaded.model.layers[1].self_attn.qkv_proj
    x = torch.randn(3, 200, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    want = torch.nn.functional.linear(x, layer.dequantized(torch.float32).to(torch.bfloat16))
    assert torch.equal(layer(x), want)


def test_unknown_quantization_flag_is_rejected(checkpoints) -> None:
    with pytest.raises(ValueError, match="quantization 'int4' is not supported"):
        load_model(checkpoints(SHAPE).path, progress=False, quantization="int4")


# ---- rejections at start-up ---------------------------------------------------------------


def _variant(src: Path, dst: Path, config=None, weights=None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        config(raw["quantization_config"])
        (dst / "config.json").write_text(json.dumps(raw))
    if weights is not None:
        file = dst / "model.safetensors"
        w = load_file(str(file))
        weights(w)
        save_file(w, str(file))
    return dst


L0 = "model.layers.0."


@pytest.mark.parametrize(
    "config, weights, message",
    [
        (lambda q: q.update(quant_method="gptq"), None,
         "quantization_config.quant_method 'gptq' is not supported"),
        (lambda q: q.update(fmt="e5m2"), None, "quantization_config.fmt 'e5m2' is not supported"),
        (lambda q: q.update(weight_block_size=[64, 64]), None,
         "quantization_config.weight_block_size [64, 64] is not supported"),
        (lambda q: q.pop("weight_block_size"), None,
         "quantization_config.weight_block_size None is not supported"),
        (lambda q: q.update(activation_scheme="static"), None,
         "quantization_config.activation_scheme 'static' is not supported"),
        (None, lambda w: w.pop(L0 + "mlp.up_proj.weight_scale_inv"),
         f"missing scale tensor {L0}mlp.up_proj.weight_scale_inv for the FP8 weight "
         f"{L0}mlp.up_proj.weight"),
        (None, lambda w: w.update({L0 + "mlp.up_proj.weight_scale_inv": torch.ones(1, 2)}),
         f"{L0}mlp.up_proj.weight_scale_inv has shape [1, 2]; a [136, 200] weight in 128x128 "
         "blocks needs [2, 2]"),
        (None, lambda w: w.update({L0 + "mlp.up_proj.weight": w[L0 + "mlp.up_proj.weight"].to(
            torch.float8_e5m2)}),
         f"{L0}mlp.up_proj.weight is stored as F8_E5M2; quantization_config.fmt 'e4m3' needs"),
        (None, lambda w: w.update({L0 + "mlp.up_proj.weight": w[
            L0 + "mlp.up_proj.weight"].float()}),
         f"{L0}mlp.up_proj.weight is stored as F32, but quantization_config converts it"),
        (lambda q: q["modules_to_not_convert"].append("down_proj"), None,
         f"{L0}mlp.down_proj.weight is stored as F8_E4M3, but quantization_config."
         "modules_to_not_convert lists it"),
        (None, lambda w: w.update({L0 + "input_layernorm.weight": w[
            L0 + "input_layernorm.weight"].to(torch.float8_e4m3fn)}),
         f"{L0}input_layernorm.weight is stored as F8_E4M3, but only linear projection"),
        (None, lambda w: w.update({
            L0 + "linear_attn.in_proj_a.weight_scale_inv": torch.ones(1, 2)}),
         f"unexpected tensors: {L0}linear_attn.in_proj_a.weight_scale_inv"),
        (None, lambda w: w.update({"model.norm.weight_scale_inv": torch.ones(1)}),
         "unexpected tensors: model.norm.weight_scale_inv"),
    ],
    ids=["method", "fmt", "block", "no-block", "static", "no-scale", "scale-shape", "e5m2",
         "float-but-converted", "fp8-but-skipped", "fp8-norm", "scale-of-float", "orphan-scale"],
)
def test_bad_fp8_checkpoints_fail_at_start_up(fp8_checkpoint, tmp_path, config, weights,
                                              message) -> None:
    path = _variant(fp8_checkpoint, tmp_path / "bad", config, weights)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(path, progress=False)


def test_quantization_config_in_text_config_is_read(fp8_checkpoint, tmp_path) -> None:
    path = _variant(fp8_checkpoint, tmp_path / "nested")
    raw = json.loads((path / "config.json").read_text())
    raw["text_config"] = {**hf_config(SHAPE).to_dict(), "quantization_config": raw.pop(
        "quantization_config")}
    (path / "config.json").write_text(json.dumps(raw))
    assert load_model(path, progress=False).quantization == "fp8"


# ---- memory and the engine ----------------------------------------------------------------


@pytest.mark.parametrize("source", ["published", "online", "float"])
def test_weight_footprint_from_config_equals_loaded_bytes(checkpoints, fp8_checkpoint,
                                                          fp8_loaded, source) -> None:
    path = fp8_checkpoint if source == "published" else checkpoints(SHAPE).path
    raw = json.loads((path / "config.json").read_text())
    requested = "fp8" if source == "online" else None
    if source == "published":
        loaded = fp8_loaded
    else:
        loaded = load_model(path, progress=False, quantization=requested)
    footprint = weight_footprint(loaded.config, torch.float32,
                                 parse_quantization(raw, requested))
    assert footprint.total_bytes == loaded.weights_bytes
    assert (footprint.fp8_bytes > 0) == (source != "float")


def test_engine_serves_fp8_on_the_cpu(checkpoints, fp8_checkpoint, fp8_loaded, caplog) -> None:
    """``EngineConfig.quantization`` reaches the loader; the log counts FP8 bytes."""
    from pagedserve.engine.llm_engine import EngineConfig, LLMEngine

    with pytest.raises(ValueError, match="quantization 'int8' is not supported"):
        EngineConfig(model=str(checkpoints(SHAPE).path), quantization="int8")
    caplog.set_level("INFO", logger="pagedserve.engine.llm_engine")
    engine = LLMEngine(EngineConfig(model=str(checkpoints(SHAPE).path), quantization="fp8",
                                    max_model_len=128, progress=False))
    assert engine.loaded.quantization == "fp8"
    assert "FP8 block-128 linear layers" in caplog.text
    assert engine.runner.memory_usage().weights_bytes == fp8_loaded.weights_bytes
    prompt = checkpoints(SHAPE).prompt
    tokens = engine_greedy(engine, prompt, 6)
    runner = ModelRunner(fp8_loaded.model, CacheConfig(), RunnerConfig(max_model_len=128))
    assert tokens == greedy(runner, prompt, 6).tokens


def test_random_weights_quantized_in_place(checkpoints) -> None:
    """The preset path: a model made without a checkpoint, quantized per fused part."""
    from pagedserve.model.fp8_weights import quantize_linears
    from pagedserve.model.random_weights import random_model
    from pagedserve.quant.config import ONLINE_NOT_CONVERTED, Fp8Config

    cfg = load_model(checkpoints(SHAPE).path, progress=False).config
    model = random_model(cfg, torch.device("cpu"), torch.bfloat16)
    dense = {n: p.clone() for n, p in model.named_parameters()}
    quantize_linears(model, cfg.weight_prefix, Fp8Config(False, ONLINE_NOT_CONVERTED))
    split = {"mlp.gate_up_proj": (136, 136), "self_attn.qkv_proj": (384, 64, 64),
             "linear_attn.in_proj": (160, 96, 3, 3), "mlp.down_proj": (200,),
             "self_attn.o_proj": (200,), "linear_attn.out_proj": (200,)}
    for i, layer in enumerate(model.layers):
        for sub, rows in split.items():
            if not hasattr(layer, sub.split(".")[0]):
                continue
            w = dense[f"layers.{i}.{sub}.weight"].split(rows)
            # in_proj_b and in_proj_a (parts 2 and 3 of in_proj) stay in the model dtype.
            want = [p.float() if sub.endswith("in_proj") and n >= 2
                    else oracle_dequantize(*oracle_quantize(p)).float() for n, p in enumerate(w)]
            got = effective_weight(layer.get_submodule(sub))
            assert torch.equal(got, torch.cat(want)), (i, sub)
    assert type(model.lm_head) is torch.nn.Linear
    assert weight_footprint(cfg, torch.bfloat16, Fp8Config(False, ONLINE_NOT_CONVERTED)
                            ).total_bytes == sum(p.numel() * p.element_size()
                                                 for p in model.parameters())


def test_cli_flag_maps_onto_engine_config() -> None:
    import argparse

    from pagedserve.commands.engine_args import add_engine_arguments, engine_config

    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_config(p.parse_args(["--quantization", "fp8"])).quantization == "fp8"
    assert engine_config(p.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        p.parse_args(["--quantization", "awq"])


# ---- the MTP head -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_mtp_checkpoint(checkpoints, tmp_path_factory) -> Path:
    """``SHAPE`` with a random MTP head, in the published layout and FP8 format: the head's
    decoder-layer projections in FP8 with bf16 block scales, ``mtp.fc`` kept in float and
    listed in ``modules_to_not_convert``, as in Qwen's FP8 checkpoints."""
    hf = checkpoints(SHAPE).hf_model
    root = tmp_path_factory.mktemp("fp8-mtp")
    path = save_with_mtp(hf, build_mtp(hf), root, "vl")
    return to_fp8_checkpoint(path, root / "fp8", scale_dtype=torch.bfloat16)


def assert_mtp_weights_equal(head: torch.nn.Module, config, expected: dict[str, torch.Tensor],
                             ) -> None:
    """Every parameter of MTP head ``head`` equals ``expected`` (checkpoint names, float64)
    rounded to float32, bit for bit; fused parameters against their parts in row order."""
    with torch.device("meta"):
        fresh = MTPHead(config)
    for name, parts in packed_sources(fresh).items():
        owner, _, attr = name.rpartition(".")
        module = head.get_submodule(owner)
        linear = isinstance(module, (torch.nn.Linear, Fp8Linear, RowConcatLinear))
        got = effective_weight(module) if linear else getattr(module, attr)
        want = torch.cat([expected["mtp." + p] for p in parts]).float()
        assert torch.equal(got.float(), want), name


def test_published_fp8_mtp_head_loads_bit_for_bit(fp8_mtp_checkpoint) -> None:
    qc = json.loads((fp8_mtp_checkpoint / "config.json").read_text())["quantization_config"]
    assert "mtp.fc" in qc["modules_to_not_convert"]
    raw = load_file(str(fp8_mtp_checkpoint / "mtp.safetensors"))
    assert raw["mtp.layers.0.mlp.down_proj.weight_scale_inv"].dtype == torch.bfloat16
    loaded = load_model(fp8_mtp_checkpoint, progress=False, mtp=True)
    head = loaded.model.mtp
    assert type(head.fc) is torch.nn.Linear
    layer = head.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                 layer.mlp.down_proj):
        assert isinstance(proj, Fp8Linear)
    expected = fp8_oracle_weights(fp8_mtp_checkpoint)
    assert_mtp_weights_equal(head, loaded.config, expected)
    assert_weights_equal(loaded.model, expected, "model.language_model.")


def test_quantization_fp8_converts_the_mtp_layer_but_not_its_fc(checkpoints, tmp_path) -> None:
    hf = checkpoints(SHAPE).hf_model
    path = save_with_mtp(hf, build_mtp(hf), tmp_path, "text")
    loaded = load_model(path, progress=False, quantization="fp8", mtp=True)
    raw = load_file(str(path / "mtp.safetensors"))
    expected = {name: t.double() if name == "mtp.fc.weight" or t.ndim != 2
                else oracle_dequantize(*oracle_quantize(t)) for name, t in raw.items()}
    head = loaded.model.mtp
    assert type(head.fc) is torch.nn.Linear
    assert isinstance(head.layers[0].mlp.gate_up_proj, Fp8Linear)
    assert_mtp_weights_equal(head, loaded.config, expected)


def test_speculative_greedy_on_the_fp8_checkpoint_is_transformers(checkpoints,
                                                                  fp8_mtp_checkpoint) -> None:
    """Drafts from the FP8 head, verified by the FP8 target: the tokens are transformers'
    greedy tokens over the dequantized weights, and the head's drafts are kept at times."""
    from pagedserve.engine.llm_engine import EngineConfig, LLMEngine

    lm = "model.language_model."  # the published layout's prefix; transformers' is "model."
    weights = {k.replace(lm, "model.", 1): v
               for k, v in fp8_oracle_weights(fp8_mtp_checkpoint).items()
               if k.startswith(lm) or k == "lm_head.weight"}
    prompt = checkpoints(SHAPE).prompt
    ref = hf_reference(hf_with_weights(weights), prompt)
    engine = LLMEngine(EngineConfig(
        model=str(fp8_mtp_checkpoint), dtype="float32", progress=False, max_model_len=128,
        check_integrity=True,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    assert engine_greedy(engine, prompt, NEW_TOKENS) == ref.tokens
    assert engine.spec is not None and engine.spec.stats.num_draft_tokens > 0
    assert engine.kv.pool.num_used_blocks == 0
