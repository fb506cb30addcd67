"""The hybrid decode (gpu_worker/hybrid.py): steps whose dense part runs on the GPU
engine (the host emulation here, a CUDA device with `-m gpu`) and whose routed experts
come from elsewhere. With the routed experts computed in fp32 by the numpy reference,
the arithmetic is the GPU prefill's, so the logits must be the reference's own."""
from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

from gpu_worker.hybrid import KV_ROUND, HybridEngine, HybridWithFallback
from shared.engine import ReferenceEngine
from shared.errors import FermoeError
from shared.reference import swiglu
from tests.gpu_worker.test_engine import PROMPT, close, device_kind, gpu  # noqa: F401 (a fixture)
from tests.support.bench_keys import assert_keys_documented
from tests.support.serving_harness import fermoe


class ReferenceRouted:
    """The routed experts' weighted sum in fp32 from the reference's own swiglu; counts calls."""

    def __init__(self, model):
        self.model, self.calls, self.asked = model, [], []

    def __call__(self, layer, x, ids, weights):
        self.calls.append((layer, x.shape[0]))
        self.asked.append((layer, ids.copy(), weights.copy()))
        lw = self.model.layers[layer]
        out = np.zeros_like(x)
        for t in range(x.shape[0]):
            for e, w in zip(ids[t], weights[t]):
                out[t] += w * swiglu(x[t:t + 1], lw.ffn_gate_exps, lw.ffn_up_exps, lw.ffn_down_exps, expert=int(e))[0]
        return out


def streaming(model, kind):
    """A GPU engine that keeps no expert layer in VRAM: every layer's experts go to `routed`."""
    return gpu(model, kind, resident=False)


def reference_run(model, tokens):
    ref = ReferenceEngine(model)
    state = ref.new_state()
    return ref.forward(tokens, state), state


@pytest.fixture(scope="module")
def want(tiny):
    """The reference's logits and final state over the prompt and 6 decoded tokens."""
    return reference_run(tiny, PROMPT[:40] + PROMPT[60:66])


def test_decode_steps_give_the_references_logits(tiny, want, device_kind):
    """Guards the split MoE block (the router's choice down, the experts' sum up, the
    shared expert and the combine on the GPU) and the state kept on the device from step
    to step: each one-token step's logits are the reference's at that position."""
    logits, _ = want
    engine = streaming(tiny, device_kind)
    routed = ReferenceRouted(tiny)
    hybrid = HybridEngine(engine, routed)
    state = engine.new_state()
    engine.forward(PROMPT[:40], state, all_logits=False)
    for i, token in enumerate(PROMPT[60:66]):
        got = hybrid.forward([token], state, all_logits=False)
        close(got[-1], logits[40 + i])
        close(state.logits, logits[40 + i])
        assert state.position == 41 + i
    n_moe = tiny.config.n_layer
    assert routed.calls == [(L, 1) for _ in range(6) for L in range(n_moe)]
    assert hybrid.routing.hops == 6 * n_moe
    hybrid.close()


def test_release_hands_back_the_whole_state(tiny, want, device_kind):
    """Guards sync/release: the host state after release holds the recurrent state, conv
    and every KV row the steps made, as the reference's; the reference decodes on from it."""
    logits, ref_state = want
    engine = streaming(tiny, device_kind)
    hybrid = HybridEngine(engine, ReferenceRouted(tiny))
    state = engine.new_state()
    engine.forward(PROMPT[:40], state, all_logits=False)
    for token in PROMPT[60:66]:
        hybrid.forward([token], state, all_logits=False)
    hybrid.release(state)
    assert not hybrid.resident(state) and state.position == 46
    for g in range(len(tiny.config.gdn_layers)):
        close(state.ssm[g], ref_state.ssm[g], floor=1e-3)
        close(state.conv[g], ref_state.conv[g], floor=1e-3)
    for a in range(len(tiny.config.attention_layers)):    # fp16 rows: at most one rounding apart
        for got, ref in zip(state.kv.view(a), ref_state.kv.view(a)):
            assert got.shape == ref.shape == (46,) + got.shape[1:] and got.dtype == ref.dtype
            close(got, ref, rtol=2.0 ** -10, floor=1e-3)
    ref = ReferenceEngine(tiny)
    close(ref.forward([7], state), reference_run(tiny, PROMPT[:40] + PROMPT[60:66] + [7])[0][-1:])
    hybrid.close()


