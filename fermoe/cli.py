"""The `fermoe` command. Each subcommand is a thin layer over a library function;
errors we can name are printed as one line, never as a traceback."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from fermoe.escapes import process_escapes
from shared.errors import FermoeError
from shared.options import add_gpu_options, add_kv_cache_dtype, add_threads, gpu_engine_options

DEFAULT_MODEL = "tiny"
AGENT_QUESTION = "What does json.dumps do?"
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


def _add_model(p: argparse.ArgumentParser):
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="GGUF file, or the name of a built-in model (default: tiny)")
    _add_mmproj(p)
    _add_engine(p)


def _add_mmproj(p: argparse.ArgumentParser):
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision tower: an mmproj GGUF (llama.cpp's), checked against the model")


def _add_image(p: argparse.ArgumentParser):
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="a PNG or JPEG image before the prompt's text in the user message (repeatable, in "
                        "order; needs --chat and --mmproj)")


def _chat_ids(args, model, prompt: str):
    """The token ids of a chat prompt (with args.image: expanded) and its TokenMedia or None."""
    from shared.vision.chat import chat_prompt
    from shared.vision.prompt import media_of_images
    images = []
    for path in args.image:
        try:
            images.append({"type": "image", "data": Path(path).read_bytes()})
        except OSError as e:
            raise FermoeError(f"--image {path}: {e.strerror or e}") from None
    if images and model.mmproj is None:
        raise FermoeError("--image needs --mmproj FILE (the model's vision tower)")
    content = images + [{"type": "text", "text": prompt}] if images else prompt
    vision = model.mmproj.config if model.mmproj is not None else None
    chat = chat_prompt(model.tokenizer, [{"role": "user", "content": content}], vision=vision)
    if not images:
        return chat.tokens, None
    inputs = [_ImageAt(im.data, s.start, s.rows, s.cols) for im, s in zip(chat.images, chat.spans)]
    encoder, close = _image_encoder(args, model)
    try:
        return chat.tokens, media_of_images(len(chat.tokens), inputs, model.config.n_embd, encoder)
    finally:
        close()


class _ImageAt:
    def __init__(self, data, start, rows, cols):
        self.data, self.start, self.rows, self.cols = data, start, rows, cols


def _image_encoder(args, model):
    """(the tower as the engine asks, what closes it): the float64 reference with --engine
    reference, the GPU's with --engine gpu, else the CPU's."""
    from shared.vision.prompt import ImageEncoder
    tower = model.mmproj
    if getattr(model, "gpu_vision", None) is not None:
        return ImageEncoder(tower.config, model.gpu_vision.encode), model.gpu_vision.close
    if args.engine == "reference":
        from shared.vision.reference import encode_image
        return ImageEncoder(tower.config, lambda pixels, grid: encode_image(tower, pixels, grid)), lambda: None
    from cpu_worker.vision_engine import VisionEngine
    engine = VisionEngine(tower, threads=args.threads)
    return ImageEncoder(tower.config, engine.encode), engine.close


def _add_engine(p: argparse.ArgumentParser):
    p.add_argument("--engine", default="cpu",
                   help="cpu (native W4A8 kernels, the default), gpu (prefill on the GPU, decode on the cpu "
                        "engine) or reference (the numpy spec: slow)")
    add_threads(p)
    add_kv_cache_dtype(p)
    add_gpu_options(p)


def _add_sampling(p: argparse.ArgumentParser):
    from shared.sampling import SamplingParams
    d = SamplingParams()
    p.add_argument("--temp", type=float, default=d.temperature, help=f"temperature; 0 = greedy (default {d.temperature})")
    p.add_argument("--top-k", type=int, default=d.top_k, help=f"0 = off (default {d.top_k})")
    p.add_argument("--top-p", type=float, default=d.top_p, help=f"default {d.top_p}")
    p.add_argument("--min-p", type=float, default=d.min_p, help=f"default {d.min_p}")
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty, help="1.0 = off (default)")
    p.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n,
                   help=f"the penalties look at this many last tokens (default {d.repeat_last_n})")
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty, help="0.0 = off (default)")
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty, help="0.0 = off (default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default or -1: random, as llama.cpp's)")
    p.add_argument("--ignore-eos", action="store_true",
                   help="do not stop at end-of-generation tokens (as llama.cpp's --ignore-eos)")


def _add_n_predict(p: argparse.ArgumentParser):
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate (default -1: until end of generation or of the context, as llama.cpp's "
                        "and as max_tokens left out over ZeroMQ and HTTP)")


def _add_prompt(p: argparse.ArgumentParser, required: bool = False, default: str | None = None):
    p.add_argument("-p", "--prompt", required=required, default=default,
                   help="the prompt; escapes such as \\n, \\t, \\\\ and \\xHH are read as llama.cpp's "
                        "CLI reads them" + (f" (default: {default!r})" if default else ""))
    p.add_argument("--no-escape", dest="escape", action="store_false",
                   help="take -p (and --stop) as given, backslashes and all (as llama.cpp's --no-escape)")


def _escaped(args) -> None:
    """-p and --stop with their escapes read (unless --no-escape)."""
    if not args.escape:
        return
    args.prompt = process_escapes(args.prompt, "-p")
    if getattr(args, "stop", None):
        args.stop = [process_escapes(s, "--stop") for s in args.stop]


def _max_tokens(args) -> int | None:
    if args.n_predict < -1:
        raise FermoeError(f"-n {args.n_predict}: must be >= 0, or -1 for no limit")
    return None if args.n_predict == -1 else args.n_predict


def _sampling(args):
    """The sampling options as the one value every path takes (checked as it is made)."""
    from shared.sampling import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=_seed(args))


def _seed(args) -> int | None:
    return None if args.seed == -1 else args.seed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fermoe", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, title="commands", metavar="COMMAND")

    p = sub.add_parser("generate", help="print a continuation of a prompt, in this process (no daemon)",
                       description="Print a continuation of a prompt, in this process (no daemon).")
    _add_model(p)
    _add_prompt(p, required=True)
    _add_n_predict(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _add_image(p)
    _add_sampling(p)

    p = sub.add_parser("logits", help="write the float32 [T, vocab] logits of every prompt position",
                       description="Write the float32 [T, vocab] logits of every prompt position as a .npy file.")
    _add_model(p)
    p.add_argument("--tokens", help="comma-separated token ids")
    p.add_argument("--prompt", help="text to tokenize (instead of --tokens), taken as given")
    p.add_argument("--chat", action="store_true", help="wrap --prompt as a user message in the chat template")
    _add_image(p)
    p.add_argument("--out", required=True, help="output .npy file")

    p = sub.add_parser("convert", help="Hugging Face checkpoint -> GGUF",
                       description="Convert a Hugging Face Qwen3.5/3.6-MoE checkpoint (safetensors) to a GGUF file.")
    p.add_argument("hf_dir", help="the checkpoint's directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("out", help="the GGUF file to write")
    p.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0", "q4_0"],
                   help="element type of the large matrices (default f32)")
    p.add_argument("--mmproj", default=None, metavar="OUT",
                   help="also write the vision tower to this mmproj GGUF (a Qwen3_5MoeForConditionalGeneration "
                        "checkpoint with preprocessor_config.json)")
    _add_mmproj_type(p)

    p = sub.add_parser("synth", help="write a model of random weights with the real structure (for speed tests)",
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
    _add_mmproj_type(p)
    p.add_argument("--chat-template-file", default=None, metavar="FILE",
                   help="the chat template to store (Jinja, e.g. a real model's, which renders tools: what "
                        "`fermoe bench agent` needs); default: a plain one without tools")
    p = sub.add_parser("submit", help="send a prompt to a running coordinator and stream the reply",
                       description="Send a prompt to a running coordinator (started with `coordinator --model "
                                   "MODEL`) and stream the reply; a summary line on stderr says why it stopped.")
    p.add_argument("--addr", default="tcp://127.0.0.1:5557", help="coordinator address (default: loopback 5557)")
    p.add_argument("--curve-key", default=None, metavar="FILE",
                   help="a client key file (clients/NAME.key_secret of `fermoe keys`), for a coordinator started "
                        "with --curve-keys")
    _add_prompt(p, required=True)
    _add_n_predict(p)
    p.add_argument("--chat", action="store_true", help="send the prompt as a chat message (model's template)")
    p.add_argument("--stop", action="append", default=[],
                   help="stop string, with escapes as -p (repeatable), e.g. --stop '\n\n'")
    p.add_argument("--wait", type=float, default=0, help="wait up to this many seconds for the coordinator")
    _add_sampling(p)

    p = sub.add_parser("demo", help="start a coordinator on a model, stream one prompt's continuation (or run "
                                    "a tool loop: --agent), stop",
                       description="Start a coordinator on a model, print a prompt and its continuation as it "
                                   "streams (greedy), say why it stopped, and stop the coordinator. With --agent "
                                   "the prompt is a question asked in a chat that offers a pydoc tool, run here "
                                   "with Python's pydoc whenever the model calls it.")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="GGUF file, or the name of a built-in model (default: tiny)")
    _add_prompt(p)
    p.add_argument("--agent", action="store_true",
                   help=f"a tool loop: the model may call pydoc (default prompt: {AGENT_QUESTION!r})")
    p.add_argument("-n", "--n-predict", type=int, default=None, help="tokens to generate (default 32, with "
                   "--agent 128 a reply; -1: until end of generation or of the context)")
    p.add_argument("--addr", default=None, help="where its coordinator listens (default: a free loopback port; "
                                                "an address another process listens on is refused)")

    p = sub.add_parser("keys", help="write ZeroMQ CURVE key pairs for a coordinator's --curve-keys",
                       description="Write ZeroMQ CURVE key pairs into DIR (made, mode 0700): the coordinator's "
                                   "(server.key, server.key_secret; kept if DIR has them), and a pair for each "
                                   "worker and client name under DIR/workers and DIR/clients (secret files mode "
                                   "0600). A coordinator started with --curve-keys DIR takes only those keys; a "
                                   "worker or client connects with its one NAME.key_secret file (--curve-key), "
                                   "which also holds the coordinator's public key.")
    p.add_argument("dir", help="the keys directory")
    p.add_argument("--worker", action="append", default=None, metavar="NAME",
                   help="a worker pair to write, e.g. one per host (repeatable; with neither --worker nor --client: "
                        "worker, the pair the coordinator's own workers use, and client)")
    p.add_argument("--client", action="append", default=None, metavar="NAME",
                   help="a client pair to write (repeatable; `client` is the pair the coordinator's own HTTP front "
                        "end uses)")
    p.add_argument("--force", action="store_true", help="replace the named pairs that exist (their old keys stop "
                                                        "working)")

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP API for a running coordinator",
                       description="Serve the OpenAI-compatible HTTP API for a running coordinator (or start "
                                   "the coordinator with --http).")
    from coordinator.http.options import add_http_options
    add_http_options(p, standalone=True)

    from fermoe.quality import add_parsers
    add_parsers(sub, _add_model, _add_engine)

    p = sub.add_parser("bench", help="benchmarks printing JSON: kernels | decode MODEL | prefill MODEL | serve MODEL "
                                     "| http [MODEL] | agent MODEL | vision | tools [MODEL]",
                       description="Benchmarks printing JSON; `fermoe bench WHAT --help` lists that one's options.")
    p.add_argument("what", choices=["kernels", "decode", "prefill", "serve", "http", "agent", "vision", "tools"],
                   help="kernels (the native matrix kernels), decode or prefill (one engine on a model), serve "
                        "(the daemon: time to first token, clients), http (the HTTP API end to end), agent (an "
                        "agent's turns and the prefix cache), vision (images through the vision tower on the CPU and "
                        "the GPU) or tools (how often the built-in model calls its pydoc tool correctly on held-out "
                        "names)")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="options of that benchmark (see --help after it)")
    return parser


def _add_mmproj_type(p: argparse.ArgumentParser):
    p.add_argument("--mmproj-type", default="f16", choices=["f32", "f16", "q8_0", "q4_0"],
                   help="element type of the vision tower's matrices (default f16, as llama.cpp's mmproj files)")


def _open(args, name: str | None = None):
    """The model `name` (default: args.model) and the engine the options ask for."""
    from shared.builtin import resolve_model
    from shared.model import Model

    model = Model(resolve_model(name or args.model))
    model.mmproj = _open_mmproj(args, model)
    model.gpu_vision = None
    if args.engine == "gpu" and model.mmproj is not None and getattr(args, "image", None):
        from gpu_worker.vision import gpu_engines      # the tower runs where the prefill runs
        engine, model.gpu_vision = gpu_engines(model, model.mmproj, kv_cache_dtype=args.kv_cache_dtype,
                                               **gpu_engine_options(args))
        return model, engine
    return model, _engine(args, model, args.engine)


def _open_mmproj(args, model):
    """--mmproj: the vision tower, refused now if it is not this model's."""
    if getattr(args, "mmproj", None) is None:
        return None
    from shared.vision.mmproj import Mmproj
    tower = Mmproj(args.mmproj)
    tower.check_text_model(model.config.n_embd, model.path)
    return tower


