"""`fermoe generate`: a continuation of a prompt, in this process (no daemon)."""
from __future__ import annotations

import sys

from shared.errors import FermoeError

from .common import (add_image, add_model, add_n_predict, add_prompt, add_sampling, chat_ids, escaped, max_tokens_of,
                     notices, open_engine, open_model, sampling_of)

NAME = "generate"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="print a continuation of a prompt, in this process (no daemon)",
                       description="Print a continuation of a prompt, in this process (no daemon).")
    add_model(p)
    add_prompt(p, required=True)
    add_n_predict(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_image(p)
    add_sampling(p)


def run(args) -> None:
    from shared.generate import generate
    from shared.tokenizer import StreamDecoder

    max_tokens = max_tokens_of(args)
    escaped(args)
    model, engine = open_model(args)
    prefill = None
    if args.engine == "gpu":        # the prompt on the GPU, the tokens on the CPU from the state it hands over
        prefill, engine = engine, open_engine(args, model, "cpu")
    tok = model.tokenizer
    if args.image and not args.chat:
        raise FermoeError("--image needs --chat: the chat template places the image")
    media = None
    if args.chat:
        ids, media = chat_ids(args, model, args.prompt)
    else:
        ids = tok.encode(args.prompt)
    params = sampling_of(args)
    stream = StreamDecoder(tok)
    stop_ids = () if args.ignore_eos else tok.eos_ids
    for i, token in enumerate(generate(engine, ids, max_tokens, params, stop_ids=stop_ids, prefill=prefill,
                                       media=media)):
        if i == 0:              # the options all checked: any error came as the only line
            notices(args, model.file.metadata)
        if token in stop_ids:
            break
        sys.stdout.write(stream.feed(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")
