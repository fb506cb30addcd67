"""Trains the built-in `tiny` model: a small Qwen3.5-MoE (Gated DeltaNet and gated
attention layers in the real 3:1 pattern, a routed MoE with a shared expert in every
layer) on the standard library's docstrings (tools/stdlib_text.py) and on chat and agent
episodes made from them (tools/stdlib_chat.py), on the CPU or a GPU.

    python3 tools/stdlib_text.py /tmp/stdtext
    python3 tools/stdlib_chat.py /tmp/stdtext
    python3 tools/train_tiny.py /tmp/stdtext /tmp/tiny-hf --device cuda --batch 32 --seq 1024 \
        --chat-share 0.906 --steps 1200 --stop-after 760 --no-compile
    fermoe convert /tmp/tiny-hf shared/data/tiny-q8_0.gguf --type q8_0

What it does, exactly: a byte-level BPE vocabulary of VOCAB tokens (the 256 byte
pieces, merges learned by `tokenizers` from train.txt and one round of the training
episodes after Qwen3.5's pre-tokenizer split, then Qwen's special tokens) is trained; the
model (CONFIG) is trained from seed 0, AdamW, linear warm-up then cosine decay, the
router's load-balancing loss on, until --minutes have passed or --steps are done. Each
batch is --batch rows of --seq tokens: a --chat-share of them episodes (--rounds renderings
of every training name, rows starting where an episode starts, the loss on the assistant's
turns only), the rest random windows of train.txt. The losses on the calibration text and
on the calibration names' episodes are printed every EVAL_EVERY steps, and the best
checkpoint by their sum is kept (the held-out text and names are never looked at). The
output is a Hugging Face checkpoint with tokenizer.json and the built-in chat template
(shared/chat_template.py), ready for `fermoe convert`.
On a GPU, runs repeat as far as torch's deterministic algorithms reach
(use_deterministic_algorithms, warn_only).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from shared.chat_template import QWEN_STYLE_TEMPLATE  # noqa: E402
from modeltools.synth_vocab import QWEN_SPECIAL_TOKENS  # noqa: E402
from shared.tokenizer import QWEN35_SPLIT  # noqa: E402
from tools.stdlib_chat import episodes  # noqa: E402

VOCAB = 4096
LR, MIN_LR_FRACTION, WARMUP, WEIGHT_DECAY = 3e-3, 0.1, 100, 0.1
EVAL_EVERY = 100
GDN_CHUNK = 32
ASSISTANT, END = "<|im_start|>assistant\n", "<|im_end|>"
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
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN_STYLE_TEMPLATE,
        "add_bos_token": False}, indent=1))


def _faster_gdn_chunks() -> None:
    """The chunked delta rule is exact for any chunk length; on the CPU a batched
    triangular solve of 64x64 blocks is ~40x slower than of 32x32 ones (torch 2.13)."""
    import functools
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m
    m.torch_chunk_gated_delta_rule = functools.partial(m.torch_chunk_gated_delta_rule, chunk_size=GDN_CHUNK)


def build_model(experts: str, device: str):
    config = transformers.Qwen3_5MoeTextConfig(**CONFIG)
    config.eos_token_id = None
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM._from_config(config, attn_implementation="sdpa",
                                                            experts_implementation=experts)
    return model.to(device)


def pick_experts(choices: list[str], device: str, seq: int):
    """The first experts implementation that runs a training step here (grouped_mm's kernels
    vary by device and torch version; eager runs everywhere), and the model built with it."""
    for experts in choices:
        model = build_model(experts, device).train()
        x = torch.zeros(2, seq, dtype=torch.long, device=device)
        try:
            model(x, labels=x).loss.backward()
        except (RuntimeError, NotImplementedError) as e:
            print(f"experts implementation {experts!r} fails here ({str(e).splitlines()[0][:200]}); next", flush=True)
            continue
        model.zero_grad(set_to_none=True)
        return experts, build_model(experts, device).train()      # fresh: the probe left no trace
    raise SystemExit(f"no experts implementation of {choices} runs on {device}")


def lr_at(step: int, total: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = min(1.0, (step - WARMUP) / max(1, total - WARMUP))
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def encode_episodes(tok: Tokenizer, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, trained, starts): the episodes' tokens one after the other; whether each token
    is the assistant's (from after its turn's `<|im_start|>assistant\\n` through its
    `<|im_end|>`), which the loss is taken on; where each episode starts."""
    ids, trained, starts, at = [], [], [], 0
    for text, enc in zip(texts, tok.encode_batch(texts)):
        spans, i = [], text.find(ASSISTANT)
        while i >= 0:
            j = text.find(END, i)
            j = len(text) if j < 0 else j + len(END)
            spans.append((i + len(ASSISTANT), j))
            i = text.find(ASSISTANT, j)
        offsets = np.array(enc.offsets, np.int64).reshape(-1, 2)
        mask = np.zeros(len(enc.ids), bool)
        for s, e in spans:
            mask |= (offsets[:, 0] >= s) & (offsets[:, 1] <= e)
        ids.append(np.array(enc.ids, np.int32))
        trained.append(mask)
        starts.append(at)
        at += len(enc.ids)
    return np.concatenate(ids), np.concatenate(trained), np.array(starts, np.int64)


