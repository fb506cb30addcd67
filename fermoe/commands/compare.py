"""`fermoe compare`: two models over a text: their perplexities, top-1 agreement and KL(A || B)
(a thin layer over modeltools/perplexity.py)."""
from __future__ import annotations

import json

from shared.errors import FermoeError

from .common import add_engine, add_text, open_model, read_text, window_bos

NAME = "compare"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="perplexity of two models, their top-1 agreement and KL(A || B)",
                       description="Perplexity of two models over a text, how often their most likely next token "
                                   "agrees, and the KL divergence of B's distribution from A's.")
    p.add_argument("model_a", help="GGUF file or built-in model name: the reference")
    p.add_argument("model_b", help="GGUF file or built-in model name: compared with A (e.g. a pruned A)")
    add_engine(p)
    add_text(p)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def run(args) -> None:
    from modeltools.perplexity import compare

    model_a, engine_a = open_model(args, args.model_a)
    model_b, engine_b = open_model(args, args.model_b)
    tok = model_a.tokenizer
    if tok.tokens != model_b.tokenizer.tokens:
        raise FermoeError(f"{args.model_a} and {args.model_b} have different vocabularies: nothing to compare")
    result = compare(engine_a, engine_b, tok.encode(read_text(args.text)), args.ctx, window_bos(tok))
    engine_a.close()
    engine_b.close()
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    print(f"A {args.model_a}: {result.a.line()}")
    print(f"B {args.model_b}: {result.b.line()}")
    print(f"top-1 agreement {100 * result.top1_agreement:.2f}%, mean KL(A || B) {result.kl_mean:.6f} "
          f"+/- {result.kl_stderr:.6f} nats")