def _engine(args, model, name: str):
    from fermoe.engines import load_engine
    return load_engine(name, model, threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
                       **(gpu_engine_options(args) if name == "gpu" else {}))


def cmd_generate(args) -> None:
    from shared.generate import generate
    from shared.tokenizer import StreamDecoder

    max_tokens = _max_tokens(args)
    _escaped(args)
    model, engine = _open(args)
    prefill = None
    if args.engine == "gpu":        # the prompt on the GPU, the tokens on the CPU from the state it hands over
        prefill, engine = engine, _engine(args, model, "cpu")
    tok = model.tokenizer
    if args.image and not args.chat:
        raise FermoeError("--image needs --chat: the chat template places the image")
    media = None
    if args.chat:
        ids, media = _chat_ids(args, model, args.prompt)
    else:
        ids = tok.encode(args.prompt)
    params = _sampling(args)
    stream = StreamDecoder(tok)
    stop_ids = () if args.ignore_eos else tok.eos_ids
    for i, token in enumerate(generate(engine, ids, max_tokens, params, stop_ids=stop_ids, prefill=prefill,
                                       media=media)):
        if i == 0:              # the options all checked: any error came as the only line
            _notices(args, model.file.metadata)
        if token in stop_ids:
            break
        sys.stdout.write(stream.feed(token))
        sys.stdout.flush()
    sys.stdout.write(stream.flush() + "\n")


