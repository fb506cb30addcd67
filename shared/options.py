"""Command-line options and sizes that several commands and processes take alike (the
coordinator, its workers, `fermoe generate`, the benchmarks), each checked in one place."""
from __future__ import annotations

import argparse
import re

from .errors import FermoeError
from .state import DEFAULT_KV_DTYPE, KV_DTYPES

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "kb": 1000, "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
          "g": 1 << 30, "gib": 1 << 30, "gb": 10**9, "t": 1 << 40, "tib": 1 << 40, "tb": 10**12}


def parse_size(text: str) -> int:
    """'8GiB', '512M', '1.5g', '0' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise FermoeError(f"size {text!r}: expected a number with an optional unit (e.g. 8GiB, 512M)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_kv_cache_dtype(p: argparse.ArgumentParser):
    """--kv-cache-dtype, as the daemon, generate, logits and bench decode take it."""
    p.add_argument("--kv-cache-dtype", default=DEFAULT_KV_DTYPE,
                   help=f"element type of the attention KV cache: {' or '.join(KV_DTYPES)} "
                        f"(default {DEFAULT_KV_DTYPE}, as llama.cpp's)")


def _threads(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: must be at least 1")
    return n


def add_threads(p: argparse.ArgumentParser):
    """-t/--threads, as every command that runs a CPU engine takes it: None (not given) is
    the engines' own default, one thread on each physical core of the first NUMA node."""
    p.add_argument("-t", "--threads", type=_threads, default=None,
                   help="cpu engine threads (default: the physical cores of the first NUMA node)")


def add_gpu_options(p: argparse.ArgumentParser):
    """--gpu-mem and --gpu, for --engine gpu."""
    p.add_argument("--gpu-mem", default=None,
                   help="GPU memory the gpu engine may use, e.g. 6GiB (the paper's card); default: all that is free")
    p.add_argument("--gpu", type=int, default=0, help="CUDA device index for the gpu engine (default 0)")


def gpu_engine_options(args) -> dict:
    """The GPU engine's keyword arguments from --gpu-mem / --gpu."""
    mem = parse_size(args.gpu_mem) if args.gpu_mem is not None else None
    if mem is not None and mem <= 0:
        raise FermoeError(f"--gpu-mem {args.gpu_mem}: must be positive")
    if args.gpu < 0:
        raise FermoeError(f"--gpu {args.gpu}: must be >= 0")
    return {"gpu_mem": mem, "gpu": args.gpu}
