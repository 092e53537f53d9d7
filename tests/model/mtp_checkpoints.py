"""Tiny checkpoints with an MTP head in the published layout, and its oracle.

The head is ``scripts/default_model/mtp.py``'s ``MTP``: the module the default model trains,
written with transformers' own Qwen3.5 layers. Its random weights (norms perturbed, as
``build_hf_model`` perturbs the decoder's) are saved under ``mtp.*`` beside the decoder, in
the text-only layout (``model.*``) or the published vision-language one
(``model.language_model.*``, sharded with an index).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from hybrid_checkpoints import save_checkpoint, to_published_layout
from safetensors.torch import load_file, save_file
from transformers import Qwen3_5ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from default_model.mtp import MTP  # noqa: E402


def build_mtp(model: Qwen3_5ForCausalLM, seed: int = 0) -> MTP:
    """A random head for ``model`` (built from its config, whose attention implementation
    transformers has resolved: the head's attention is causal by itself)."""
    torch.manual_seed(seed + 7)
    mtp = MTP(model.config).eval()
    gen = torch.Generator().manual_seed(seed + 8)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return mtp


def _mtp_tensors(mtp: MTP) -> dict[str, torch.Tensor]:
    return {f"mtp.{k}": v.detach().contiguous() for k, v in mtp.state_dict().items()}


def _set_mtp_layers(config_path: Path, text_config: bool) -> None:
    config = json.loads(config_path.read_text())
    (config["text_config"] if text_config else config)["mtp_num_hidden_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2))


def save_with_mtp(model: Qwen3_5ForCausalLM, mtp: MTP, directory: Path,
                  layout: str = "text") -> Path:
    """``model`` and ``mtp`` as one checkpoint in ``layout`` ``"text"`` or ``"vl"``."""
    text_dir = save_checkpoint(model, directory / "text")
    if layout == "text":
        save_file(_mtp_tensors(mtp), str(text_dir / "mtp.safetensors"))
        _set_mtp_layers(text_dir / "config.json", text_config=False)
        return text_dir
    out = to_published_layout(text_dir, directory / "vl")
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):  # drop the placeholder mtp.*
        kept = {k: v for k, v in load_file(str(out / shard)).items()
                if not k.startswith("mtp.")}
        save_file(kept, str(out / shard))
    weight_map = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
    tensors = _mtp_tensors(mtp)
    save_file(tensors, str(out / "mtp.safetensors"))
    weight_map.update({k: "mtp.safetensors" for k in tensors})
    index_path.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    _set_mtp_layers(out / "config.json", text_config=True)
    return out


@torch.no_grad()
def mtp_oracle_logits(model: Qwen3_5ForCausalLM, mtp: MTP, ids: list[int]) -> torch.Tensor:
    """float32 ``[len(ids) - 1, vocab]``: row i predicts ``ids[i + 2]`` from the final
    hidden state at i and ``ids[i + 1]`` (transformers' layers throughout)."""
    x = torch.tensor([ids])
    hidden = model.model(input_ids=x).last_hidden_state  # [1, P, H], final-normed
    return mtp(model, hidden[:, :-1], x[:, 1:])[0].float()