def test_a_batch_of_sequences_steps_together(tiny, device_kind):
    """Guards the rows of a step: two sequences at different positions decode in one pass,
    each on its own state, with the logits each gets alone."""
    engine = streaming(tiny, device_kind)
    hybrid = HybridEngine(engine, ReferenceRouted(tiny))
    a, b = engine.new_state(), engine.new_state()
    engine.forward(PROMPT[:30], a, all_logits=False)
    engine.forward(PROMPT[:11], b, all_logits=False)
    together = hybrid.decode_batch([5, 9], [a, b])
    assert together.shape == (2, tiny.config.n_vocab) and (a.position, b.position) == (31, 12)
    close(together[0], reference_run(tiny, PROMPT[:30] + [5])[0][-1])
    close(together[1], reference_run(tiny, PROMPT[:11] + [9])[0][-1])
    hybrid.close()


def test_the_kv_grows_past_its_first_rows(tiny, device_kind):
    """Guards the growth of a resident sequence's KV: a state admitted just below a
    multiple of KV_ROUND keeps its earlier rows when the device copy grows."""
    engine = streaming(tiny, device_kind)
    hybrid = HybridEngine(engine, ReferenceRouted(tiny))
    ref = ReferenceEngine(tiny)
    state, ref_state = ref.new_state(), ref.new_state()
    prompt = (PROMPT * 4)[:KV_ROUND - 1]
    ref.forward(prompt, state)
    ref.forward(prompt, ref_state)
    first = hybrid._admit(state, 1).lane.positions
    hybrid.forward([3], state)
    hybrid.forward([4], state)              # past the first KV_ROUND rows
    assert hybrid._resident[id(state)].lane.positions > first == KV_ROUND
    close(hybrid.forward([5], state)[-1], ref.forward([3, 4, 5], ref_state)[-1])
    hybrid.close()


def test_wrong_inputs_are_refused(tiny):
    engine = streaming(tiny, "emulate")
    hybrid = HybridEngine(engine, ReferenceRouted(tiny), max_batch=4)
    with pytest.raises(FermoeError, match="at most 4"):
        hybrid.forward_batch([(PROMPT[:3], engine.new_state()), (PROMPT[:2], engine.new_state())])
    with pytest.raises(FermoeError, match="images are prefilled"):
        hybrid.forward_batch([([1], engine.new_state(), object())])
    with pytest.raises(FermoeError, match="distinct sequences"):
        s = engine.new_state()
        hybrid.forward_batch([([1], s), ([2], s)])
    bad = HybridEngine(engine, lambda layer, x, ids, w: np.zeros((1, 3), np.float32))
    with pytest.raises(FermoeError, match=r"returned \(1, 3\)"):
        bad.forward([1], engine.new_state())
    hybrid.close()


class FailingRouted(ReferenceRouted):
    """Routed experts that fail at their n-th call: a CPU peer killed mid-step."""

    def __init__(self, model, fail_at):
        super().__init__(model)
        self.fail_at = fail_at

    def __call__(self, layer, x, ids, weights):
        if len(self.calls) == self.fail_at:
            raise FermoeError("the expert server is gone")
        return super().__call__(layer, x, ids, weights)


def test_a_failed_step_hands_the_sequence_to_another_engine(tiny, want, device_kind):
    """Guards abandon(): a step that fails half-way through its layers leaves the host state
    at its last level point with the tokens stepped since; run again on the reference (the
    CPU's place), the sequence goes on with the logits it would have had."""
    logits, _ = want
    engine = streaming(tiny, device_kind)
    n_layer = tiny.config.n_layer
    hybrid = HybridEngine(engine, FailingRouted(tiny, fail_at=3 * n_layer + 1))   # in the 4th step's 2nd layer
    state = engine.new_state()
    engine.forward(PROMPT[:40], state, all_logits=False)
    steps = PROMPT[60:66]
    for token in steps[:3]:
        hybrid.forward([token], state, all_logits=False)
    with pytest.raises(FermoeError, match="expert server is gone"):
        hybrid.forward([steps[3]], state, all_logits=False)
    replay = hybrid.abandon(state)
    assert replay == steps[:3] and state.position == 40 and not hybrid.resident(state)
    ref = ReferenceEngine(tiny)
    close(ref.forward(replay + steps[3:], state), logits[40:])
    hybrid.close()