def cmd_logits(args) -> None:
    model, engine = _open(args)
    if (args.tokens is None) == (args.prompt is None):
        raise FermoeError("give exactly one of --tokens and --prompt")
    if (args.chat or args.image) and args.prompt is None:
        raise FermoeError("--chat and --image take --prompt (the user message's text), not --tokens")
    if args.image and not args.chat:
        raise FermoeError("--image needs --chat: the chat template places the image")
    media = None
    if args.chat:
        ids, media = _chat_ids(args, model, args.prompt)
    elif args.tokens is not None:
        try:
            ids = [int(t) for t in args.tokens.split(",") if t.strip()]
        except ValueError:
            raise FermoeError(f"--tokens {args.tokens!r}: expected comma-separated integers") from None
    else:
        ids = model.tokenizer.encode(args.prompt)
    bad = [t for t in ids if not 0 <= t < model.config.n_vocab]
    if not ids or bad:
        raise FermoeError(f"token ids must be in [0, {model.config.n_vocab}); got {bad or 'none'}")
    logits = engine.forward(ids, engine.new_state(), **({"media": media} if media is not None else {}))
    engine.close()
    np.save(args.out, logits.astype(np.float32))
    print(f"wrote {args.out}: {logits.shape[0]} positions x {logits.shape[1]} logits", file=sys.stderr)


