"""The `fermoe` command. Each subcommand is a thin layer over a library function;
errors we can name are printed as one line, never as a traceback."""
from __future__ import annotations

import argparse
import sys

import numpy as np

from coordinator.options import add_gpu_options, add_kv_cache_dtype, gpu_engine_options
from shared.errors import FermoeError

DEFAULT_MODEL = "tiny"


def _add_model(p: argparse.ArgumentParser):
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="GGUF file, or the name of a built-in model (default: tiny)")
    _add_engine(p)


def _add_engine(p: argparse.ArgumentParser):
    p.add_argument("--engine", default="cpu",
                   help="cpu (native W4A8 kernels, the default), gpu (prefill on the GPU, decode on the cpu "
                        "engine) or reference (the numpy spec: slow)")
    p.add_argument("-t", "--threads", type=int, default=None,
                   help="cpu engine threads (default: the physical cores of the first NUMA node)")
    add_kv_cache_dtype(p)
    add_gpu_options(p)


def _add_sampling(p: argparse.ArgumentParser):
    from shared.sampling import SamplingParams as d
    p.add_argument("--temp", type=float, default=d.temperature, help=f"temperature; 0 = greedy (default {d.temperature})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"0 = off (default {d.top_k})")
    p.add_argument("--top-p", type=float, default=d.top_p, help=f"default {d.top_p}")
    p.add_argument("--min-p", type=float, default=d.min_p, help=f"default {d.min_p}")
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty, help="1.0 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default or -1: random, as llama.cpp's)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at end-of-generation tokens (as llama.cpp's --ignore-eos)")


def _add_n_predict(p: argparse.ArgumentParser):
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate (default -1: until end of generation or of the context, as llama.cpp's "
                        "and as max_tokens left out over ZeroMQ and HTTP)")


def _max_tokens(args) -> int | None:
    if args.n_predict < -1:
        raise FermoeError(f"-n {args.n_predict}: must be >= 0, or -1 for no limit")
    return None if args.n_predict == -1 else args.n_predict


def _seed(args) -> int | None:
    return None if args.seed == -1 else args.seed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fermoe", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="print a continuation of a prompt")
    _add_model(p)
    p.add_argument("-p", "--prompt", required=True)
    _add_n_predict(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _add_sampling(p)

    p = sub.add_parser("logits", help="write the float32 [T, vocab] logits of every prompt position")
    _add_model(p)
    p.add_argument("--tokens", help="comma-separated token ids")
    p.add_argument("--prompt", help="text to tokenize (instead of --tokens)")
    p.add_argument("--out", required=True, help="output .npy file")

    p = sub.add_parser("convert", help="Hugging Face checkpoint -> GGUF")
    p.add_argument("hf_dir")
    p.add_argument("out")
    p.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0", "q4_0"])

    p = sub.add_parser("synth", help="write a seeded random model with the real structure")
    p.add_argument("out")
    p.add_argument("--preset", default="tiny", choices=["tiny", "qwen3.6-35b-a3b"])
    p.add_argument("--experts", type=int, default=None, help="experts per layer (REAP-style count)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--type", default="q4_0", choices=["f32", "f16", "q8_0", "q4_0"])
    p.add_argument("--seed", type=int, default=0)
    p = sub.add_parser("submit", help="send a prompt to a running coordinator and stream the reply")
    p.add_argument("--addr", default="tcp://127.0.0.1:5557", help="coordinator address (default: loopback 5557)")
    p.add_argument("-p", "--prompt", required=True)
    _add_n_predict(p)
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message (model's template)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for the coordinator")
    _add_sampling(p)

    p = sub.add_parser("demo", help="start a coordinator on a model, submit a prompt, stream it, stop")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL)
    p.add_argument("-p", "--prompt", default="This module provides")
    p.add_argument("-n", "--n-predict", type=int, default=32)
    p.add_argument("--addr", default="tcp://127.0.0.1:5557")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API for a running coordinator")
    from coordinator.http.options import add_http_options
    add_http_options(p, standalone=True)

    from coordinator.quality import add_parsers
    add_parsers(sub, _add_model, _add_engine)

    p = sub.add_parser("bench", help="benchmarks printing JSON: kernels | decode MODEL | prefill MODEL | serve MODEL "
                                     "| http [MODEL]")
    p.add_argument("what", choices=["kernels", "decode", "prefill", "serve", "http"])
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see --help after it)")
    return parser


def _open(args, name: str | None = None):
    """The model `name` (default: args.model) and the engine the options ask for."""
    from shared.builtin import resolve_model
    from shared.model import Model

    model = Model(resolve_model(name or args.model))
    return model, _engine(args, model, args.engine)


def _engine(args, model, name: str):
    from coordinator.engines import load_engine
    return load_engine(name, model, threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
                       **(gpu_engine_options(args) if name == "gpu" else {}))