def test_with_a_fallback_a_lost_peer_costs_no_token(tiny, want, device_kind):
    """Guards HybridWithFallback: the routed experts fail in the third call's second layer;
    that step and every later one run on the CPU's place (the reference here) from the last
    level point, and each position's logits are still the reference's. A prompt of a
    step's size runs as one hybrid step."""
    logits, _ = want
    engine = streaming(tiny, device_kind)
    n_layer = tiny.config.n_layer
    both = HybridWithFallback(HybridEngine(engine, FailingRouted(tiny, fail_at=2 * n_layer + 1)),
                              ReferenceEngine(tiny))
    state = both.new_state()
    close(both.forward(PROMPT[:40], state, all_logits=False)[-1], logits[39])
    for i, token in enumerate(PROMPT[60:66]):
        close(both.forward([token], state, all_logits=False)[-1], logits[40 + i])
        assert (both.failure is None) == (i < 1) and state.position == 41 + i
    assert "expert server is gone" in both.failure
    both.close()


def test_a_prompt_longer_than_a_step_is_prefilled_then_stepped(tiny, want, device_kind):
    """Guards forward()'s two paths: more tokens than a step takes go through the GPU
    prefill (experts streamed), and the state then steps in the hybrid."""
    logits, _ = want
    engine = streaming(tiny, device_kind)
    routed = ReferenceRouted(tiny)
    hybrid = HybridEngine(engine, routed, max_batch=8)
    state = hybrid.new_state()
    close(hybrid.forward(PROMPT[:40], state, all_logits=False)[-1], logits[39])
    assert routed.calls == [] and not hybrid.resident(state)
    close(hybrid.forward([PROMPT[60]], state, all_logits=False)[-1], logits[40])
    assert hybrid.resident(state) and len(routed.calls) == tiny.config.n_layer
    hybrid.close()


# ---- with the CPU engine's routed experts ------------------------------------------------------
def greedy(engine, state, logits, n):
    out = []
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = engine.forward([out[-1]], state, all_logits=False)[-1]
    return out


class KillAt:
    """An expert server's client that SIGKILLs the server before its n-th request: the CPU
    worker lost mid-generation."""

    def __init__(self, client, proc, n):
        self.client, self.proc, self.n = client, proc, n

    def submit(self, *args):
        self.n -= 1
        if self.n == 0:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=20)
        self.client.submit(*args)

    def collect(self):
        return self.client.collect()


def test_a_killed_expert_server_finishes_the_request_on_the_cpu(tiny, device_kind):
    """Guards the hybrid across processes and its fallback: with the routed experts in an
    expert server, the tokens are those of the routed experts computed in this process (the
    same W4A8 kernels); the server SIGKILLed in the 5th step's 2nd layer, that step and the
    rest run on the CPU engine from the GPU prefill's state with the tokens since replayed:
    exactly what the CPU engine decodes from there."""
    from cpu_worker.expert_server import spawn_expert_server, stop_expert_server
    from cpu_worker.native_engine import NativeEngine
    engine = streaming(tiny, device_kind)
    cpu = NativeEngine(tiny, threads=1)
    start = engine.new_state()
    first = engine.forward(PROMPT[:40], start, all_logits=False)[-1]

    inline = HybridEngine(engine, cpu.routed_experts)
    want = greedy(inline, start.copy(), first, 10)
    inline.close()

    proc, client = spawn_expert_server(tiny.path, threads=1, max_batch=8, timeout_s=20)
    try:
        n_layer = tiny.config.n_layer
        both = HybridWithFallback(HybridEngine(engine, KillAt(client, proc, 4 * n_layer + 2)), cpu)
        got = greedy(both, start.copy(), first, 10)
        assert "killed by signal 9" in both.failure
    finally:
        stop_expert_server(proc, client)
    assert got[:5] == want[:5]                  # token 0 from the prefill, 1-4 from hybrid steps
    state = start.copy()
    assert got[5:] == greedy(cpu, state, cpu.forward(got[:5], state, all_logits=False)[-1], 5)
    cpu.close()
    engine.close()


