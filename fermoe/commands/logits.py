"""`fermoe logits`: the float32 [T, vocab] logits of every prompt position, as a .npy file."""
from __future__ import annotations

import sys

import numpy as np

from shared.errors import FermoeError

from .common import add_image, add_model, chat_ids, open_model

NAME = "logits"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="write the float32 [T, vocab] logits of every prompt position",
                       description="Write the float32 [T, vocab] logits of every prompt position as a .npy file.")
    add_model(p)
    p.add_argument("--tokens", help="comma-separated token ids")
    p.add_argument("--prompt", help="text to tokenize (instead of --tokens), taken as given")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    add_image(p)
    p.add_argument("--out", required=True, help="output .npy file")


def run(args) -> None:
    model, engine = open_model(args)
    if (args.tokens is None) == (args.prompt is None):
        raise FermoeError("give exactly one of --tokens and --prompt")
    if (args.chat or args.image) and args.prompt is None:
        raise FermoeError("--chat and --image take --prompt (the user message's text), not --tokens")
    if args.image and not args.chat:
        raise FermoeError("--image needs --chat: the chat template places the image")
    media = None
    if args.chat:
        ids, media = chat_ids(args, model, args.prompt)
    elif args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise FermoeError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
    else:
        ids = model.tokenizer.encode(args.prompt)
    bad = [t for t in ids if not 0 <= t < model.config.n_vocab]
    if not ids or bad:
        raise FermoeError(f"token ids must be in [0, {model.config.n_vocab}); got {bad or 'none'}")
    logits = engine.forward(ids, engine.new_state(), **({"media": media} if media is not None else {}))
    engine.close()
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: {logits.shape[0]} positions x {logits.shape[1]} logits", file=sys.stderr)
