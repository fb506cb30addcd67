"""The coordinator's command line, checked: every impossible option is refused by name."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from shared.errors import FermoeError
from shared.chat import REASONING_MODES
from shared.options import add_kv_cache_dtype, parse_size
from shared.state import DEFAULT_BLOCK, KV_DTYPES

from . import llama_server_flags

DECODE_MODES = ("cpu", "hybrid", "auto")

log = logging.getLogger("fermoe.coordinator")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="coordinator", description="The fermoe daemon: loads a model, starts its CPU "
                                "workers, keeps the prefix snapshot cache and serves clients (`fermoe submit`, "
                                "ZeroMQ; the OpenAI-compatible HTTP API with --http) until SIGTERM or Ctrl-C.")
    p.add_argument("-m", "--model", required=True, help="GGUF path or built-in model name (tiny)")
    p.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision tower (an mmproj GGUF, llama.cpp's): chat messages may then hold images")
    p.add_argument("--bind", default="tcp://127.0.0.1:5557", help="client endpoint (default: tcp://127.0.0.1:5557)")
    p.add_argument("--worker-bind", default="tcp://127.0.0.1:*",
                   help="worker endpoint; loopback by default, a routable address lets other hosts' workers in")
    p.add_argument("--curve-keys", default=None, metavar="DIR",
                   help="require ZeroMQ CURVE keys (made by `fermoe keys DIR`) on both sockets: only the public keys "
                        "in DIR/workers may join as workers, only those in DIR/clients may submit work, and all "
                        "traffic is encrypted; needed to bind --bind or --worker-bind off loopback")
    p.add_argument("--insecure", action="store_true",
                   help="bind --bind or --worker-bind off loopback without keys: anyone who reaches the port can "
                        "submit work, or join as a worker and read every prompt")
    p.add_argument("--cpu-workers-per-socket", type=int, default=1,
                   help="CPU worker processes on each NUMA node (default 1)")
    p.add_argument("--threads-per-worker", "-t", "--threads", type=int, default=None,
                   help="default: the node's physical cores divided among its workers")
    p.add_argument("--snapshot-mem", default=None,
                   help="shared memory (/dev/shm) for prefix snapshots, e.g. 2GiB; 0 = no cache (default: an "
                        "eighth of the host's memory, at most half of /dev/shm's free space and 8 GiB)")
    p.add_argument("--snapshot-dir", default=None, metavar="DIR",
                   help="where snapshots are kept across restarts (default: fermoe/snapshots under the user's cache "
                        "directory, $XDG_CACHE_HOME or ~/.cache)")
    p.add_argument("--snapshot-disk", default=os.environ.get("FERMOE_SNAPSHOT_DISK", "auto"), metavar="SIZE",
                   help="disk space for them, e.g. 20GiB; 0 = none, no disk tier (default auto: a quarter of the "
                        "directory's free space, at most 64 GiB; FERMOE_SNAPSHOT_DISK sets the default)")
    p.add_argument("--snapshot-states", type=int, default=None, metavar="N",
                   help="of the snapshot memory, N slots hold recurrent states (where a prompt can resume), the "
                        "rest the KV of the prompts' blocks (default: about a quarter of it, at least 4)")
    p.add_argument("--block", type=int, default=DEFAULT_BLOCK,
                   help=f"snapshot every this many prompt tokens (default {DEFAULT_BLOCK})")
    p.add_argument("--max-sequences", "-np", "--parallel", type=int, default=8,
                   help="sequences one worker interleaves (default 8)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="positions a sequence may hold, prompt and output (default: the model's context "
                        "length, or less if max-sequences such sequences per worker would not fit in memory; more "
                        "than the context length is taken with a warning: the answers past it are unreliable)")
    p.add_argument("--numa-interleave", action="store_true",
                   help="interleave the weight pages over all NUMA nodes (the paper's setting)")
    p.add_argument("--engine", default="cpu", help="worker engine: cpu (default) or reference")
    p.add_argument("--gpu", default="auto",
                   help="GPUs to prefill on, one gpu_worker each: auto (every CUDA device, when pycuda and a driver "
                        "are there; FERMOE_GPU=emulate counts as one), none, or indices such as 0 or 0,1 "
                        "(default auto)")
    p.add_argument("--gpu-mem", default=None,
                   help="GPU memory each gpu_worker may use, e.g. 6GiB (default: all that is free)")
    p.add_argument("--prefill", default="auto",
                   help="where prompts are prefilled: auto (the GPU when its estimate is shorter, per request), "
                        "gpu (whenever a GPU worker is ready) or cpu (default auto)")
    p.add_argument("--decode", default="cpu", choices=DECODE_MODES,
                   help="where decode steps run: cpu (the CPU workers alone), hybrid (each step's dense part on "
                        "a GPU worker, its routed experts on the CPU worker that owns the sequence; needs a GPU "
                        "and --engine cpu) or auto (each sequence the way its worker's steps have been faster) "
                        "(default cpu)")
    p.add_argument("--reasoning", default="auto", choices=REASONING_MODES,
                   help="thinking for chat requests that do not say (llama-server's): on, off, or auto (the chat "
                        "template's default: on for Qwen3.5/3.6) (default auto)")
    p.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="reasoning tokens a chat may write before its end of reasoning is forced, unless the "
                        "request gives its own (llama-server's): -1 no limit, 0 thinking off (default -1)")
    p.add_argument("--sleep-idle-seconds", type=int, default=-1, metavar="N",
                   help="after N seconds without a request, stop the workers this coordinator started (their "
                        "model's memory freed; the snapshot cache is kept) until the next request starts them "
                        "again (llama-server's): -1 never (default -1)")
    add_kv_cache_dtype(p)
    from shared.http_options import add_http_options
    add_http_options(p)                          # --http, --api-key, --max-queue: the HTTP front end
    llama_server_flags.add_options(p)
    return p


def parse_options(argv=None):
    argv, notes = llama_server_flags.strip(sys.argv[1:] if argv is None else list(argv))
    opts = build_parser().parse_args(argv)
    for note in notes:
        log.info("%s", note)
    llama_server_flags.apply(opts)
    from shared.builtin import resolve_model
    checks = [
        (opts.cpu_workers_per_socket >= 1, f"--cpu-workers-per-socket {opts.cpu_workers_per_socket}: must be >= 1"),
        (opts.threads_per_worker is None or opts.threads_per_worker >= 1,
         f"--threads-per-worker {opts.threads_per_worker}: must be >= 1"),
        (opts.threads_per_worker is None or opts.threads_per_worker <= os.cpu_count(),
         f"--threads-per-worker {opts.threads_per_worker}: more than the {os.cpu_count()} CPUs of this machine"),
        (opts.block >= 1, f"--block {opts.block}: must be >= 1"),
        (opts.max_sequences >= 1, f"--max-sequences {opts.max_sequences}: must be >= 1"),
        (opts.sleep_idle_seconds == -1 or opts.sleep_idle_seconds >= 1,
         f"--sleep-idle-seconds {opts.sleep_idle_seconds}: must be >= 1, or -1 never to sleep"),
        (opts.reasoning_budget >= -1, f"--reasoning-budget {opts.reasoning_budget}: must be >= 0, or -1 for "
                                      f"no limit"),
        (opts.engine in ("cpu", "reference"), f"--engine {opts.engine!r}: expected cpu or reference"),
        (opts.kv_cache_dtype in KV_DTYPES,
         f"--kv-cache-dtype {opts.kv_cache_dtype!r}: expected {' or '.join(KV_DTYPES)}"),
    ]
    for ok, problem in checks:
        if not ok:
            raise FermoeError(problem)
    from shared.http_options import check_http_options
    check_http_options(opts)
    _check_security(opts)
    from shared.topology import numa_nodes, physical_cores
    for node, cpus in numa_nodes().items():
        cores = len(physical_cores(cpus))
        if opts.cpu_workers_per_socket > cores:
            raise FermoeError(f"--cpu-workers-per-socket {opts.cpu_workers_per_socket}: node {node} has {cores} "
                              f"physical cores, and a worker needs one at least")
    from .memory import default_snapshot_mem
    if opts.snapshot_mem is None:
        opts.snapshot_mem, opts.snapshot_mem_default = default_snapshot_mem()
    else:
        opts.snapshot_mem, opts.snapshot_mem_default = parse_size(opts.snapshot_mem), None
    opts.snapshot_disk = None if opts.snapshot_disk == "auto" else parse_size(opts.snapshot_disk)
    from .disk_tier import default_dir
    opts.snapshot_dir = os.path.abspath(os.path.expanduser(opts.snapshot_dir)) if opts.snapshot_dir else \
        str(default_dir())
    opts.model_path = resolve_model(opts.model)
    opts.mmproj = os.path.abspath(opts.mmproj) if opts.mmproj else None     # workers start elsewhere
    opts.gpus = _gpus(opts)
    if opts.decode != "cpu" and (not opts.gpus or opts.engine != "cpu"):
        raise FermoeError(f"--decode {opts.decode}: needs a GPU worker (--gpu) and --engine cpu (the W4A8 experts)"
                          + ("" if opts.gpus else ": no GPU here"))
    return opts


def _check_security(opts) -> None:
    """--curve-keys read now (a bad key file is one error at start, naming it); without
    keys, an endpoint other hosts can reach is refused unless --insecure."""
    from shared.curve import ServerKeys, is_loopback
    if opts.curve_keys is not None and opts.insecure:
        raise FermoeError("--insecure with --curve-keys: give one (keys: only their holders get in)")
    opts.server_keys = ServerKeys(opts.curve_keys) if opts.curve_keys is not None else None
    if opts.server_keys is None and not opts.insecure:
        for flag, endpoint in (("--bind", opts.bind), ("--worker-bind", opts.worker_bind)):
            if not is_loopback(endpoint):
                raise FermoeError(f"{flag} {endpoint}: not a loopback address, and without keys anyone who reaches "
                                  f"it could submit work or join as a worker and read every prompt: give "
                                  f"--curve-keys DIR (made by `fermoe keys DIR`), or --insecure to allow that")


def _gpus(opts) -> list[int]:
    """--gpu and --gpu-mem checked; the device indices to start a gpu_worker on."""
    from shared.devices import gpu_devices

    from .placement import PREFILL_MODES
    if opts.prefill not in PREFILL_MODES:
        raise FermoeError(f"--prefill {opts.prefill!r}: expected {', '.join(PREFILL_MODES)}")
    if opts.gpu_mem is not None and parse_size(opts.gpu_mem) <= 0:
        raise FermoeError(f"--gpu-mem {opts.gpu_mem}: must be positive")
    if opts.gpu == "none":
        if opts.prefill == "gpu":
            raise FermoeError("--prefill gpu: no GPU to prefill on (--gpu none)")
        return []
    found, why = gpu_devices()
    if opts.gpu == "auto":
        if not found and opts.prefill == "gpu":
            raise FermoeError(f"--prefill gpu: no GPU to prefill on ({why})")
        return found
    try:
        asked = [int(i) for i in opts.gpu.split(",")]
    except ValueError:
        raise FermoeError(f"--gpu {opts.gpu!r}: expected auto, none or device indices such as 0,1") from None
    missing = [i for i in asked if i not in found]
    if missing or len(set(asked)) != len(asked):
        raise FermoeError(f"--gpu {opts.gpu}: this machine's GPUs are {found or 'none'}" + (f" ({why})" if why else ""))
    return asked
