"""MODEL_CARD.md for a checkpoint written by ``scripts/train_default_model.py``."""

from __future__ import annotations

from typing import Any

LICENSES = """\
- **Jane Austen's six novels** (*Sense and Sensibility*, *Pride and Prejudice*, *Mansfield
  Park*, *Emma*, *Northanger Abbey*, *Persuasion*), from Debian's `r-cran-janeaustenr`
  (Julia Silge's janeaustenr; package MIT, texts in the public domain).
- **The King James Version of the Bible**, from Debian's `bible-kjv-text`, read out with
  the `bible` program of `bible-kjv` (the text is in the public domain); one document per
  chapter.
- **The Python 3.11 documentation**, reST sources from Debian's `python3.11-doc`
  (PSF License Version 2), markup lightened; whatsnew, distutils and the C API left out.

`scripts/default_model/corpus.py` builds the corpus from the .deb files
(`apt-get download`, nothing installed); every 20th document of each source is held out
for validation. The weights are released under the project's license (Apache-2.0)."""

RETRAINING = """\
## Retraining

    python scripts/default_model/corpus.py --out .corpus/corpus.jsonl.xz    # a CPU machine
    bash benchmarks/gpu_run.sh train-default-model:450   # the GPU; carry .whl and .corpus
    cat default-model.tar.part-* | tar -x                # the files back: default-model/
    python scripts/default_model/measure.py default-model  # pagedserve's figures, this card

or directly `python scripts/train_default_model.py --corpus .corpus/corpus.jsonl.xz
--out OUT --minutes 5`. pagedserve ships the result as `pagedserve/model/default_checkpoint/`."""


GDN_OPS = {
    "fla": "fla's chunked kernels",
    "torch": "transformers' torch reference ops (fla's gated backward refuses Hopper GPUs "
             "with Triton older than 3.7.1, whose compiler gets it wrong there)",
}


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _corpus_lines(manifest: dict[str, Any] | None) -> list[str]:
    if not manifest:
        return []
    debs = ", ".join(f"`{p['deb']}`" for p in manifest["packages"].values())
    return [f"- Corpus file: {_mb(manifest['bytes_uncompressed'])} of JSON lines "
            f"({_mb(manifest['bytes_compressed'])} xz), sha256 "
            f"`{manifest['sha256_uncompressed'][:16]}…`, from {debs}."]


