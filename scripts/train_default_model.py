"""Train pagedserve's default model: a small Qwen3.5 with an MTP head, on a public corpus.

    python scripts/default_model/corpus.py --out .corpus/corpus.jsonl.xz   # once, on a CPU
    python scripts/train_default_model.py --corpus .corpus/corpus.jsonl.xz --out OUT \
        --minutes 5                                                         # on a GPU
    python scripts/train_default_model.py --smoke --corpus C --out OUT      # CPU, < 60 s

The model is transformers' ``Qwen3_5ForCausalLM`` (fla's kernels on CUDA where they can
train, ``gdn_ops``), plus ``default_model/mtp.py``'s MTP module trained jointly on token
t+2 (loss weight ``--mtp-weight``). Training follows a cosine schedule over its budget --
``--minutes`` of wall clock or ``--epochs`` passes over the data, whichever runs out first
-- evaluates on the corpus's held-out documents every ``--eval-every`` steps, and keeps
the weights of the best validation loss. OUT receives a checkpoint transformers and
pagedserve load as they are: ``config.json``, ``generation_config.json``, the tokenizer
files (with the chat template), safetensors shards under 15 MB with
``model.safetensors.index.json`` (the MTP tensors in a shard of their own,
``mtp.safetensors``), ``MODEL_CARD.md`` and
``train_log.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import inspect
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import GenerationConfig, Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from default_model import corpus as corpus_mod  # noqa: E402
from default_model import model_card  # noqa: E402
from default_model import tokenizer as tok_mod  # noqa: E402
from default_model.mtp import MTP  # noqa: E402

LIN, FULL = "linear_attention", "full_attention"
MAX_SHARD_BYTES = 14 * 1000 * 1000  # tensor bytes: the files stay under 15 MB


@dataclasses.dataclass(frozen=True)
class Shape:
    """The model's dimensions. head_dim and the GDN head dims are ones pagedserve's GPU
    kernels serve (64/128/256; GDN 128 as in Qwen3.5)."""

    vocab_size: int = 8192
    hidden_size: int = 384
    intermediate_size: int = 896
    num_hidden_layers: int = 8  # 3 GDN then 1 gated attention, twice
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 128
    linear_num_key_heads: int = 2
    linear_num_value_heads: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10_000_000.0
    max_position_embeddings: int = 4096


SMOKE_SHAPE = Shape(vocab_size=640, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                    linear_num_key_heads=1, linear_num_value_heads=2,
                    linear_key_head_dim=32, linear_value_head_dim=32)


def hf_config(shape: Shape, special: dict[str, int]) -> Qwen3_5TextConfig:
    layer_types = ([LIN, LIN, LIN, FULL] * shape.num_hidden_layers)[: shape.num_hidden_layers]
    return Qwen3_5TextConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
        layer_types=layer_types, num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads, head_dim=shape.head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim, linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": shape.rope_theta,
                         "partial_rotary_factor": shape.partial_rotary_factor},
        rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, tie_word_embeddings=True,
        max_position_embeddings=shape.max_position_embeddings,
        bos_token_id=None, eos_token_id=special["eos"], pad_token_id=special["pad"],
        mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
    )


def gdn_ops(device: torch.device) -> str:
    """Which Gated DeltaNet ops train the model: ``"fla"`` where fla is installed and its
    chunked op's backward runs on ``device``, else ``"torch"``, transformers' reference ops.

    fla refuses the gated backward on Hopper with Triton older than 3.7.1, whose compiler
    gets it wrong there (fla issue 640); a one-chunk probe finds out. For ``"torch"``,
    transformers' Qwen3.5 module is pointed at its own torch implementation, which it
    otherwise replaces by fla's when fla imports."""
    if device.type != "cuda" or importlib.util.find_spec("fla") is None:
        return "torch"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.bfloat16).requires_grad_()

    try:
        q, k, v = leaf(1, 64, 1, 128), leaf(1, 64, 1, 128), leaf(1, 64, 1, 128)
        g = F.logsigmoid(leaf(1, 64, 1))
        beta = torch.sigmoid(leaf(1, 64, 1))
        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
        out.float().sum().backward()
        return "fla"
    except RuntimeError as exc:
        print(f"fla's Gated DeltaNet cannot train here ({str(exc).splitlines()[0]}); "
              "training with transformers' torch ops", flush=True)
    from transformers.models.qwen3_5 import modeling_qwen3_5

    modeling_qwen3_5.torch_chunk_gated_delta_rule = inspect.unwrap(
        modeling_qwen3_5.torch_chunk_gated_delta_rule)
    return "torch"


