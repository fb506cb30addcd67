"""`fermoe bench WHAT`: the benchmarks (bench/), each printing JSON; the options after WHAT are
that benchmark's own."""
from __future__ import annotations

import argparse
import sys

NAME = "bench"


def add_parser(sub) -> None:
    p = sub.add_parser(NAME, help="benchmarks printing JSON: kernels | decode MODEL | prefill MODEL | serve MODEL "
                                  "| http [MODEL] | agent MODEL | restart MODEL | vision | tools [MODEL] | exchange "
                                  "| hybrid MODEL",
                       description="Benchmarks printing JSON; `fermoe bench WHAT --help` lists that one's options.")
    p.add_argument("what", choices=["kernels", "decode", "prefill", "serve", "http", "agent", "restart", "vision",
                                          "tools", "exchange", "hybrid"],
                   help="kernels (the native matrix kernels), decode or prefill (one engine on a model), serve "
                        "(the daemon: time to first token, clients), http (the HTTP API end to end), agent (an "
                        "agent's turns and the prefix cache), restart (the snapshot disk tier across restarts), vision (images through the vision tower on the CPU and "
                        "the GPU), tools (how often the built-in model calls its pydoc tool correctly on held-out "
                        "names), exchange (a round trip between two processes: shared memory against ZeroMQ) or "
                        "hybrid (decode with the dense part on the GPU, the routed experts on the CPU, beside the "
                        "CPU alone)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see --help after it)")


def run(args) -> None:
    if args.what == "kernels":
        from bench.kernels import main as bench_main
    elif args.what == "decode":
        from bench.decode import main as bench_main
    elif args.what == "prefill":
        from bench.prefill import main as bench_main
    elif args.what == "http":
        from bench.http import main as bench_main
    elif args.what == "agent":
        from bench.agent import main as bench_main
    elif args.what == "restart":
        from bench.restart import main as bench_main
    elif args.what == "vision":
        from bench.vision import main as bench_main
    elif args.what == "tools":
        from bench.tool_calls import main as bench_main
    elif args.what == "exchange":
        from bench.exchange import main as bench_main
    elif args.what == "hybrid":
        from bench.hybrid import main as bench_main
    else:
        from bench.serve import main as bench_main
    sys.argv[0] = f"fermoe bench {args.what}"
    bench_main(args.rest)