def render(info: dict[str, Any]) -> str:
    shape, data, best = info["shape"], info["data"], info["best"]
    params = info["parameters"]
    files = info.get("files", {})
    weights = sum(v for k, v in files.items() if k.endswith(".safetensors"))
    lines = [
        "# pagedserve default model",
        "",
        "A small model of exactly Qwen3.5's dense architecture (Gated DeltaNet and gated "
        "full attention at 3:1, partial RoPE, q/k norms, output gate), with a "
        "multi-token-prediction module in Qwen's published `mtp.*` layout, trained from "
        "scratch by `scripts/train_default_model.py` so that pagedserve serves readable "
        "English with nothing downloaded. It is tiny: it writes English in the manner of "
        "its corpus (Austen, the King James Bible, the Python docs), not facts, and it "
        "follows no instructions.",
        "",
        "## Model",
        "",
        f"- {params['model'] / 1e6:.1f}M parameters (tied embeddings) + "
        f"{params['mtp'] / 1e6:.1f}M in the MTP module; bf16 safetensors, {_mb(weights)} "
        "in shards under 15 MB.",
        f"- {shape['num_hidden_layers']} layers (3 GDN, then 1 attention, repeated), hidden "
        f"{shape['hidden_size']}, MLP {shape['intermediate_size']}; attention "
        f"{shape['num_attention_heads']} query / {shape['num_key_value_heads']} K/V heads of "
        f"{shape['head_dim']} (RoPE on {shape['partial_rotary_factor']:.0%}); GDN "
        f"{shape['linear_num_key_heads']} key / {shape['linear_num_value_heads']} value heads "
        f"of {shape['linear_key_head_dim']}/{shape['linear_value_head_dim']}.",
        f"- Tokenizer: byte-level BPE of {shape['vocab_size']} tokens trained on the same "
        "corpus, with Qwen's 26 added tokens and the Qwen3.5 chat template.",
        "- MTP: `mtp.fc` over [normed embedding of token t+1, normed final hidden state "
        "at t], one full-attention decoder layer (`mtp.layers.0.*`), `mtp.norm`; "
        "embeddings and head shared. It predicts token t+2.",
        "",
        "## Data",
        "",
        LICENSES,
        "",
        f"- Documents: {data['documents']['train']} train, {data['documents']['val']} "
        f"validation ({data['documents_by_source']}).",
        f"- Tokens: {data['tokens']['train']:,} train, {data['tokens']['val']:,} validation "
        f"({data['characters']['train'] / max(1, data['tokens']['train']):.2f} characters "
        "per token).",
        *_corpus_lines(data.get("manifest")),
        "",
        "## Training",
        "",
        f"- {info['steps']} steps, {info['tokens_seen']:,} tokens seen "
        f"({info['tokens_seen'] / max(1, data['tokens']['train']):.1f} epochs) in "
        f"{info['seconds']:.0f} s on {info['device']}; AdamW, cosine schedule over the time or "
        "token budget (the first to run out), "
        "bf16 autocast on CUDA; loss = main + w * MTP (arguments in `train_log.json`).",
        f"- Gated DeltaNet ops: {GDN_OPS.get(info.get('gdn_ops', ''), 'not recorded')}.",
        f"- Kept: the weights of the best validation loss, at step {best['step']} "
        f"({best['tokens'] / max(1, data['tokens']['train']):.1f} epochs). Where that is "
        "before the last step, the model overfits this small corpus after it.",
        "",
        "## Results (held-out documents)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| validation loss (nats/token) | {best['val_loss']:.3f} |",
        f"| validation perplexity | {best['val_ppl']:.1f} |",
        f"| MTP loss, token t+2 | {best['val_mtp_loss']:.3f} |",
        f"| MTP top-1 accuracy, token t+2 | {best['val_mtp_top1']:.1%} |",
        "",
        "Greedy samples (transformers; the prompt, then the continuation):",
        "",
    ]
    for s in info.get("samples", []):
        lines += ["```", s["prompt"] + " ‖" + s["greedy"], "```", ""]
    lines += _serving_lines(info.get("pagedserve"))
    lines += [RETRAINING, ""]
    return "\n".join(lines)


def _serving_lines(m: dict[str, Any] | None) -> list[str]:
    """pagedserve's own figures on the checkpoint (``measure.py``), when measured."""
    if not m:
        return []
    lines = [
        "## In pagedserve (CPU, float32)",
        "",
        f"Measured by `scripts/default_model/measure.py` on {m['device']}.",
        "",
        "| measure | value |",
        "|---|---|",
    ]
    for kv, r in m["kv_agreement"].items():
        lines.append(f"| {kv} K/V against f16: tokens agreeing, teacher-forced / free-running "
                     f"| {r['teacher_forced']:.1%} / {r['free_running']:.1%} |")
    plain = m["speculative"]["plain_tok_s"]
    lines.append(f"| greedy decode, batch 1, no speculation | {plain:.0f} tok/s |")
    for k, r in m["speculative"]["mtp"].items():
        lines.append(f"| MTP speculation, k = {k}: tokens per verify step, speed-up "
                     f"| {r['mean_acceptance_length']:.2f}, {r['tok_s'] / plain:.2f}x |")
    lines += ["", f"K/V agreement: {m['kv_tokens']} greedy tokens over "
              f"{m['kv_prompts']} prompts; speculation: {m['spec_tokens']} tokens per "
              "prompt, greedy, identical to the plain run.", ""]
    return lines
