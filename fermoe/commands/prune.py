"""`fermoe prune`: a smaller model, K experts a layer kept (a thin layer over modeltools/prune.py)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import read_text

NAME = "prune"
PRUNE_HELP = """\
keep K experts a layer (REAP, arXiv 2510.13999) and write the smaller GGUF.
reap and frequency run the calibration text through the numpy reference forward
(shared/reference.py: the engine that computes each expert's output vector; the native
C engine fuses them away), window by window from an empty state, one layer's weights
dequantised at a time; random needs no text."""


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help=PRUNE_HELP.splitlines()[0].rstrip("."), description=PRUNE_HELP,
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


def run(args) -> None:
    from modeltools.prune import prune
    from shared.builtin import resolve_model

    text = read_text(args.calib) if args.calib is not None and args.method != "random" else None
    kept, stats = prune(resolve_model(args.model), args.out, args.keep, args.method, text, args.calib_tokens,
                        args.ctx, args.seed, args.scores, allow_unseen=args.allow_unseen)
    how = f"{stats.tokens} calibration tokens" if stats is not None else f"seed {args.seed}"
    print(f"wrote {args.out}: {args.keep} experts in each of {len(kept)} layers ({args.method}, {how})",
          file=sys.stderr)
