"""The process that serves a model's routed experts to a hybrid decode step.

`spawn_expert_server` creates the shared-memory Exchange, starts this module as a child
(`python -m cpu_worker.expert_server`), which loads the model into a NativeEngine, says
READY and answers each layer's request (shared/expert_exchange.py) until told to stop.
The child dies with its parent (shared/parent.py); a child that dies first makes the
client's next call raise, naming its exit, instead of waiting for ever.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from shared.config import ModelConfig
from shared.errors import FermoeError
from shared.exchange import Exchange
from shared.expert_exchange import ERROR, READY, ExpertClient, header, message_bytes, serve_experts
from shared.gguf_file import GGUFFile
from shared.parent import child_env, die_with_parent

ROOT = Path(__file__).resolve().parent.parent
MAX_BATCH = 64          # sequences of one decode step a server takes at most
START_TIMEOUT_S = 300.0  # loading the full-size model's experts from a cold disk


def spawn_expert_server(model_path, threads: int | None = None, cpus: list[int] | None = None,
                        max_batch: int = MAX_BATCH, experts: str | None = None, timeout_s: float = 30.0,
                        start_timeout_s: float = START_TIMEOUT_S) -> tuple[subprocess.Popen, ExpertClient]:
    """A started expert server of the model at model_path and the client that asks it;
    returns once it has loaded the model. threads, cpus: its NativeEngine's; experts: the
    name of an ExpertSegment to read the experts from instead of the file; timeout_s: the
    client's wait for each reply. Stop it with stop_expert_server."""
    path = str(Path(model_path).resolve())
    with GGUFFile(path) as f:
        cfg = ModelConfig.from_metadata(f.metadata, path)
    capacity = message_bytes(max_batch, cfg.n_embd, cfg.n_expert_used)
    exchange = Exchange.create(capacity, prefix="fermoe_experts")
    cmd = [sys.executable, "-m", "cpu_worker.expert_server", "--exchange", exchange.name, "--capacity",
           str(capacity), "--model", path, "--max-batch", str(max_batch)]
    if threads is not None:
        cmd += ["--threads", str(threads)]
    if cpus is not None:
        cmd += ["--cpus", ",".join(map(str, cpus))]
    if experts is not None:
        cmd += ["--experts", experts]
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.DEVNULL, start_new_session=True, env=child_env())
    except BaseException:
        exchange.close()
        raise
    client = ExpertClient(exchange, timeout_s, gone=lambda: exit_reason(proc))
    try:
        client.wait_ready(start_timeout_s)
    except BaseException:
        stop_expert_server(proc, client, timeout_s=0)
        raise
    return proc, client


def exit_reason(proc: subprocess.Popen) -> str | None:
    """Why the server cannot answer (how it exited), or None while it runs."""
    rc = proc.poll()
    if rc is None:
        return None
    how = f"was killed by signal {-rc}" if rc < 0 else f"exited with status {rc}"
    return f"the expert server (pid {proc.pid}) {how}"


def stop_expert_server(proc: subprocess.Popen, client: ExpertClient, timeout_s: float = 10.0) -> int:
    """Stop the server (killed if it has not ended within timeout_s), remove the exchange;
    returns its exit status."""
    try:
        if proc.poll() is None:
            client.stop()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    finally:
        client.exchange.close()
    return proc.returncode


def serve(model_path: str, exchange: Exchange, threads: int | None, cpus: list[int] | None, max_batch: int,
          experts: str | None) -> int:
    """The child: load, say READY (or ERROR with why not), serve until STOP."""
    from shared.model import Model
    from .native_engine import NativeEngine
    segment = None
    try:
        model = Model(model_path)
        if experts is not None:
            from shared.expert_segment import ExpertSegment
            segment = ExpertSegment.attach(experts, model)
        engine = NativeEngine(model, threads=threads, cpus=cpus, max_batch=max_batch, experts=segment)
    except Exception as e:          # noqa: BLE001 -- the parent waits for an answer either way
        exchange.send(header(ERROR), (str(e) if isinstance(e, FermoeError) else f"{type(e).__name__}: {e}").encode())
        return 1
    cfg = model.config
    exchange.send(header(READY, os.getpid(), 0, cfg.n_expert_used, cfg.n_embd))
    try:
        serve_experts(exchange, engine)
    finally:
        engine.close()
    return 0


def main(argv=None) -> int:
    die_with_parent()
    p = argparse.ArgumentParser(prog="cpu_worker.expert_server", description=__doc__.splitlines()[0])
    p.add_argument("--exchange", required=True, help="the name of the Exchange its parent created")
    p.add_argument("--capacity", type=int, required=True, help="the exchange's payload bytes")
    p.add_argument("--model", required=True)
    p.add_argument("--max-batch", type=int, default=MAX_BATCH)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpus", default=None, help="comma-separated CPUs to pin to")
    p.add_argument("--experts", default=None, help="an ExpertSegment's name: the experts from there")
    args = p.parse_args(argv)
    cpus = [int(c) for c in args.cpus.split(",")] if args.cpus else None
    with Exchange.attach(args.exchange, args.capacity) as exchange:
        return serve(args.model, exchange, args.threads, cpus, args.max_batch, args.experts)


if __name__ == "__main__":
    sys.exit(main())
