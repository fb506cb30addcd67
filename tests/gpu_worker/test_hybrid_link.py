"""The hybrid decode between two workers' ends (shared/hybrid_link.py, gpu_worker/step_server.py): a CPU worker's
DensePeer and a GPU worker's StepServer over one mailbox, the server in a thread over
the emulated GPU. Their steps must give the very logits of the same hybrid run in one
process (the same kernels on the same inputs), and the state brought back by a sync the
bytes that run's release leaves."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from gpu_worker.hybrid import HybridEngine
from shared.errors import FermoeError
from shared.exchange import Exchange
from gpu_worker.step_server import StepServer
from shared.hybrid_link import DensePeer, PeerError, mailbox_bytes
from tests.gpu_worker.test_engine import PROMPT, gpu

native_engine = pytest.importorskip("cpu_worker.native_engine")


class Server:
    """A StepServer answering in a thread until stopped."""

    def __init__(self, ex, engine):
        self.server = StepServer(ex, engine, timeout_s=20)
        self.stop, self.error = threading.Event(), None
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        try:
            while not self.stop.is_set():
                self.server.poll(0.02)
        except Exception as e:          # noqa: BLE001 -- the test reads it
            self.error = e

    def close(self):
        self.stop.set()
        self.thread.join(20)
        self.server.close()


@pytest.fixture
def pair(tiny):
    cfg = tiny.config
    cpu = native_engine.NativeEngine(tiny, threads=1)
    ex = Exchange.create(mailbox_bytes(cfg), prefix="fermoe_test_hyb")
    server = Server(Exchange.attach(ex.name, mailbox_bytes(cfg)), gpu(tiny, "emulate", resident=False))
    peer = DensePeer(ex, cpu, timeout_s=20)
    yield peer, server, cpu
    server.close()
    ex.close()
    cpu.close()


class Refusing:
    """A CPU engine whose routed experts fail."""

    def __init__(self, engine):
        self.model = engine.model

    def routed_experts(self, *args):
        raise FermoeError("no experts here")


def greedy(step, logits, n):
    tokens = []
    for _ in range(n):
        tokens.append(int(np.argmax(logits)))
        logits = step(tokens[-1])
    return tokens, logits


def test_steps_across_the_mailbox_are_the_in_process_hybrids(tiny, pair):
    """Guards the link's whole protocol: the admitted state, each step's expert requests
    answered by the CPU end, the logits in chunks, and the state a sync brings back."""
    peer, server, cpu = pair
    start = cpu.new_state()
    first = cpu.forward(PROMPT[:30], start, all_logits=False)[-1]

    local = HybridEngine(gpu(tiny, "emulate", resident=False), cpu.routed_experts)
    mine = start.copy()
    want, want_last = greedy(lambda t: local.forward([t], mine, all_logits=False)[-1], first, 5)
    local.release(mine)

    theirs = start.copy()
    peer.admit(7, theirs)
    got, got_last = greedy(lambda t: peer.step([7], [t])[0], first, 5)
    assert got == want and np.array_equal(got_last, want_last)
    assert peer.hops == 5 * tiny.config.n_layer and server.server.steps == 5
    theirs.position += 5                # the CPU worker moves its own copy's position as it samples
    peer.sync(7, theirs)
    assert theirs.position == mine.position == 35
    assert np.array_equal(np.frombuffer(theirs.buffer, np.uint8), np.frombuffer(mine.buffer, np.uint8))
    for a in range(len(tiny.config.attention_layers)):
        for x, y in zip(theirs.kv.view(a), mine.kv.view(a)):
            assert np.array_equal(x, y)
    peer.release(7)
    assert server.error is None and not server.server.states


def test_a_failed_request_is_answered_and_the_link_goes_on(tiny, pair):
    """Guards FAILED: a step of a sequence never admitted, and one whose experts the CPU end
    refuses, fail with why; the next request is served."""
    peer, server, cpu = pair
    state = cpu.new_state()
    first = cpu.forward(PROMPT[:12], state, all_logits=False)[-1]
    with pytest.raises(PeerError, match=r"sequences \[3\] never admitted"):
        peer.step([3], [1])
    peer.admit(3, state)
    real, peer.engine = peer.engine, Refusing(cpu)  # the CPU end cannot compute: an error reply
    with pytest.raises(PeerError, match="CPU worker's experts: FermoeError: no experts here"):
        peer.step([3], [int(np.argmax(first))])
    peer.engine = real
    assert 3 not in server.server.states            # the half-run step voided the GPU's copy
    peer.admit(3, state)
    assert peer.step([3], [int(np.argmax(first))]).shape == (1, tiny.config.n_vocab)
    assert server.error is None and peer.broken is None


def test_a_gone_peer_is_named(tiny):
    """Guards the wait on a dead GPU worker: the CPU end names why within its slice."""
    cpu = native_engine.NativeEngine(tiny, threads=1)
    ex = Exchange.create(mailbox_bytes(tiny.config), prefix="fermoe_test_hyb")
    peer = DensePeer(ex, cpu, timeout_s=20, gone=lambda: "the GPU worker (pid 1) exited")
    with pytest.raises(PeerError, match=r"GPU worker \(pid 1\) exited"):
        peer.step([1], [1])
    with pytest.raises(FermoeError, match="unusable"):
        peer.release(1)
    ex.close()
    cpu.close()