# ---- data ----------------------------------------------------------------------------
def load_tokens(corpus: Path, vocab_size: int, max_docs: int | None
                ) -> tuple[Any, torch.Tensor, torch.Tensor, dict[str, Any]]:
    """Train the tokenizer on the train split; both splits as one id stream each, every
    document followed by <|endoftext|>."""
    docs = list(corpus_mod.read_corpus(corpus))
    if max_docs is not None:
        docs = docs[:max_docs]
    train_texts = [d["text"] for d in docs if d["split"] == "train"]
    val_texts = [d["text"] for d in docs if d["split"] == "val"]
    if not train_texts or not val_texts:
        raise SystemExit(f"{corpus}: needs documents in both splits")
    tok = tok_mod.train_tokenizer(train_texts, vocab_size)
    if tok.get_vocab_size() > vocab_size:
        raise SystemExit(f"tokenizer has {tok.get_vocab_size()} tokens, over {vocab_size}")
    eot = tok_mod.token_id(tok, tok_mod.ENDOFTEXT)

    def stream(texts: list[str]) -> torch.Tensor:
        ids: list[int] = []
        for enc in tok.encode_batch(texts):
            ids.extend(enc.ids)
            ids.append(eot)
        return torch.tensor(ids, dtype=torch.int32)

    train, val = stream(train_texts), stream(val_texts)
    sources: dict[str, int] = {}
    for d in docs:
        sources[d["source"]] = sources.get(d["source"], 0) + 1
    info = {"documents": {"train": len(train_texts), "val": len(val_texts)},
            "documents_by_source": sources,
            "characters": {"train": sum(map(len, train_texts)),
                           "val": sum(map(len, val_texts))},
            "tokens": {"train": int(train.numel()), "val": int(val.numel())}}
    return tok, train, val, info


