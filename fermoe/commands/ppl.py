"""`fermoe ppl`: a model's perplexity over a text, in llama-perplexity's windows (a thin layer
over modeltools/perplexity.py)."""
from __future__ import annotations

from .common import add_model, add_text, open_model, read_text, window_bos

NAME = "ppl"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="perplexity over a text, in llama-perplexity's windows",
                       description="Perplexity of a model over a text, scored in llama-perplexity's windows "
                                   "(the second half of each window).")
    add_model(p)
    add_text(p)


def run(args) -> None:
    from modeltools.perplexity import perplexity

    model, engine = open_model(args, args.model)
    tok = model.tokenizer
    result = perplexity(engine, tok.encode(read_text(args.text)), args.ctx, window_bos(tok))
    engine.close()
    print(f"{args.model}: {result.line()}")