def cmd_convert(args) -> None:
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


def cmd_synth(args) -> None:
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


def _notices(args, metadata: dict) -> None:
    """One line on stderr where the output will be noise: random weights."""
    from shared.model import has_random_weights, random_weights_notice
    if has_random_weights(metadata):
        print(f"fermoe: {random_weights_notice(args.model)}", file=sys.stderr)


def stop_words(done, max_tokens: int | None) -> str:
    """Why a request stopped, in words."""
    if done.finish_reason == "length":
        return f"{max_tokens} tokens (-n)" if max_tokens is not None else "end of the context"
    if done.finish_reason == "stop":
        return f"stop string {done.stop_reason!r}" if done.stop_reason is not None else "end of generation"
    return f"error: {done.error}" if done.finish_reason == "error" else done.finish_reason


def summary(done, max_tokens: int | None) -> str:
    """The line `fermoe submit` and `fermoe demo` end with: why it stopped, then the counts and timings."""
    decode = f" at {done.decode_tok_s:.1f} tok/s" if done.completion_tokens > 1 else ""
    return (f"stopped: {stop_words(done, max_tokens)}; prompt {done.prompt_tokens} tokens "
            f"({done.cached_prompt_tokens} cached), prefill {done.prefill_ms:.0f} ms, "
            f"{done.completion_tokens} tokens generated{decode}")


def _stream(client, request_id, max_tokens: int | None) -> None:
    done = None
    for msg in client.stream(request_id):
        if hasattr(msg, "text"):
            sys.stdout.write(msg.text)
            sys.stdout.flush()
        else:
            done = msg
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(summary(done, max_tokens), file=sys.stderr)


def cmd_submit(args) -> None:
    from coordinator.client import Client

    max_tokens = _max_tokens(args)
    _escaped(args)
    with Client(args.addr, curve_key=args.curve_key) as client:
        if args.wait:
            client.wait_ready(args.wait)
        else:
            client.status(timeout_s=5.0)    # nothing there: one clear error now, not after minutes
        kwargs = dict(messages=[{"role": "user", "content": args.prompt}]) if args.chat else dict(prompt=args.prompt)
        rid = client.submit(max_tokens=max_tokens, sampling=_sampling(args), stop=args.stop,
                            ignore_eos=args.ignore_eos, **kwargs)
        _stream(client, rid, max_tokens)


