"""The `fermoe` command: the parser, built from the command modules (fermoe/commands/, each
with its parser and its function, a thin layer over a library function), and the dispatch.
Errors we can name are printed as one line, never as a traceback."""
from __future__ import annotations

import argparse
import sys

from fermoe.commands import bench, compare, convert, demo, generate, keys, logits, ppl, prune, serve, submit, synth
from shared.errors import FermoeError

DESCRIPTION = """\
fermoe runs Qwen3.5/3.6-35B-A3B-class mixture-of-experts models (GGUF files) on CPUs, from
the command line or as a daemon serving many clients (ZeroMQ and an OpenAI-compatible HTTP API)."""
EPILOG = r"""examples:
  fermoe demo
      start a coordinator on the built-in model, print a prompt and its continuation, stop
  fermoe generate model.gguf -p "def fib(n):\n" -n 64
      print 64 tokens after a prompt (\n: a newline, as in llama.cpp)

serving: `coordinator --model model.gguf --http 127.0.0.1:8080` starts the daemon and its
HTTP API; `fermoe submit -p "Hello" --stop "\n\n"` sends it a prompt.
`fermoe COMMAND --help` lists a command's options."""

# name -> its module, in the order `fermoe --help` lists them
COMMANDS = {m.NAME: m for m in (generate, logits, convert, synth, submit, demo, keys, serve, ppl, compare, prune,
                                bench)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fermoe", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command].run(args)
    except FermoeError as e:
        print(f"fermoe: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:                    # an output path that cannot be written, a full disk
        print(f"fermoe: error: {e.filename + ': ' if e.filename else ''}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
