"""A MoE layer's routed experts alone (NativeEngine.routed_experts: what a hybrid decode
step asks the CPU for) against the numpy reference and the engine's own MoE block, and
the expert server that answers them from another process (shared/expert_exchange.py,
cpu_worker/expert_server.py)."""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

import numpy as np
import pytest

from modeltools import synth as synth_module
from shared import reference as R
from shared.errors import FermoeError
from shared.exchange import Exchange
from shared.expert_exchange import ERROR, HEADER, REQUEST, STOP, header, serve_experts
from shared.model import Model
from tests.support.native_tolerance import rel_error

native_engine = pytest.importorskip("cpu_worker.native_engine")
pytest.importorskip("native", reason="native extension not built", exc_type=ImportError)
from cpu_worker.expert_server import spawn_expert_server, stop_expert_server  # noqa: E402

# The kernels' W4A8 block sums are exact against the reference with its activations rounded
# through Q8_0 alike; what is left is float sums in other orders: measured at most 2.4e-7
# (Q8_0) and 2.2e-7 (Q4_0) of the largest |output|, over 20 draws of inputs, every layer and
# ISA here. The bound is twice that.
RTOL = 5e-7
MAX_BATCH = 8


def _inputs(model: Model, layer: int, T: int, seed: int):
    """A normalised MoE input [T, D], k distinct experts a token and weights summing to 1."""
    cfg, rng = model.config, np.random.default_rng(seed)
    h = rng.standard_normal((T, cfg.n_embd)).astype(np.float32)
    x = R.rms_norm(h, model.layers[layer].post_attention_norm.f32(), cfg.rms_eps)
    ids = np.array([rng.choice(cfg.n_expert, cfg.n_expert_used, replace=False) for _ in range(T)], np.int32)
    weights = rng.random((T, cfg.n_expert_used)).astype(np.float32)
    return x, ids, weights / weights.sum(axis=1, keepdims=True)


def _reference_routed(model: Model, layer: int, x, ids, weights) -> np.ndarray:
    lay, want = model.layers[layer], np.zeros_like(x)
    token = R.ACTIVATIONS_Q8.set(True)
    try:
        for t in range(len(x)):
            for e, w in zip(ids[t], weights[t]):
                want[t] += w * R.swiglu(x[t:t + 1], lay.ffn_gate_exps, lay.ffn_up_exps, lay.ffn_down_exps, expert=e)[0]
    finally:
        R.ACTIVATIONS_Q8.reset(token)
    return want


@pytest.fixture(scope="module")
def engines(tiny_path, tiny_q4_path):
    made = {t: native_engine.NativeEngine(Model(p), threads=2, max_batch=MAX_BATCH)
            for t, p in (("q8_0", tiny_path), ("q4_0", tiny_q4_path))}
    yield made
    for e in made.values():
        e.close()


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("out_type", ["q8_0", "q4_0"])
def test_routed_experts_match_the_reference(engines, out_type, T):
    """Guards the routed part's arithmetic (the grouping by expert, the gathered inputs,
    gate|up, down, the weighted sum): every layer, one token and five sharing experts."""
    engine = engines[out_type]
    for layer in range(engine.model.config.n_layer):
        x, ids, weights = _inputs(engine.model, layer, T, seed=layer)
        want = _reference_routed(engine.model, layer, x, ids, weights)
        got = engine.routed_experts(layer, x, ids, weights)
        assert got.shape == want.shape and rel_error(got, want) <= RTOL, (layer, rel_error(got, want))


def test_choices_of_weight_zero_are_not_computed(engines):
    """Guards the skip a hybrid step relies on (the choices the GPU computes reach the CPU
    with weight 0): they add nothing and no expert runs for them alone."""
    engine = engines["q4_0"]
    x, ids, weights = _inputs(engine.model, 0, 3, seed=7)
    weights[:, 1:] = 0.0                        # every token's first choice only
    engine.experts_per_moe_block(reset=True)
    got = engine.routed_experts(0, x, ids, weights)
    assert engine.experts_per_moe_block(reset=True) == len(set(ids[:, 0].tolist()))
    assert rel_error(got, _reference_routed(engine.model, 0, x, ids[:, :1], weights[:, :1])) <= RTOL


@pytest.fixture(scope="module")
def no_shared_engine(tmp_path_factory):
    """The tiny preset without a shared expert, in Q4_0: its MoE block is its routed part."""
    path = tmp_path_factory.mktemp("routed") / "tiny-noshexp-q4_0.gguf"
    with pytest.MonkeyPatch.context() as mp:
        preset = dataclasses.replace(synth_module.PRESETS["tiny"], n_ff_shexp=0)
        mp.setitem(synth_module.PRESETS, "tiny-noshexp", preset)
        synth_module.synth(path, "tiny-noshexp", out_type="q4_0", progress=False)
    engine = native_engine.NativeEngine(Model(path), threads=2, max_batch=MAX_BATCH)
    yield engine
    engine.close()