def cmd_demo(args) -> None:
    """The daemon path end to end: coordinator up, one streamed request, clean stop. The
    coordinator's log goes to a file, shown only if it fails: the output is the prompt,
    its continuation and why it stopped."""
    import tempfile

    from coordinator.client import Client
    from coordinator.launcher import last_words, start_coordinator, stop_coordinator
    from shared.builtin import resolve_model
    from shared.gguf_file import GGUFFile

    if args.n_predict is None:
        args.n_predict = 128 if args.agent else 32
    max_tokens = _max_tokens(args)
    if args.prompt is None:
        args.prompt = AGENT_QUESTION if args.agent else "This module provides"
    _escaped(args)
    path = resolve_model(args.model)
    try:
        metadata = GGUFFile(path).metadata
    except OSError as e:
        raise FermoeError(f"{args.model}: {e.strerror or e}") from None
    _notices(args, metadata)
    args.addr = _own_address(args.addr)
    with tempfile.TemporaryFile("w+") as log:
        daemon = start_coordinator(args.model, args.addr, ["--snapshot-mem", "64MiB"], log)
        try:
            with Client(args.addr) as client:
                try:
                    client.wait_ready(300, alive=lambda: daemon.poll() is None)
                except FermoeError as e:
                    last = last_words(log)
                    raise FermoeError(f"{e}" + (f": {last}" if last else "")) from None
                if args.agent:
                    _agent(client, args.prompt, max_tokens, metadata)
                else:
                    sys.stdout.write(args.prompt)
                    _stream(client, client.submit(args.prompt, max_tokens=max_tokens, temperature=0.0), max_tokens)
        finally:
            stop_coordinator(daemon)
        if daemon.returncode != 0:
            last = last_words(log)
            raise FermoeError(f"the coordinator exited with status {daemon.returncode}" + (f": {last}" if last else ""))


def _own_address(addr: str | None) -> str:
    """Where the demo's own coordinator listens: a free loopback port, or `addr` when no
    process listens there already (the demo would talk to that one, on another model maybe)."""
    import socket

    from coordinator.launcher import free_port
    if addr is None:
        return f"tcp://127.0.0.1:{free_port()}"
    host, sep, port = addr.removeprefix("tcp://").rpartition(":")
    if addr.startswith("tcp://") and sep and port.isdigit():
        with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
            s.settimeout(1.0)
            if s.connect_ex((host.strip("[]"), int(port))) == 0:
                raise FermoeError(f"--addr {addr}: another process listens there already (a coordinator of its "
                                  "own?); leave --addr out to use a free port")
    return addr


def _agent(client, question: str, max_tokens: int | None, metadata: dict) -> None:
    from fermoe.agent_demo import run
    from shared.chat import opens_reasoning
    from shared.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_metadata(metadata)
    if not tokenizer.chat_template:
        raise FermoeError("--agent needs a model with a chat template (tokenizer.chat_template)")
    run(client, question, max_tokens, opens_reasoning(tokenizer), lambda done: summary(done, max_tokens))


def cmd_bench(args) -> None:
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
    elif args.what == "vision":
        from bench.vision import main as bench_main
    elif args.what == "tools":
        from bench.tool_calls import main as bench_main
    else:
        from bench.serve import main as bench_main
    sys.argv[0] = f"fermoe bench {args.what}"
    bench_main(args.rest)


def cmd_keys(args) -> None:
    from shared.curve import write_keys
    # named pairs only: what is not named is not written (a first run gets the two the coordinator needs)
    first = args.worker is None and args.client is None
    workers = args.worker or (["worker"] if first else [])
    clients = args.client or (["client"] if first else [])
    for path in write_keys(args.dir, workers, clients, force=args.force):
        print(f"wrote {path}", file=sys.stderr)


def cmd_serve(args) -> None:
    from coordinator.http.server import run
    run(args)


def cmd_ppl(args) -> None:
    from fermoe.quality import cmd_ppl as run
    run(args, _open)


def cmd_compare(args) -> None:
    from fermoe.quality import cmd_compare as run
    run(args, _open)


def cmd_prune(args) -> None:
    from fermoe.quality import cmd_prune as run
    run(args)


COMMANDS = {"generate": cmd_generate, "logits": cmd_logits, "convert": cmd_convert, "synth": cmd_synth,
            "submit": cmd_submit, "demo": cmd_demo, "keys": cmd_keys, "serve": cmd_serve, "bench": cmd_bench,
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
