"""`fermoe convert`: a Hugging Face Qwen3.5/3.6-MoE checkpoint to a GGUF file (and its vision
tower to an mmproj GGUF)."""
from __future__ import annotations

import sys
from pathlib import Path

from .common import add_mmproj_type

NAME = "convert"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="Hugging Face checkpoint -> GGUF",
                       description="Convert a Hugging Face Qwen3.5/3.6-MoE checkpoint (safetensors) to a GGUF file.")
    p.add_argument("hf_dir", help="the checkpoint's directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0", "q4_0"],
                   help="element type of the large matrices (default f32)")
    p.add_argument("--mmproj", default=None, metavar="OUT",
                   help="also write the vision tower to this mmproj GGUF (a Qwen3_5MoeForConditionalGeneration "
                        "checkpoint with preprocessor_config.json)")
    add_mmproj_type(p)


def run(args) -> None:
    from modeltools.convert import convert
    if args.mmproj:         # the tower first: a checkpoint without one fails before the long text pass
        from modeltools.vision.convert import vision_config_from_hf
        vision_config_from_hf(Path(args.hf_dir))
    cfg = convert(args.hf_dir, args.out, args.type)
    print(f"wrote {args.out} ({cfg.arch}, {cfg.n_layer} layers, {args.type})", file=sys.stderr)
    if args.mmproj:
        from modeltools.vision.convert import convert_mmproj
        vcfg = convert_mmproj(args.hf_dir, args.mmproj, args.mmproj_type)
        print(f"wrote {args.mmproj} (vision tower, {vcfg.n_layer} blocks, {args.mmproj_type})", file=sys.stderr)
