"""`fermoe ppl`, `fermoe compare` and `fermoe prune`: measuring a model over a text,
and making a smaller one. Thin layers over modeltools/perplexity.py and modeltools/prune.py."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from shared.errors import FermoeError

PRUNE_HELP = """\
keep K experts a layer (REAP, arXiv 2510.13999) and write the smaller GGUF.
reap and frequency run the calibration text through the numpy reference forward
(shared/reference.py: the engine that computes each expert's output vector; the native
C engine fuses them away), window by window from an empty state, one layer's weights
dequantised at a time; random needs no text."""


def add_parsers(sub, add_model, add_engine) -> None:
    """The three subcommands, on the `fermoe` parser's subparsers."""
    p = sub.add_parser("ppl", help="perplexity over a text, in llama-perplexity's windows",
                       description="Perplexity of a model over a text, scored in llama-perplexity's windows "
                                   "(the second half of each window).")
    add_model(p)
    _add_text(p)

    p = sub.add_parser("compare", help="perplexity of two models, their top-1 agreement and KL(A || B)",
                       description="Perplexity of two models over a text, how often their most likely next token "
                                   "agrees, and the KL divergence of B's distribution from A's.")
    p.add_argument("model_a", help="GGUF file or built-in model name: the reference")
    p.add_argument("model_b", help="GGUF file or built-in model name: compared with A (e.g. a pruned A)")
    add_engine(p)
    _add_text(p)
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")

    p = sub.add_parser("prune", help=PRUNE_HELP.splitlines()[0].rstrip("."), description=PRUNE_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="GGUF file or built-in model name")
    p.add_argument("--keep", type=int, required=True, help="experts to keep in every layer")
    p.add_argument("-o", "--out", required=True, help="the pruned GGUF to write")
    p.add_argument("--method", default="reap", help="reap (default), frequency or random")
    p.add_argument("--calib", type=Path, help="calibration text (UTF-8); needed by reap and frequency")
    p.add_argument("--calib-tokens", type=int, default=None, help="use the text's first N tokens (default: all)")
    p.add_argument("--ctx", type=int, default=512, help="tokens a calibration window (default 512)")
    p.add_argument("--seed", type=int, default=0, help="the random method's seed (default 0)")
    p.add_argument("--scores", type=Path, help="write per-layer saliencies, frequencies and kept experts as JSON")
    p.add_argument("--allow-unseen", action="store_true",
                   help="experts the calibration text never routes a token to score 0 and go first, instead of "
                        "an error (dead experts: ones the router never picks)")


def _add_text(p) -> None:
    p.add_argument("--text", type=Path, required=True, help="the text to score (UTF-8)")
    p.add_argument("--ctx", type=int, default=512, help="tokens a window (default 512, as llama-perplexity)")


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FermoeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _bos(tokenizer) -> int | None:
    """llama-perplexity puts BOS first in every window when the vocabulary adds one."""
    return tokenizer.bos_id if tokenizer.add_bos else None


def cmd_ppl(args, open_model) -> None:
    from modeltools.perplexity import perplexity

    model, engine = open_model(args, args.model)
    tok = model.tokenizer
    result = perplexity(engine, tok.encode(read_text(args.text)), args.ctx, _bos(tok))
    engine.close()
    print(f"{args.model}: {result.line()}")


def cmd_compare(args, open_model) -> None:
    from modeltools.perplexity import compare

    model_a, engine_a = open_model(args, args.model_a)
    model_b, engine_b = open_model(args, args.model_b)
    tok = model_a.tokenizer
    if tok.tokens != model_b.tokenizer.tokens:
        raise FermoeError(f"{args.model_a} and {args.model_b} have different vocabularies: nothing to compare")
    result = compare(engine_a, engine_b, tok.encode(read_text(args.text)), args.ctx, _bos(tok))
    engine_a.close()
    engine_b.close()
    if args.json:
        print(json.dumps(result.as_dict()))
        return
    print(f"A {args.model_a}: {result.a.line()}")
    print(f"B {args.model_b}: {result.b.line()}")
    print(f"top-1 agreement {100 * result.top1_agreement:.2f}%, mean KL(A || B) {result.kl_mean:.6f} "
          f"+/- {result.kl_stderr:.6f} nats")


def cmd_prune(args) -> None:
    from shared.builtin import resolve_model
    from modeltools.prune import prune

    text = read_text(args.calib) if args.calib is not None and args.method != "random" else None
    kept, stats = prune(resolve_model(args.model), args.out, args.keep, args.method, text, args.calib_tokens,
                        args.ctx, args.seed, args.scores, allow_unseen=args.allow_unseen)
    how = f"{stats.tokens} calibration tokens" if stats is not None else f"seed {args.seed}"
    print(f"wrote {args.out}: {args.keep} experts in each of {len(kept)} layers ({args.method}, {how})",
          file=sys.stderr)