def test_generate_with_engine_hybrid(tiny_q4_path):
    """`fermoe generate --engine hybrid` (the emulated GPU and the CPU engine's experts) prints
    what --engine cpu prints on this prompt."""
    args = ("generate", tiny_q4_path, "-p", "The old GPU said", "-n", 12, "--temp", 0)
    hybrid = fermoe(*args, "--engine", "hybrid", env={"FERMOE_GPU": "emulate"}, check=False)
    assert hybrid.returncode == 0, hybrid.stderr
    assert hybrid.stdout == fermoe(*args, "--engine", "cpu", check=False).stdout and hybrid.stdout.strip()


def test_bench_hybrid_reports_every_way(tiny, tiny_q4_path):
    """`fermoe bench hybrid` on the emulated GPU: the three ways with their documented keys,
    one hand-over a layer, and the hybrid's tokens the same whichever side computes the experts."""
    run = fermoe("bench", "hybrid", tiny_q4_path, "--prompt", 24, "--tokens", 4, "-t", 1, "--no-gpu-experts",
                 env={"FERMOE_GPU": "emulate"}, check=False)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    import bench.hybrid
    assert_keys_documented(out, bench.hybrid)
    assert out["gpu_expert_layers"] == []
    assert out["hybrid_inline"]["hops_per_token"] == out["hybrid_process"]["hops_per_token"] == tiny.config.n_layer
    assert out["hybrid_inline"]["tokens_agree"] == out["hybrid_process"]["tokens_agree"]
    assert out["routed_floor_ms"] > 0 and out["speedup_hybrid_process"] > 0


@pytest.mark.parametrize("gpu_experts", [True, False])
def test_layers_whose_experts_are_in_vram_run_them_there(tiny, want, device_kind, gpu_experts):
    """Guards gpu_experts: with two expert layers resident, a step runs theirs on the GPU
    (no hand-over: routed is never asked for them) and the logits stay the reference's;
    switched off, every layer's go to routed."""
    logits, _ = want
    engine = gpu(tiny, device_kind)
    state = engine.new_state()
    engine.forward(PROMPT[:40], state, all_logits=False)
    engine.experts.set_resident([1, 3])
    routed = ReferenceRouted(tiny)
    hybrid = HybridEngine(engine, routed, gpu_experts=gpu_experts)
    close(hybrid.forward([PROMPT[60]], state, all_logits=False)[-1], logits[40])
    on_gpu = [1, 3] if gpu_experts else []
    assert hybrid.gpu_expert_layers == on_gpu
    assert [L for L, _ in routed.calls] == [L for L in range(tiny.config.n_layer) if L not in on_gpu]
    hybrid.close()


def test_hot_experts_of_streamed_layers_run_on_the_gpu(tiny, want, device_kind):
    """Guards HotExperts: after a window of two tokens each streamed layer's two most routed
    experts are copied to VRAM; the choices of them are computed on the GPU (the CPU's side
    gets them with weight 0, the rest as they were) and every step's logits stay the
    reference's."""
    logits, _ = want
    engine = streaming(tiny, device_kind)
    state = engine.new_state()
    engine.forward(PROMPT[:40], state, all_logits=False)
    routed = ReferenceRouted(tiny)
    hybrid = HybridEngine(engine, routed, hot_experts=2, hot_window=2)
    hot = hybrid.routing.hot
    for i, token in enumerate(PROMPT[60:66]):
        close(hybrid.forward([token], state, all_logits=False)[-1], logits[40 + i])
    assert hot.refreshes == 3 and set(hot.mask) == set(range(tiny.config.n_layer))
    assert all(m.sum() == 2 for m in hot.mask.values())
    # a router's weight is never 0 (a softmax): the CPU's zeros are the GPU's choices, all after the first window
    assert sum(int((w == 0).sum()) for _, _, w in routed.asked) == hybrid.routing.on_gpu_choices > 0
    assert not any((w == 0).any() for _, _, w in routed.asked[:2 * tiny.config.n_layer])
    hybrid.close()
    assert engine.outside_plan == 0                # the hot buffers and the lane given back
