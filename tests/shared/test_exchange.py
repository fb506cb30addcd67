"""The shared-memory mailbox between two processes (shared/exchange.py) and its benchmark."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import numpy as np
import pytest

from shared.exchange import Exchange, ExchangeError, ExchangeTimeout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def test_messages_cross_to_another_process_and_back_exactly():
    """Guards the payload's length and order: messages of every size up to the capacity,
    echoed by another process, come back byte for byte, each after its predecessor."""
    sizes = [1, 7, 8192, 4096, 65536, 3]
    with Exchange.create(65536) as ex:
        child = subprocess.Popen([sys.executable, "-c", f"from bench.exchange import echo; "
                                  f"echo('shm', {ex.name!r}, 65536, {len(sizes)})"], cwd=ROOT)
        for n in sizes:
            data = np.random.default_rng(n).integers(0, 255, n, dtype=np.uint8)
            ex.send(data)
            assert bytes(ex.receive(timeout_s=30)) == data.tobytes()
        assert child.wait(timeout=30) == 0


def test_refusals_name_the_problem():
    """A message over the capacity, no reply in time, and a peer that sent twice before a
    receive: each an ExchangeError that says which."""
    with Exchange.create(16) as a:
        b = Exchange.attach(a.name, 16)
        with pytest.raises(ExchangeError, match="a message of 17 bytes: the exchange holds 16"):
            a.send(b"x" * 17)
        t0 = time.perf_counter()
        with pytest.raises(ExchangeError, match=f"no message from the other end of {a.name} in 0.05 s"):
            b.receive(timeout_s=0.05)
        assert time.perf_counter() - t0 < 5
        a.send(b"one")
        assert bytes(b.receive()) == b"one"
        a.send(b"two")
        a.send(b"three")
        with pytest.raises(ExchangeError, match="sent 1 messages more than were received"):
            b.receive()
        b.close()


def test_a_message_of_several_parts_arrives_as_one():
    """Guards send(*parts): each part lands after the one before it, the length is their
    sum, and parts over the capacity together are refused though each alone fits."""
    with Exchange.create(64) as a:
        b = Exchange.attach(a.name, 64)
        a.send(b"head", np.arange(3, dtype=np.int32), np.ones((2, 2), np.float32), b"")
        want = b"head" + np.arange(3, dtype=np.int32).tobytes() + np.ones((2, 2), np.float32).tobytes()
        assert bytes(b.receive(timeout_s=5)) == want
        with pytest.raises(ExchangeError, match="a message of 65 bytes: the exchange holds 64"):
            b.send(bytes(40), bytes(25))
        with pytest.raises(ExchangeTimeout):
            a.receive(timeout_s=0.01)
        b.close()


def test_the_creator_removes_the_mailbox_and_the_other_end_does_not():
    a = Exchange.create(64)
    path = f"/dev/shm/{a.name}"
    b = Exchange.attach(a.name, 64)
    b.close()
    assert os.path.exists(path)
    a.close()
    assert not os.path.exists(path)


def test_bench_exchange_times_every_way_and_size():
    from bench.exchange import run
    import bench.exchange
    from tests.support.bench_keys import assert_keys_documented
    out = run(rounds=20, sizes=(1024, 8192))
    assert set(out["round_trip_us"]) == {"shm", "zmq_ipc", "zmq_tcp"}
    for way in out["round_trip_us"].values():
        assert set(way) == {"1024", "8192"} and all(0 < t["median"] <= t["p90"] for t in way.values())
    assert out["per_token_ms_40_layers"]["shm"] == round(40 * out["round_trip_us"]["shm"]["1024"]["median"] / 1000, 3)
    assert_keys_documented(out, bench.exchange)