def test_routed_experts_are_the_moe_blocks_own_routed_part(no_shared_engine):
    """Guards the one routed code path: with the block's own routing, routed_experts gives
    bit for bit what the forward's MoE block adds (no shared expert to add to it here), so
    a hybrid step's routed sum is the CPU-only decode's."""
    engine = no_shared_engine
    assert engine.model.config.n_ff_shexp == 0
    for layer in range(engine.model.config.n_layer):
        for T in (1, 5, MAX_BATCH):
            x = _inputs(engine.model, layer, T, seed=10 + T)[0]
            block, ids, weights = engine.moe_block(layer, x)
            assert np.abs(block).max() > 0
            np.testing.assert_array_equal(engine.routed_experts(layer, x, ids, weights), block)


def test_routed_plus_the_shared_expert_is_the_moe_block(engines):
    """Guards what the GPU side adds back: the block less its routed part is the shared
    expert, sigmoid(x . w) * swiglu(x), as the reference computes it."""
    engine = engines["q4_0"]
    model = engine.model
    for layer in range(model.config.n_layer):
        x = _inputs(model, layer, 5, seed=20 + layer)[0]
        block, ids, weights = engine.moe_block(layer, x)
        lay, token = model.layers[layer], R.ACTIVATIONS_Q8.set(True)
        try:
            shared = R.sigmoid(x @ lay.ffn_gate_inp_shexp.f32())[:, None] * \
                R.swiglu(x, lay.ffn_gate_shexp, lay.ffn_up_shexp, lay.ffn_down_shexp)
        finally:
            R.ACTIVATIONS_Q8.reset(token)
        got = engine.routed_experts(layer, x, ids, weights) + shared
        assert rel_error(got, block) <= RTOL, (layer, rel_error(got, block))


def test_routed_experts_refuse_what_they_cannot_run(engines):
    """Guards the C side against reading past its buffers: a layer, shape, T or expert id it
    has no room for is a FermoeError that says which."""
    engine = engines["q4_0"]
    x, ids, weights = _inputs(engine.model, 0, 2, seed=0)
    cases = [((4, x, ids, weights), r"layer 4: the model has layers 0\.\.3"),
             ((-1, x, ids, weights), r"layer -1: the model has layers 0\.\.3"),
             ((0, x[:, :128], ids, weights), r"shape \[2, 128\]: must be \[T, 256\], T in 1\.\.8"),
             ((0, x[:0], ids[:0], weights[:0]), r"shape \[0, 256\]"),
             ((0, np.zeros((9, 256)), np.zeros((9, 2), np.int32), np.zeros((9, 2))),
              r"T in 1\.\.8 \(the engine's max_batch"),
             ((0, x, ids[:, :1], weights), r"ids \[2, 1\] \(int32\) and weights \[2, 2\]: each must be \[2, 2\]"),
             ((0, x, ids, weights[:1]), r"weights \[1, 2\]"),
             ((0, x, ids.astype(np.float32), weights), r"the ids integers"),
             ((0, x, np.where(ids == ids[1, 1], 8, ids), weights), r"expert id 8: the model has experts 0\.\.7"),
             ((0, x, np.where(ids == ids[0, 0], -1, ids), weights), r"expert id -1"),
             ((0, x, np.where(ids == ids[0, 0], 2**40, ids.astype(np.int64)), weights), r"expert id 1099511627776")]
    for args, match in cases:
        with pytest.raises(FermoeError, match=match):
            engine.routed_experts(*args)
    with pytest.raises(FermoeError, match="has no routed experts"):
        engine._moe_layers, kept = frozenset(), engine._moe_layers
        try:
            engine.routed_experts(0, x, ids, weights)
        finally:
            engine._moe_layers = kept


# ---- across processes ------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_q4_path):
    proc, client = spawn_expert_server(tiny_q4_path, threads=1, max_batch=MAX_BATCH, timeout_s=20)
    yield proc, client
    stop_expert_server(proc, client)


def test_the_server_answers_what_the_engine_computes(server, engines):
    """Guards the message layout both ways (offsets, types, T and k): another process's answer
    is bit for bit the in-process one, for every T up to the batch."""
    _, client = server
    engine = engines["q4_0"]
    for layer, T in [(0, 1), (1, 5), (3, MAX_BATCH), (2, 3)]:
        x, ids, weights = _inputs(engine.model, layer, T, seed=30 + T)
        want = engine.routed_experts(layer, x, ids, weights)
        np.testing.assert_array_equal(client.routed(layer, x, ids, weights), want)
        out = np.full_like(want, np.nan)
        assert client.routed(layer, x, ids.astype(np.int64), weights, out=out) is out
        np.testing.assert_array_equal(out, want)