def val_windows(val: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Non-overlapping windows of seq_len + 1 tokens from the start of the val stream."""
    n = min(max_windows, (val.numel() - 1) // (seq_len + 1))
    if n < 1:
        raise SystemExit(f"validation split has {val.numel()} tokens, fewer than one window")
    return val[: n * (seq_len + 1)].view(n, seq_len + 1).long()


# ---- the objective -------------------------------------------------------------------
def losses(lm: Qwen3_5ForCausalLM, mtp: MTP, window: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Main and MTP cross-entropy on ``window`` ``[B, L+1]``, and MTP top-1 hits.

    The main model reads tokens 0..L-1 and predicts 1..L; the MTP module reads its hidden
    states at 0..L-2 with tokens 1..L-1 and predicts 2..L."""
    inp = window[:, :-1]
    hidden = lm.model(input_ids=inp).last_hidden_state  # [B, L, H]
    logits = lm.lm_head(hidden)
    main = F.cross_entropy(logits.flatten(0, 1).float(), window[:, 1:].flatten())
    mtp_logits = mtp(lm, hidden[:, :-1], inp[:, 1:])  # [B, L-1, V]
    target2 = window[:, 2:]
    second = F.cross_entropy(mtp_logits.flatten(0, 1).float(), target2.flatten())
    hits = (mtp_logits.argmax(-1) == target2).float().mean()
    return main, second, hits


@torch.no_grad()
def evaluate(lm: Qwen3_5ForCausalLM, mtp: MTP, windows: torch.Tensor, batch: int,
             device: torch.device, amp: bool) -> dict[str, float]:
    lm.eval(), mtp.eval()
    sums = torch.zeros(3, dtype=torch.float64)
    for i in range(0, windows.shape[0], batch):
        w = windows[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            main, second, hits = losses(lm, mtp, w)
        sums += torch.tensor([main.item(), second.item(), hits.item()]) * w.shape[0]
    lm.train(), mtp.train()
    main_loss, mtp_loss, acc = (sums / windows.shape[0]).tolist()
    return {"val_loss": main_loss, "val_ppl": math.exp(main_loss), "val_mtp_loss": mtp_loss,
            "val_mtp_top1": acc}


def lr_at(fraction: float, peak: float, warmup: float) -> float:
    """Linear warm-up over ``warmup`` of the budget, then cosine to a tenth of the peak."""
    if fraction < warmup:
        return peak * fraction / warmup
    progress = min(1.0, (fraction - warmup) / (1 - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp = device.type == "cuda"
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
    shape = SMOKE_SHAPE if args.smoke else Shape()
    t0 = time.time()
    tok, train_ids, val_ids, data_info = load_tokens(
        args.corpus, shape.vocab_size, args.max_docs)
    print(f"data: {json.dumps(data_info)} ({time.time() - t0:.0f} s)", flush=True)
    special = {"eos": tok_mod.token_id(tok, tok_mod.IM_END),
               "pad": tok_mod.token_id(tok, tok_mod.ENDOFTEXT)}
    config = hf_config(shape, special)
    lm = Qwen3_5ForCausalLM(config).to(device)
    ops = gdn_ops(device)
    if device.type == "cuda" and ops == "torch":
        print("warning: Gated DeltaNet trains on transformers' torch ops, much slower than "
              "fla's", flush=True)
    mtp = MTP(config).to(device)
    params = list(lm.parameters()) + list(mtp.parameters())
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=amp)
    n_params = {"model": sum(p.numel() for p in lm.parameters()),
                "mtp": sum(p.numel() for p in mtp.parameters())}
    print(f"parameters: {n_params}", flush=True)
    windows = val_windows(val_ids, args.seq_len, args.val_windows)
    gen = torch.Generator().manual_seed(args.seed)
    budget = args.minutes * 60.0
    start = time.time()
    step, tokens_seen = 0, 0
    best: dict[str, Any] = {"val_loss": float("inf")}
    best_state: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None = None
    history: list[dict[str, float]] = []
    # Progress through the schedule: time or tokens, whichever is further along. The
    # corpus is small, so --epochs usually ends the run before the time budget does.
    token_budget = args.epochs * train_ids.numel()
    if args.max_steps is not None:
        token_budget = min(token_budget, args.max_steps * args.batch_size * args.seq_len)
    while True:
        fraction = max((time.time() - start) / budget, tokens_seen / token_budget)
        done = fraction >= 1.0 or (args.max_steps is not None and step >= args.max_steps)
        if step % args.eval_every == 0 or done:
            metrics = evaluate(lm, mtp, windows, args.batch_size, device, amp)
            metrics.update(step=step, tokens=tokens_seen, seconds=round(time.time() - start, 1))
            history.append(metrics)
            print(json.dumps(metrics), flush=True)
            if metrics["val_loss"] < best["val_loss"]:
                best = metrics
                best_state = ({k: v.detach().cpu().clone() for k, v in lm.state_dict().items()},
                              {k: v.detach().cpu().clone() for k, v in mtp.state_dict().items()})
        if done:
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(fraction, args.lr, args.warmup)
        starts = torch.randint(0, train_ids.numel() - args.seq_len - 1,
                               (args.batch_size,), generator=gen)
        batch = torch.stack([train_ids[s:s + args.seq_len + 1] for s in starts.tolist()])
        batch = batch.long().to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            main, second, _ = losses(lm, mtp, batch)
            loss = main + args.mtp_weight * second
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        tokens_seen += batch.numel() - batch.shape[0]
    assert best_state is not None
    lm.load_state_dict(best_state[0])
    mtp.load_state_dict(best_state[1])
    manifest = args.corpus.parent / "manifest.json"
    if manifest.is_file():
        data_info["manifest"] = json.loads(manifest.read_text())
    info = {"shape": dataclasses.asdict(shape), "parameters": n_params, "data": data_info,
            "steps": step, "tokens_seen": tokens_seen, "seconds": round(time.time() - start, 1),
            "best": best, "history": history, "args": {k: str(v) for k, v in vars(args).items()},
            "device": torch.cuda.get_device_name(device) if amp else str(device),
            "gdn_ops": ops}
    save(lm, mtp, tok, args.out, info)
    return info


# ---- the checkpoint ------------------------------------------------------------------
def save(lm: Qwen3_5ForCausalLM, mtp: MTP, tok: Any, out: Path, info: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok_mod.write_tokenizer(tok, out, lm.config.max_position_embeddings)
    info["samples"] = samples(lm, out)  # on the training device: fla has no CPU path
    lm = lm.to("cpu", torch.bfloat16).eval()
    mtp = mtp.to("cpu", torch.bfloat16).eval()
    lm.config.dtype = torch.bfloat16
    lm.save_pretrained(out, max_shard_size=MAX_SHARD_BYTES)
    mtp_tensors = {f"mtp.{k}": v.contiguous() for k, v in mtp.state_dict().items()}
    save_file(mtp_tensors, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.is_file():
        with open(index_path) as f:
            index = json.load(f)
    else:  # one shard: name it in an index, so that the MTP shard is listed beside it
        (out / "model.safetensors").rename(out / "model-00001-of-00001.safetensors")
        index = {"metadata": {}, "weight_map": {
            k: "model-00001-of-00001.safetensors" for k in lm.state_dict()
            if k != "lm_head.weight"}}
    index["weight_map"].update({k: "mtp.safetensors" for k in mtp_tensors})
    index["metadata"]["total_size"] = sum(
        p.stat().st_size for p in out.glob("*.safetensors"))
    with open(index_path, "w") as f:
        json.dump(index, f, indent=2, sort_keys=True)
    eos, pad = lm.config.eos_token_id, lm.config.pad_token_id
    GenerationConfig(
        eos_token_id=[eos, pad], pad_token_id=pad, do_sample=True, temperature=0.7,
        top_p=0.8, top_k=20,
    ).save_pretrained(out)
    info["files"] = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    with open(out / "train_log.json", "w") as f:
        json.dump(info, f, indent=2)
    (out / "MODEL_CARD.md").write_text(model_card.render(info))


PROMPTS = ("Once upon a time", "It is a truth universally acknowledged",
           "The Python interpreter")


@torch.no_grad()
def samples(lm: Qwen3_5ForCausalLM, out: Path) -> list[dict[str, str]]:
    """Greedy continuations of ``PROMPTS`` by transformers (the best weights, float32)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(out))
    lm.eval()
    found = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids.to(lm.device)
        seq = lm.generate(ids, max_new_tokens=48, do_sample=False)
        found.append({"prompt": prompt,
                      "greedy": tokenizer.decode(seq[0, ids.shape[1]:], skip_special_tokens=True)})
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path(".corpus/corpus.jsonl.xz"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="training wall-clock budget")
    ap.add_argument("--epochs", type=float, default=10.0,
                    help="token budget, in passes over the train split")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shape, a few steps, on the CPU: checks the whole pipeline")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=float, default=0.03, help="fraction of the budget")
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--val-windows", type=int, default=256)
    ap.add_argument("--max-steps", type=int, help="stop after this many steps (the schedule "
                    "fits itself to them)")
    ap.add_argument("--max-docs", type=int, help="use only the corpus's first documents")
    args = ap.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
        args.seq_len, args.batch_size, args.val_windows = 64, 4, 4
        args.eval_every = 10
        args.max_steps = args.max_steps or 20
        args.minutes = min(args.minutes, 5.0)  # a bound only: the 20 steps end it
    info = train(args)
    print(json.dumps({k: info[k] for k in ("steps", "tokens_seen", "seconds", "best")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
