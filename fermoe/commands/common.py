"""What the `fermoe` commands share: their common options (model and engine, prompt and its
escapes, sampling, images), the model and engine the options ask for, the notices, and the
summary line a streamed reply ends with."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fermoe.escapes import process_escapes
from shared.errors import FermoeError
from shared.options import add_gpu_options, add_kv_cache_dtype, add_threads, gpu_engine_options

DEFAULT_MODEL = "tiny"


def add_model(p: argparse.ArgumentParser):
    """The model, its vision tower and the engine's options."""
    add_model_name(p)
    add_mmproj(p)
    add_engine(p)


def add_model_name(p: argparse.ArgumentParser):
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="GGUF file, or the name of a built-in model (default: tiny)")


def add_mmproj(p: argparse.ArgumentParser):
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision tower: an mmproj GGUF (llama.cpp's), checked against the model")


def add_image(p: argparse.ArgumentParser):
    p.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="a PNG or JPEG image before the prompt's text in the user message (repeatable, in "
                        "order; needs --chat and --mmproj)")


def chat_ids(args, model, prompt: str):
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
    encoder, close = image_encoder(args, model)
    try:
        return chat.tokens, media_of_images(len(chat.tokens), inputs, model.config.n_embd, encoder)
    finally:
        close()


class _ImageAt:
    def __init__(self, data, start, rows, cols):
        self.data, self.start, self.rows, self.cols = data, start, rows, cols


def image_encoder(args, model):
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


def add_engine(p: argparse.ArgumentParser):
    p.add_argument("--engine", default="cpu",
                   help="cpu (native W4A8 kernels, the default), gpu (prefill on the GPU, decode on the cpu "
                        "engine), hybrid (prefill on the GPU, decode with the dense part on the GPU and the routed "
                        "experts on the cpu engine) or reference (the numpy spec: slow)")
    add_threads(p)
    add_kv_cache_dtype(p)
    add_gpu_options(p)


def add_sampling(p: argparse.ArgumentParser):
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


def add_n_predict(p: argparse.ArgumentParser):
    p.add_argument("-n", "--n-predict", type=int, default=-1,
                   help="tokens to generate (default -1: until end of generation or of the context, as llama.cpp's "
                        "and as max_tokens left out over ZeroMQ and HTTP)")


def add_prompt(p: argparse.ArgumentParser, required: bool = False, default: str | None = None):
    p.add_argument("-p", "--prompt", required=required, default=default,
                   help="the prompt; escapes such as \\n, \\t, \\\\ and \\xHH are read as llama.cpp's "
                        "CLI reads them" + (f" (default: {default!r})" if default else ""))
    p.add_argument("--no-escape", dest="escape", action="store_false",
                   help="take -p (and --stop) as given, backslashes and all (as llama.cpp's --no-escape)")


def add_mmproj_type(p: argparse.ArgumentParser):
    p.add_argument("--mmproj-type", default="f16", choices=["f32", "f16", "q8_0", "q4_0"],
                   help="element type of the vision tower's matrices (default f16, as llama.cpp's mmproj files)")


def add_text(p) -> None:
    p.add_argument("--text", type=Path, required=True, help="the text to score (UTF-8)")
    p.add_argument("--ctx", type=int, default=512, help="tokens a window (default 512, as llama-perplexity)")


def escaped(args) -> None:
    """-p and --stop with their escapes read (unless --no-escape)."""
    if not args.escape:
        return
    args.prompt = process_escapes(args.prompt, "-p")
    if getattr(args, "stop", None):
        args.stop = [process_escapes(s, "--stop") for s in args.stop]


def max_tokens_of(args) -> int | None:
    if args.n_predict < -1:
        raise FermoeError(f"-n {args.n_predict}: must be >= 0, or -1 for no limit")
    return None if args.n_predict == -1 else args.n_predict


def sampling_of(args):
    """The sampling options as the one value every path takes (checked as it is made)."""
    from shared.sampling import SamplingParams
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                          seed=_seed(args))


def _seed(args) -> int | None:
    return None if args.seed == -1 else args.seed


def read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise FermoeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def window_bos(tokenizer) -> int | None:
    """llama-perplexity puts BOS first in every window when the vocabulary adds one."""
    return tokenizer.bos_id if tokenizer.add_bos else None


def open_model(args, name: str | None = None):
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
    return model, open_engine(args, model, args.engine)


def _open_mmproj(args, model):
    """--mmproj: the vision tower, refused now if it is not this model's."""
    if getattr(args, "mmproj", None) is None:
        return None
    from shared.vision.mmproj import Mmproj
    tower = Mmproj(args.mmproj)
    tower.check_text_model(model.config.n_embd, model.path)
    return tower


def open_engine(args, model, name: str):
    from fermoe.engines import load_engine
    return load_engine(name, model, threads=args.threads, kv_cache_dtype=args.kv_cache_dtype,
                       **(gpu_engine_options(args) if name == "gpu" else {}))


def notices(args, metadata: dict) -> None:
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


def stream(client, request_id, max_tokens: int | None) -> None:
    """A request's text to stdout as it comes, then the summary line on stderr."""
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