def batches(text_ids: np.ndarray, chat: tuple, n_chat: int, batch: int, seq: int, rng: np.random.Generator):
    """(inputs, labels) batches: `batch - n_chat` random windows of the text, `n_chat` rows of
    episodes starting where one starts (labels -100 where the loss is not taken)."""
    chat_ids, trained, starts = chat
    starts = starts[starts + seq + 1 <= len(chat_ids)]
    while True:
        rows, labels = [], []
        for s in rng.integers(0, len(text_ids) - seq - 1, batch - n_chat):
            rows.append(text_ids[s:s + seq + 1])
            labels.append(rows[-1])
        for s in starts[rng.integers(0, len(starts), n_chat)]:
            rows.append(chat_ids[s:s + seq + 1])
            labels.append(np.where(trained[s:s + seq + 1], rows[-1], -100))
        x = torch.from_numpy(np.stack(rows).astype(np.int64))
        yield x, torch.from_numpy(np.stack(labels).astype(np.int64))


@torch.no_grad()
def eval_loss(model, ids: np.ndarray, batch: int, seq: int, device: str, trained: np.ndarray | None = None) -> float:
    """Mean next-token loss over consecutive `seq` windows of `ids` (only on the tokens
    `trained` marks, when given)."""
    model.eval()
    n = (len(ids) - 1) // seq
    x = torch.from_numpy(ids[:n * seq + 1].astype(np.int64))
    y = x if trained is None else torch.from_numpy(
        np.where(trained[:n * seq + 1], ids[:n * seq + 1], -100).astype(np.int64))
    total, count = 0.0, 0
    for i in range(0, n, batch):
        rows = torch.stack([x[j * seq:(j + 1) * seq + 1] for j in range(i, min(n, i + batch))]).to(device)
        want = torch.stack([y[j * seq:(j + 1) * seq + 1] for j in range(i, min(n, i + batch))]).to(device)
        logits = model(rows[:, :-1], output_router_logits=False).logits
        total += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                   want[:, 1:].reshape(-1), reduction="sum").item()
        count += int((want[:, 1:] != -100).sum())
    model.train()
    return total / max(1, count)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("text_dir", type=Path, help="the output of tools/stdlib_text.py and tools/stdlib_chat.py")
    p.add_argument("out", type=Path, help="checkpoint directory to write")
    p.add_argument("--minutes", type=float, default=60.0, help="stop after this much training time")
    p.add_argument("--steps", type=int, default=600, help="the cosine schedule's length")
    p.add_argument("--stop-after", type=int, default=None, metavar="N",
                   help="end after N steps of that schedule (what a run cut short by --minutes did, repeated)")
    p.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    p.add_argument("--batch", type=int, default=8, help="rows a step (default 8)")
    p.add_argument("--seq", type=int, default=512, help="tokens a row (default 512)")
    p.add_argument("--chat-share", type=float, default=0.5, help="share of a batch's rows that are episodes")
    p.add_argument("--rounds", type=int, default=4, help="episodes rendered for each training name")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--experts", default="grouped_mm", help="transformers' experts_implementation (eager if it "
                                                           "fails on the device)")
    p.add_argument("--eval-tokens", type=int, default=8192, help="calibration-text tokens scored every EVAL_EVERY")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile (4x slower steps on the CPU, "
                                                            "no minutes of compiling first)")
    args = p.parse_args(argv)
    n_chat = round(args.batch * args.chat_share)
    torch.set_num_threads(args.threads)
    if args.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")    # before cuBLAS starts: deterministic
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        _faster_gdn_chunks()
    args.out.mkdir(parents=True, exist_ok=True)

    t_data = time.time()
    train_text = (args.text_dir / "train.txt").read_text(encoding="utf-8")
    items = [json.loads(line) for line in (args.text_dir / "entries.jsonl").open(encoding="utf-8")]
    train_items = [e for e in items if e["split"] == "train"]
    chat_texts = episodes(train_items, seed=0, rounds=args.rounds)
    calib_chat = episodes([e for e in items if e["split"] == "calib"], seed=1)
    # the vocabulary sees one rendering of each name: the chat markup gets its merges
    tok = train_tokenizer(train_text + "\n\n" + "".join(chat_texts[:len(train_items)]))
    save_tokenizer(tok, args.out)
    ids = np.array(tok.encode(train_text).ids, np.int32)
    chat = encode_episodes(tok, chat_texts)
    calib_chat_ids, calib_chat_trained, _ = encode_episodes(tok, calib_chat)
    # Early stopping watches the calibration text, so the held-out text stays unseen by any choice.
    evaluation = np.array(tok.encode((args.text_dir / "calib.txt").read_text(encoding="utf-8")).ids, np.int32)
    evaluation = evaluation[:args.eval_tokens + 1]
    experts, model = pick_experts(list(dict.fromkeys([args.experts, "eager"])), args.device, args.seq)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"train {len(ids)} tokens ({len(train_text) / len(ids):.2f} chars/token), {len(chat_texts)} episodes "
          f"({len(chat[0])} tokens, {int(chat[1].sum())} trained on), eval {len(evaluation)} + "
          f"{int(calib_chat_trained.sum())}; {n_params / 1e6:.2f}M parameters; experts {experts}; "
          f"data {time.time() - t_data:.0f} s", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    other = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": other, "weight_decay": 0}],
                            lr=LR, betas=(0.9, 0.95))
    data = batches(ids, chat, n_chat, args.batch, args.seq, np.random.default_rng(0))
    step_fn = model if args.no_compile else torch.compile(model)   # the same parameters; eval runs uncompiled
    total = args.steps

    def evaluate(step: int, best: float) -> float:
        text_loss = eval_loss(model, evaluation, args.batch, args.seq, args.device)
        chat_loss = eval_loss(model, calib_chat_ids, args.batch, args.seq, args.device, calib_chat_trained)
        print(f"step {step} eval loss {text_loss:.3f} chat {chat_loss:.3f}", flush=True)
        if text_loss + chat_loss >= best:
            return best
        save_model(model, args.out)                 # early stopping: the checkpoint is the best one
        print(f"saved step {step}", flush=True)
        return text_loss + chat_loss

    t0, step, ema, best = time.time(), 0, None, float("inf")
    last = total if args.stop_after is None else min(total, args.stop_after)
    while step < last and time.time() - t0 < args.minutes * 60:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total)
        x, y = (t.to(args.device) for t in next(data))
        out = step_fn(x[:, :-1], labels=y[:, :-1])
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
            print(f"step {step} loss {ema:.3f} aux {out.aux_loss.item():.3f} lr {lr_at(step, total):.2e} "
                  f"{step * args.batch * args.seq / el:.0f} tok/s {el / 60:.1f} min", flush=True)
        if step % EVAL_EVERY == 0 or step == total:
            best = evaluate(step, best)
    if step % EVAL_EVERY and step != total:        # stopped between evaluations
        best = evaluate(step, best)
    print(f"done: {step} steps, {step * args.batch * args.seq} tokens, {(time.time() - t0) / 60:.1f} min; "
          f"train loss {ema or float('nan'):.3f}, best eval loss (text + chat) {best:.3f}", flush=True)


def save_model(model, out: Path) -> None:
    model.config.output_router_logits = False
    model.save_pretrained(out)
    model.config.output_router_logits = True


if __name__ == "__main__":
    main()