def test_a_bad_request_gets_an_error_and_the_next_is_answered(server, engines):
    """Guards the server's loop: a request it cannot run, or a message that is no request,
    is answered with the reason, and the server answers the next request as before."""
    _, client = server
    engine = engines["q4_0"]
    x, ids, weights = _inputs(engine.model, 1, 2, seed=40)
    want = engine.routed_experts(1, x, ids, weights)
    with pytest.raises(FermoeError, match=r"expert server: routed experts: expert id 9: the model has experts 0\.\.7"):
        client.routed(1, x, np.where(ids == ids[0, 0], 9, ids), weights)
    with pytest.raises(FermoeError, match=r"expert server: layer 7: the model has layers 0\.\.3"):
        client.routed(7, x, ids, weights)
    with pytest.raises(FermoeError, match=r"expert server: a request of T=2, k=2, D=128: this model takes k=2, D=256"):
        client.routed(1, x[:, :128], ids, weights)
    with pytest.raises(FermoeError, match=r"a message of 9392 bytes: the exchange holds 8352"):   # sent nothing
        client.routed(1, np.zeros((9, 256)), np.zeros((9, 2)), np.zeros((9, 2)))
    raw = client.exchange
    for message, reason in [(header(99), "a message of kind 99: expected a request"), (b"abc", "error: unpack"),
                            (header(REQUEST, 1, 9, 2, 256), r"a request of T=9, k=2, D=256: .* T in 1\.\.8"),
                            (header(REQUEST, 1, 2, 2, 256) + bytes(8),
                             r"a request of 40 bytes: \[T=2, D=256, k=2\] takes 2112")]:
        raw.send(message)
        reply = raw.receive(timeout_s=20)
        assert HEADER.unpack_from(reply)[0] == ERROR
        assert re.search(reason, bytes(reply[HEADER.size:]).decode()), bytes(reply[HEADER.size:])
    np.testing.assert_array_equal(client.routed(1, x, ids, weights), want)


def test_stop_ends_the_server_and_removes_the_exchange(tiny_q4_path):
    """Guards the clean end: a stop message ends the child's loop (status 0), the parent
    removes the mailbox, and the client refuses calls after it."""
    proc, client = spawn_expert_server(tiny_q4_path, threads=1, max_batch=2, timeout_s=20)
    path = f"/dev/shm/{client.exchange.name}"
    assert os.path.exists(path)
    assert client.routed(0, np.ones((1, 256)), [[0, 1]], [[0.5, 0.5]]).shape == (1, 256)
    assert stop_expert_server(proc, client) == 0
    assert not os.path.exists(path)
    with pytest.raises(FermoeError, match="expert server unusable: stopped"):
        client.routed(0, np.ones((1, 256)), [[0, 1]], [[0.5, 0.5]])


def test_a_killed_server_makes_the_client_raise_in_time(tiny_q4_path):
    """Guards against a hybrid step waiting for ever on a dead CPU side: a server killed by
    SIGKILL is named in the client's error well within its timeout, and a client that cannot
    see the process gives up at its timeout."""
    proc, client = spawn_expert_server(tiny_q4_path, threads=1, max_batch=2, timeout_s=20)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=20)
    t0 = time.perf_counter()
    with pytest.raises(FermoeError, match=rf"the expert server \(pid {proc.pid}\) was killed by signal 9"):
        client.routed(0, np.ones((1, 256)), [[0, 1]], [[0.5, 0.5]])
    assert time.perf_counter() - t0 < 5
    with pytest.raises(FermoeError, match="unusable: the expert server"):
        client.routed(0, np.ones((1, 256)), [[0, 1]], [[0.5, 0.5]])
    client.gone, client.broken, client.timeout_s = None, None, 0.3
    t0 = time.perf_counter()
    with pytest.raises(FermoeError, match=r"expert server: no reply in 0\.3 s"):
        client.routed(0, np.ones((1, 256)), [[0, 1]], [[0.5, 0.5]])
    assert 0.3 <= time.perf_counter() - t0 < 5
    stop_expert_server(proc, client)
    assert not os.path.exists(f"/dev/shm/{client.exchange.name}")


def test_a_server_that_cannot_start_says_why(tiny_q4_path):
    """Guards the start: a child that fails to load answers with its reason, which the
    spawn raises, leaving no process or mailbox behind."""
    shm, children = set(os.listdir("/dev/shm")), _children()
    with pytest.raises(FermoeError, match="expert server: .*fermoe_no_such_experts"):
        spawn_expert_server(tiny_q4_path, threads=1, max_batch=2, experts="fermoe_no_such_experts")
    assert not {n for n in set(os.listdir("/dev/shm")) - shm if n.startswith("fermoe_experts")}
    assert _children() <= children          # the child reaped, not left a zombie


def _children() -> set[int]:
    """This process's child processes, zombies included."""
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == os.getpid():
                    found.add(int(pid))
        except (OSError, IndexError, ValueError):
            pass
    return found


def test_serve_experts_ends_on_stop_or_when_idle(engines):
    """Guards the loop's two ends in process: a stop message, and idle_timeout seconds
    without a message."""
    with Exchange.create(4096) as server_end:
        client_end = Exchange.attach(server_end.name, 4096)
        t0 = time.perf_counter()
        assert serve_experts(server_end, engines["q4_0"], idle_timeout=0.05) == 0
        assert 0.05 <= time.perf_counter() - t0 < 5
        client_end.send(header(STOP))
        assert serve_experts(server_end, engines["q4_0"]) == 0
        client_end.close()
