"""`fermoe bench restart MODEL.gguf`: the snapshot disk tier across restarts, as JSON.

A coordinator with a disk tier of its own (a fresh directory) prefills a prompt cold, then
serves it again warm from memory; it is stopped cleanly once the disk has its snapshots
and started again on the same directory, and serves the same prompt (resumed from disk)
and the prompt extended by a turn (resumed from disk, the turn prefilled). Then a second
prompt is prefilled, its snapshots written, the coordinator killed with SIGKILL, and the
prompt served by a new one. Each time to first token is of a one-token request sent through
the ZeroMQ client; the options after MODEL go to the coordinator (--gpu 0, --gpu-mem 6GiB...).

JSON keys:
  model                   the GGUF path or built-in name given
  prompt_tokens           tokens of the timed prompt (--prompt)
  turn_tokens             tokens the extended prompt adds (--turn)
  ttft_s                  s: times to first token
  ttft_s.cold             the prompt, no snapshot of it anywhere
  ttft_s.warm_memory      again, from the arena (before the restart)
  ttft_s.after_restart    again after a clean restart, from disk
  ttft_s.turn_after_restart  the prompt extended by a turn, after the restart
  ttft_s.cold_second      a second prompt, cold (before the kill)
  ttft_s.after_kill       the second prompt after kill -9 and a start, from disk
  cached_tokens           prompt tokens served from a snapshot, as the coordinator reports them
  cached_tokens.cold      of the cold prompt
  cached_tokens.warm_memory  of the warm one
  cached_tokens.after_restart  of the prompt after the restart
  cached_tokens.turn_after_restart  of the extended prompt
  cached_tokens.after_kill  of the second prompt after the kill
  disk_load_ms            ms: reading the snapshots from disk into the arena, as Done.disk_ms says
  disk_load_ms.after_restart  for the prompt after the restart
  disk_load_ms.turn_after_restart  for the extended prompt (0: its prefix was in memory already)
  disk_load_ms.after_kill  for the second prompt after the kill
  disk_bytes              bytes the disk tier held when the first coordinator stopped
  restart_s               s: from the clean stop's signal until the new coordinator was ready
  cold_over_after_restart  ttft_s.cold over ttft_s.after_restart"""
from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time

import numpy as np

from coordinator.client import Client
from coordinator.launcher import free_port, last_words, start_coordinator, stop_coordinator
from shared.errors import FermoeError

from .serve import _wait_for_gpu

SETTLE_S = 0.5          # the disk tier's writes have stopped for this long: its snapshots are there


class Daemon:
    """A coordinator on the disk tier's directory, ready (a GPU worker, if started, waited for)."""

    def __init__(self, model: str, directory: str, extra: list[str]):
        self.addr = f"tcp://127.0.0.1:{free_port()}"
        self.log = tempfile.TemporaryFile("w+")
        self.proc = start_coordinator(model, self.addr, ["--snapshot-dir", directory, "--snapshot-disk", "auto",
                                                         *extra], self.log)
        self.client = Client(self.addr, timeout_s=3600)
        try:
            self.client.wait_ready(600, alive=lambda: self.proc.poll() is None)
            self.log.flush()
            self.log.seek(0)
            if "started gpu worker" in self.log.read():
                _wait_for_gpu(self.client, self.proc, self.log)
        except FermoeError as e:
            last = last_words(self.log)
            self.close(kill=True)
            raise FermoeError(f"{e}: {last}" if last else str(e)) from None

    def ttft(self, tokens: list[int]) -> tuple[float, object]:
        t0, first, done = time.perf_counter(), None, None
        for msg in self.client.generate(tokens=tokens, max_tokens=1, temperature=0.0):
            if first is None:
                first = time.perf_counter() - t0
            done = msg
        return first, done

    def settle(self, timeout_s: float = 600) -> dict:
        """The disk figures once its writes have stopped."""
        deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
        while time.monotonic() < deadline:
            disk = {k: v for k, v in self.client.status().snapshots.items() if k.startswith("disk_")}
            if disk != last:
                last, since = disk, time.monotonic()
            elif time.monotonic() - since >= SETTLE_S and disk.get("disk_written", 0) > 0:
                return disk
            time.sleep(0.1)
        raise FermoeError(f"the disk tier wrote nothing within {timeout_s} s: {last_words(self.log)}")

    def close(self, kill: bool = False) -> None:
        self.client.close()
        if kill:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=60)
        else:
            stop_coordinator(self.proc)
        self.log.close()


def run(model: str, prompt_tokens: int, turn_tokens: int, extra: list[str]) -> dict:
    from shared.builtin import resolve_model
    from shared.model import Model
    vocab_hi = min(1000, Model(resolve_model(model)).config.n_vocab)
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, vocab_hi, prompt_tokens).tolist()
    turn = prompt + rng.integers(10, vocab_hi, turn_tokens).tolist()
    second = rng.integers(10, vocab_hi, prompt_tokens).tolist()
    ttft, cached, load = {}, {}, {}

    def timed(daemon: Daemon, name: str, tokens: list[int]) -> None:
        ttft[name], done = daemon.ttft(tokens)
        cached[name], load[name] = done.cached_prompt_tokens, done.disk_ms

    with tempfile.TemporaryDirectory(prefix="fermoe-bench-restart-") as directory:
        d = Daemon(model, directory, extra)
        d.ttft(rng.integers(10, vocab_hi, prompt_tokens).tolist())     # first touches of memory, not in cold
        timed(d, "cold", prompt)
        timed(d, "warm_memory", prompt)
        disk_bytes = d.settle()["disk_bytes"]
        t0 = time.perf_counter()
        d.close()
        d = Daemon(model, directory, extra)
        restart_s = time.perf_counter() - t0
        timed(d, "after_restart", prompt)
        timed(d, "turn_after_restart", turn)
        timed(d, "cold_second", second)
        d.settle()
        d.close(kill=True)
        d = Daemon(model, directory, extra)
        try:
            timed(d, "after_kill", second)
        finally:
            d.close()
    r = lambda v: round(v, 3)           # noqa: E731
    return {"model": model, "prompt_tokens": prompt_tokens, "turn_tokens": turn_tokens,
            "ttft_s": {k: r(v) for k, v in ttft.items()},
            "cached_tokens": {k: cached[k] for k in ("cold", "warm_memory", "after_restart", "turn_after_restart",
                                                    "after_kill")},
            "disk_load_ms": {k: r(load[k]) for k in ("after_restart", "turn_after_restart", "after_kill")},
            "disk_bytes": disk_bytes, "restart_s": r(restart_s),
            "cold_over_after_restart": round(ttft["cold"] / ttft["after_restart"], 1)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fermoe bench restart")
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=947, help="prompt tokens (default 947)")
    p.add_argument("--turn", type=int, default=64, help="tokens the extended prompt adds (default 64)")
    args, daemon_options = p.parse_known_args(argv)      # the rest goes to the coordinator
    print(json.dumps(run(args.model, args.prompt, args.turn, daemon_options), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
