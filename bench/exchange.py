"""`fermoe bench exchange`: the round trip between two processes of this host, through the
shared-memory mailbox (shared/exchange.py) and through ZeroMQ, for the message sizes a
hybrid decode step would trade once a layer, as JSON.

A child process echoes every message back; the parent times `--rounds` round trips of
each size after a warm-up, one way of exchanging after the other. A hybrid decode step
crosses twice a layer (the hidden states out, the experts' sum back): 80 hops a token
for a 40-layer model, so a round trip of R us costs 40 R us a token.

JSON keys:
  rounds                  round trips timed for each size and way
  sizes                   message bytes: a hidden vector of 2048 fp32 (8 KiB), 4 of them, 32 of them
  round_trip_us           by way: shm (the mailbox), zmq_ipc (a PAIR socket over ipc://), zmq_tcp
                          (over 127.0.0.1)
  round_trip_us.<way>     by message size in bytes
  round_trip_us.<way>.<size>  microseconds from a send to the echo's arrival
  round_trip_us.<way>.<size>.median  the median round trip
  round_trip_us.<way>.<size>.p90  its 90th percentile
  per_token_ms_40_layers  by way: what 40 round trips of the smallest size cost at the median
  per_token_ms_40_layers.<way>  ms
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

SIZES = (8 << 10, 32 << 10, 256 << 10)


def _percentiles(seconds: list[float]) -> dict:
    us = np.array(seconds) * 1e6
    return {"median": round(float(np.median(us)), 2), "p90": round(float(np.percentile(us, 90)), 2)}


def echo(way: str, address: str, capacity: int, messages: int) -> None:
    """The child: send back each of `messages` messages as it came."""
    if way == "shm":
        from shared.exchange import Exchange
        with Exchange.attach(address, capacity) as ex:
            for _ in range(messages):
                ex.send(ex.receive(timeout_s=60))
        return
    import zmq
    sock = zmq.Context.instance().socket(zmq.PAIR)
    sock.connect(address)
    for _ in range(messages):
        sock.send(sock.recv(copy=False), copy=False)
    sock.close(linger=1000)


def _child(way: str, address: str, capacity: int, messages: int) -> subprocess.Popen:
    code = f"from bench.exchange import echo; echo({way!r}, {address!r}, {capacity}, {messages})"
    return subprocess.Popen([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)) or ".")


def time_way(way: str, sizes, rounds: int, warmup: int = 200) -> dict[int, dict]:
    """Median and p90 round trip of each size through `way`, against an echoing child."""
    capacity, messages = max(sizes), len(sizes) * (rounds + warmup)
    payloads = {n: np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8) for n in sizes}
    out = {}
    if way == "shm":
        from shared.exchange import Exchange
        ex = Exchange.create(capacity)
        child = _child(way, ex.name, capacity, messages)
        send, receive = ex.send, lambda: ex.receive(timeout_s=60)
    else:
        import zmq
        sock = zmq.Context.instance().socket(zmq.PAIR)
        if way == "zmq_ipc":
            address = f"ipc://{tempfile.mkdtemp()}/x"
            sock.bind(address)
        else:
            port = sock.bind_to_random_port("tcp://127.0.0.1")
            address = f"tcp://127.0.0.1:{port}"
        child = _child(way, address, capacity, messages)
        send, receive = (lambda m: sock.send(m, copy=False)), (lambda: sock.recv(copy=False))
    try:
        for n in sizes:
            data, times = payloads[n], []
            for i in range(rounds + warmup):
                t0 = time.perf_counter()
                send(data)
                back = receive()
                times.append(time.perf_counter() - t0)
                if i == 0 and bytes(memoryview(back)) != data.tobytes():
                    raise RuntimeError(f"{way}: the echo of {n} bytes came back changed")
            out[n] = _percentiles(times[warmup:])
    finally:
        if child.wait(timeout=60) != 0:
            raise RuntimeError(f"{way}: the echoing child exited with {child.returncode}")
        if way == "shm":
            ex.close()
        else:
            sock.close(linger=0)
    return out


def run(rounds: int = 2000, sizes=SIZES) -> dict:
    ways = {w: time_way(w, sizes, rounds) for w in ("shm", "zmq_ipc", "zmq_tcp")}
    return {"rounds": rounds, "sizes": list(sizes),
            "round_trip_us": {w: {str(n): r for n, r in by.items()} for w, by in ways.items()},
            "per_token_ms_40_layers": {w: round(40 * by[min(sizes)]["median"] / 1000, 3) for w, by in ways.items()}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fermoe bench exchange", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2000, help="round trips timed for each size and way")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    print(json.dumps(run(args.rounds), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
