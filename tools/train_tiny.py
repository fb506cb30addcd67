"""Trains the built-in `tiny` model: a small Qwen3.5-MoE (Gated DeltaNet and gated
attention layers in the real 3:1 pattern, a routed MoE with a shared expert in every
layer) on the standard library's docstrings (tools/stdlib_text.py), on the CPU.

    python3 tools/stdlib_text.py /tmp/stdtext
    nohup python3 tools/train_tiny.py /tmp/stdtext /tmp/tiny-hf > /tmp/train.log 2>&1 &
    fermoe convert /tmp/tiny-hf shared/data/tiny-q8_0.gguf --type q8_0

What it does, exactly: a byte-level BPE vocabulary of VOCAB tokens (the 256 byte
pieces, merges learned by `tokenizers` from train.txt after Qwen3.5's pre-tokenizer
split, then Qwen's special tokens) is trained on train.txt; the model (CONFIG) is
trained from seed 0 on random SEQ-token windows of the tokenised train.txt, AdamW,
linear warm-up then cosine decay, the router's load-balancing loss on, until
--minutes have passed or --steps are done. The loss on the calibration text is printed
every EVAL_EVERY steps, and the best checkpoint by it is kept (the held-out text
is never looked at). The output is a Hugging Face checkpoint with tokenizer.json and a
ChatML chat template, ready for `fermoe convert`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.synth_vocab import CHAT_TEMPLATE, QWEN_SPECIAL_TOKENS  # noqa: E402
from shared.tokenizer import QWEN35_SPLIT  # noqa: E402

VOCAB = 4096
SEQ = 512
BATCH = 8
LR, MIN_LR_FRACTION, WARMUP, WEIGHT_DECAY = 3e-3, 0.1, 100, 0.1
EVAL_EVERY = 100
GDN_CHUNK = 32
# Every inner dimension a multiple of 32, so Q8_0 and Q4_0 files quantise every matrix.
CONFIG = dict(
    vocab_size=VOCAB, hidden_size=128, num_hidden_layers=8, full_attention_interval=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=64,
    shared_expert_intermediate_size=128, max_position_embeddings=4096, rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
    output_router_logits=True, router_aux_loss_coef=0.01, tie_word_embeddings=False,
)


def train_tokenizer(text: str) -> Tokenizer:
    """Byte-level BPE split as fermoe's and llama.cpp's qwen35 pre-tokenizer splits."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN35_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    n_bpe = VOCAB - len(QWEN_SPECIAL_TOKENS)
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer=trainer)
    tok.add_special_tokens(list(QWEN_SPECIAL_TOKENS))   # after the BPE vocabulary, as Qwen's
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHAT_TEMPLATE,
        "add_bos_token": False}, indent=1))


def _faster_gdn_chunks() -> None:
    """The chunked delta rule is exact for any chunk length; on the CPU a batched
    triangular solve of 64x64 blocks is ~40x slower than of 32x32 ones (torch 2.13)."""
    import functools
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    m.torch_chunk_gated_delta_rule = functools.partial(m.torch_chunk_gated_delta_rule, chunk_size=GDN_CHUNK)


def build_model(experts: str):
    config = transformers.Qwen3_5MoeTextConfig(**CONFIG)
    config.eos_token_id = None
    torch.manual_seed(0)
    return transformers.Qwen3_5MoeForCausalLM._from_config(config, attn_implementation="sdpa",
                                                           experts_implementation=experts)


def lr_at(step: int, total: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, total - WARMUP))
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(ids: np.ndarray, rng: np.random.Generator):
    while True:
        starts = rng.integers(0, len(ids) - SEQ - 1, BATCH)
        yield torch.from_numpy(np.stack([ids[s:s + SEQ + 1] for s in starts]).astype(np.int64))


@torch.no_grad()
def eval_loss(model, ids: np.ndarray) -> float:
    """Mean next-token loss over consecutive SEQ windows of `ids`."""
    model.eval()
    n = (len(ids) - 1) // SEQ
    x = torch.from_numpy(ids[:n * SEQ + 1].astype(np.int64))
    losses = []
    for i in range(0, n, BATCH):
        rows = torch.stack([x[j * SEQ:(j + 1) * SEQ + 1] for j in range(i, min(n, i + BATCH))])
        logits = model(rows[:, :-1], output_router_logits=False).logits
        losses.append(torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="sum").item())
    model.train()
    return sum(losses) / (n * SEQ)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text_dir", type=Path, help="the output of tools/stdlib_text.py")
    p.add_argument("out", type=Path, help="checkpoint directory to write")
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this much training time")
    p.add_argument("--steps", type=int, default=600, help="the cosine schedule's length")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--experts", default="grouped_mm", help="transformers' experts_implementation")
    p.add_argument("--eval-tokens", type=int, default=8192, help="calibration-text tokens scored every EVAL_EVERY")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (4x slower steps, no minutes "
                                                            "of compiling first)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    _faster_gdn_chunks()
    args.out.mkdir(parents=True, exist_ok=True)

    train_text = (args.text_dir / "train.txt").read_text(encoding="utf-8")
    tok = train_tokenizer(train_text)
    save_tokenizer(tok, args.out)
    ids = np.array(tok.encode(train_text).ids, np.int32)
    # Early stopping watches the calibration text, so the held-out text stays unseen by any choice.
    evaluation = np.array(tok.encode((args.text_dir / "calib.txt").read_text(encoding="utf-8")).ids, np.int32)
    evaluation = evaluation[:args.eval_tokens + 1]
    model = build_model(args.experts).train()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train {len(ids)} tokens ({len(train_text) / len(ids):.2f} chars/token), eval {len(evaluation)}; "
          f"{n_params / 1e6:.2f}M parameters", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0}],
                            lr=LR, betas=(0.9, 0.95))
    data = batches(ids, np.random.default_rng(0))
    step_fn = model if args.no_compile else torch.compile(model)   # the same parameters; eval runs uncompiled
    t0, step, ema, best = time.time(), 0, None, float("inf")
    while step < args.steps and time.time() - t0 < args.minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps)
        x = next(data)
        out = step_fn(x[:, :-1], labels=x[:, :-1].clone())
        # labels shift inside the model; the loss includes the router's load-balancing term
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        lm = out.loss.item() - CONFIG["router_aux_loss_coef"] * out.aux_loss.item()
        ema = lm if ema is None else 0.98 * ema + 0.02 * lm
        if step % 10 == 0:
            el = time.time() - t0
            print(f"step {step} loss {ema:.3f} aux {out.aux_loss.item():.3f} lr {lr_at(step, args.steps):.2e} "
                  f"{step * BATCH * SEQ / el:.0f} tok/s {el / 60:.1f} min", flush=True)
        if step % EVAL_EVERY == 0 or step == args.steps:
            loss = eval_loss(model, evaluation)
            print(f"step {step} eval loss {loss:.3f}", flush=True)
            if loss < best:            # early stopping: the checkpoint is the best one
                best = loss
                save_model(model, args.out)
    print(f"done: {step} steps, {step * BATCH * SEQ} tokens, {(time.time() - t0) / 60:.1f} min; "
          f"train loss {ema:.3f}, best eval loss {best:.3f}", flush=True)


def save_model(model, out: Path) -> None:
    model.config.output_router_logits = False
    model.save_pretrained(out)
    model.config.output_router_logits = True


if __name__ == "__main__":
    main()