def cmd_generate(args) -> None:
    from shared.generate import generate
    from shared.sampling import SamplingParams
    from shared.tokenizer import StreamDecoder

    max_tokens = _max_tokens(args)
    model, engine = _open(args)
    prefill = None
    if args.engine == "gpu":        # the prompt on the GPU, the tokens on the CPU from the state it hands over
        prefill, engine = engine, _engine(args, model, "cpu")
    tok = model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    ids = tok.encode(text)
    params = SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                            repeat_penalty=args.repeat_penalty, seed=_seed(args))
    stream = StreamDecoder(tok)
    stop_ids = () if args.ignore_eos else tok.eos_ids
    for token in generate(engine, ids, max_tokens, params, stop_ids=stop_ids, prefill=prefill):
        if token in stop_ids:
            break
        sys.stdout.write(stream.feed(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")


def cmd_logits(args) -> None:
    model, engine = _open(args)
    if (args.tokens is None) == (args.prompt is None):
        raise FermoeError("give exactly one of --tokens and --prompt")
    if args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise FermoeError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
    else:
        ids = model.tokenizer.encode(args.prompt)
    bad = [t for t in ids if not 0 <= t < model.config.n_vocab]
    if not ids or bad:
        raise FermoeError(f"token ids must be in [0, {model.config.n_vocab}); got {bad or 'none'}")
    logits = engine.forward(ids, engine.new_state())
    engine.close()
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: {logits.shape[0]} positions x {logits.shape[1]} logits", file=sys.stderr)


def cmd_convert(args) -> None:
    from shared.convert import convert
    cfg = convert(args.hf_dir, args.out, args.type)
    print(f"wrote {args.out} ({cfg.arch}, {cfg.n_layer} layers, {args.type})", file=sys.stderr)


def cmd_synth(args) -> None:
    from shared.synth import synth
    cfg = synth(args.out, args.preset, args.experts, args.layers, args.type, args.seed)
    print(f"wrote {args.out} ({args.preset}, {cfg.n_expert} experts, {cfg.n_layer} layers, {args.type})",
          file=sys.stderr)


def _stream(client, request_id) -> None:
    done = None
    for msg in client.stream(request_id):
        if hasattr(msg, "text"):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
        else:
            done = msg
    sys.stdout.write("\n")
    print(f"[{done.finish_reason}] prompt {done.prompt_tokens} tokens ({done.cached_prompt_tokens} cached), "
          f"prefill {done.prefill_ms:.0f} ms, {done.completion_tokens} tokens at {done.decode_tok_s:.1f} tok/s"
          + (f", error: {done.error}" if done.error else ""), file=sys.stderr)


def cmd_submit(args) -> None:
    from coordinator.client import Client

    with Client(args.addr) as client:
        if args.wait:
            client.wait_ready(args.wait)
        else:
            client.status(timeout_s=5.0)    # nothing there: one clear error now, not after minutes
        kwargs = dict(messages=[{"role": "user", "content": args.prompt}]) if args.chat else dict(prompt=args.prompt)
        rid = client.submit(max_tokens=_max_tokens(args), temperature=args.temp, top_k=args.top_k, top_p=args.top_p,
                            min_p=args.min_p, repeat_penalty=args.repeat_penalty, seed=_seed(args), stop=args.stop,
                            ignore_eos=args.ignore_eos, **kwargs)
        _stream(client, rid)


def cmd_demo(args) -> None:
    """The daemon path end to end: coordinator up, one streamed request, clean stop."""
    import signal
    import subprocess

    from coordinator.client import Client

    daemon = subprocess.Popen([sys.executable, "-m", "coordinator.daemon", "--model", args.model,
                               "--bind", args.addr, "--snapshot-mem", "64MiB"])
    try:
        with Client(args.addr) as client:
            client.wait_ready(300, alive=lambda: daemon.poll() is None)
            _stream(client, client.submit(args.prompt, max_tokens=args.n_predict, temperature=0.0))
    finally:
        daemon.send_signal(signal.SIGTERM)
        if daemon.wait(timeout=30) != 0:
            raise FermoeError(f"the coordinator exited with status {daemon.returncode}")


def cmd_bench(args) -> None:
    if args.what == "kernels":
        from bench.kernels import main as bench_main
    elif args.what == "decode":
        from bench.decode import main as bench_main
    elif args.what == "prefill":
        from bench.prefill import main as bench_main
    elif args.what == "http":
        from bench.http import main as bench_main
    else:
        from bench.serve import main as bench_main
    sys.argv[0] = f"fermoe bench {args.what}"
    bench_main(args.rest)


def cmd_serve(args) -> None:
    from coordinator.http.server import run
    run(args)


def cmd_ppl(args) -> None:
    from coordinator.quality import cmd_ppl as run
    run(args, _open)


def cmd_compare(args) -> None:
    from coordinator.quality import cmd_compare as run
    run(args, _open)


def cmd_prune(args) -> None:
    from coordinator.quality import cmd_prune as run
    run(args)


COMMANDS = {"generate": cmd_generate, "logits": cmd_logits, "convert": cmd_convert, "synth": cmd_synth,
            "submit": cmd_submit, "demo": cmd_demo, "serve": cmd_serve, "bench": cmd_bench,
            "ppl": cmd_ppl, "compare": cmd_compare, "prune": cmd_prune}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command](args)
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
