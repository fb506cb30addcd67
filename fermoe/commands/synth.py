"""`fermoe synth`: a seeded model of random weights with the real structure, as GGUF (for speed
and memory measurements)."""
from __future__ import annotations

import sys
from pathlib import Path

from shared.errors import FermoeError

from .common import add_mmproj_type

NAME = "synth"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="write a model of random weights with the real structure (for speed tests)",
                       description="Write a seeded model of random weights with the real structure, as GGUF: "
                                   "for speed and memory measurements (what it generates is noise).")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--preset", default="tiny", choices=["tiny", "qwen3.6-35b-a3b"],
                   help="tiny (a few MB) or the real model's dimensions (default tiny)")
    p.add_argument("--experts", type=int, default=None, help="experts per layer (REAP-style count)")
    p.add_argument("--layers", type=int, default=None, help="layers (default: the preset's)")
    p.add_argument("--type", default="q4_0", choices=["f32", "f16", "q8_0", "q4_0"],
                   help="element type of the large matrices (default q4_0)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--mmproj", default=None, metavar="OUT",
                   help="also write a random vision tower of the preset's shape to this mmproj GGUF")
    add_mmproj_type(p)
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="the chat template to store (Jinja, e.g. a real model's, which renders tools: what "
                        "`fermoe bench agent` needs); default: a plain one without tools")


def run(args) -> None:
    from modeltools.synth import synth
    template = None
    if args.chat_template_file:
        try:
            template = Path(args.chat_template_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise FermoeError(f"--chat-template-file {args.chat_template_file}: {e}") from None
    cfg = synth(args.out, args.preset, args.experts, args.layers, args.type, args.seed, chat_template=template)
    print(f"wrote {args.out} ({args.preset}, {cfg.n_expert} experts, {cfg.n_layer} layers, {args.type})",
          file=sys.stderr)
    if args.mmproj:
        from modeltools.vision.synth import preset_config, synth_mmproj
        vcfg = preset_config(args.preset, projection_dim=cfg.n_embd)
        synth_mmproj(args.mmproj, vcfg, args.mmproj_type, args.seed)
        print(f"wrote {args.mmproj} (random vision tower, {vcfg.n_layer} blocks, {args.mmproj_type})", file=sys.stderr)
