"""The model's context length (GGUF `{arch}.context_length`, llama.cpp's n_ctx_train):
no engine runs a sequence past it, a generation that reaches it ends with
finish_reason "length", and a prompt longer than it is refused up front, locally
and by the coordinator."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from cpu_worker.native_engine import NativeEngine
from cpu_worker.worker import CPUWorker
from shared import protocol as P
from shared.engine import ReferenceEngine
from shared.errors import ContextLengthError, GGUFError
from shared.generate import generate
from shared.model import Model
from shared.sampling import SamplingParams
from tests.support.gguf_edit import DROP, rewrite_gguf
from tests.support.serving_harness import fermoe

N_CTX = 40
KEY = "qwen35moe.context_length"


@pytest.fixture(scope="module")
def short_path(tiny_q4_path, tmp_path_factory):
    """The tiny model, its context cut to N_CTX positions."""
    path = tmp_path_factory.mktemp("ctx") / "tiny-ctx40.gguf"
    rewrite_gguf(tiny_q4_path, path, meta={KEY: N_CTX})
    return path


@pytest.fixture(scope="module")
def short(short_path):
    return Model(str(short_path))


def test_the_context_length_comes_from_the_gguf(short, tiny_q4_path, tmp_path):
    assert short.config.n_ctx_train == N_CTX
    assert Model(str(tiny_q4_path)).config.n_ctx_train == 262144       # what synth writes, as Qwen3.6's
    rewrite_gguf(tiny_q4_path, tmp_path / "no-ctx.gguf", meta={KEY: DROP})
    with pytest.raises(GGUFError, match=f"missing metadata key {KEY}"):
        Model(str(tmp_path / "no-ctx.gguf"))


@pytest.mark.parametrize("engine", ["reference", "cpu"])
def test_no_engine_runs_past_the_context(short, engine):
    eng = ReferenceEngine(short) if engine == "reference" else NativeEngine(short, threads=1)
    state = eng.new_state()
    with pytest.raises(ContextLengthError, match=f"41 positions .* context length of {N_CTX}"):
        eng.forward(list(range(N_CTX + 1)), state)
    assert state.position == 0                                        # refused before any work
    eng.forward(list(range(N_CTX - 1)), state)
    eng.forward([5], state)                                           # the last position fits
    with pytest.raises(ContextLengthError):
        eng.forward([5], state)
    assert state.position == N_CTX
    if engine == "cpu":
        other = eng.new_state()
        with pytest.raises(ContextLengthError):                       # one bad segment: no pass at all
            eng.decode_batch([1, 2], [other, state])
        assert other.position == 0


def test_a_generation_ends_when_the_context_is_full(short):
    eng = NativeEngine(short, threads=1)
    prompt = list(range(3, 33))
    state = eng.new_state()
    tokens = list(generate(eng, prompt, 1000, SamplingParams(temperature=0.0), state=state))
    # every position is used; the last token is sampled from the last logits, never run
    assert len(tokens) == N_CTX - len(prompt) + 1 and state.position == N_CTX
    full = NativeEngine(short, threads=1).forward(prompt + tokens[:-1], eng.new_state())
    assert tokens == [int(np.argmax(r)) for r in full[len(prompt) - 1:]]


def test_no_max_tokens_means_until_the_context_is_full_on_every_path(short_path, short):
    """One default everywhere: `-n` left out (llama.cpp's -1) and max_tokens left out over
    ZeroMQ both generate until the end of generation or of the context."""
    from coordinator.client import Client
    from tests.support.serving_harness import Daemon
    prompt = "The old GPU said"
    n = short.tokenizer.encode(prompt)
    local = fermoe("generate", short_path, "-p", prompt, "--ignore-eos", "--seed", 3).stdout
    assert local == fermoe("generate", short_path, "-p", prompt, "--ignore-eos", "--seed", 3, "-n", -1).stdout
    ids = short.tokenizer.encode(prompt + local.rstrip("\n"))
    assert len(ids) >= N_CTX - 2                              # (a re-encoding may merge a token or two)
    out = fermoe("generate", short_path, "-p", prompt, "-n", -2, check=False)
    assert out.returncode == 1 and "-n -2: must be >= 0, or -1 for no limit" in out.stderr
    d = Daemon(short_path)
    try:
        with Client(d.addr, timeout_s=120) as c:
            done = list(c.generate(prompt, ignore_eos=True, seed=1))[-1]
        assert done.finish_reason == "length" and done.completion_tokens == N_CTX - len(n) + 1
    finally:
        assert d.stop() == 0


def test_the_cli_refuses_a_prompt_longer_than_the_context(short_path):
    ids = ",".join(str(i) for i in range(3, 3 + N_CTX + 1))
    out = fermoe("logits", short_path, "--tokens", ids, "--out", "/dev/null", check=False)
    assert out.returncode != 0 and f"context length of {N_CTX}" in out.stderr and "Traceback" not in out.stderr
    out = fermoe("bench", "decode", short_path, "--prompt", 8, "--tokens", 4, "--context", 36, check=False)
    assert out.returncode != 0 and f"context length of {N_CTX}" in out.stderr and "Traceback" not in out.stderr


def test_a_served_generation_stops_at_the_context(short_path, short):
    w = CPUWorker(str(short_path), "tcp://127.0.0.1:9", "ctx-worker", threads=1)   # never answered
    try:
        w.sent = []
        w.link.send = lambda msg, *frames, **how: w.sent.append(msg)
        prompt = short.tokenizer.encode("The old GPU said")
        w.handle_assign(P.Assign(request_id="a", tokens=prompt, resume=[], snapshots=[], max_tokens=1000,
                                 sampling=SamplingParams(temperature=0.8, seed=3), ignore_eos=True))
        while w.sequences:
            w.work_round()
        sampled = [m.token for m in w.sent if isinstance(m, P.Sampled)]
        finished = [m for m in w.sent if isinstance(m, P.Finished)]
        assert finished[0].finish_reason == "length" and not finished[0].error
        assert len(sampled) == N_CTX - len(prompt) + 1
        assert sampled == list(generate(w.engine, prompt, 1000, SamplingParams(temperature=0.8, seed=3)))
    finally:
        w.close()


# ---------------------------------------------------------------- the coordinator's max_model_len

def test_the_fitted_max_model_len_fits_and_is_the_longest_that_does():
    from coordinator.memory import RESERVE_BYTES, fitted_max_model_len
    from shared.state import DEFAULT_BLOCK as BLOCK, kv_bytes_per_position, recurrent_nbytes
    from modeltools.synth import preset_config
    cfg = preset_config("qwen3.6-35b-a3b", experts=128)
    weights, sequences = 10_440_000_000, 8

    def used(n, dtype):
        return weights + max(RESERVE_BYTES, int(memory * 0.05)) + sequences * (
            recurrent_nbytes(cfg) + n * kv_bytes_per_position(cfg, dtype))
    for memory, dtype in [(24 << 30, "f16"), (24 << 30, "f32"), (16 << 30, "f16")]:
        n = fitted_max_model_len(cfg, dtype, weights, sequences, memory)
        assert 0 < n < cfg.n_ctx_train and n % BLOCK == 0
        assert used(n, dtype) <= memory < used(n + BLOCK, dtype)
    assert fitted_max_model_len(cfg, "f16", weights, sequences, 128 << 30) == cfg.n_ctx_train
    assert fitted_max_model_len(cfg, "f16", weights, sequences, 12 << 30) == 0


def test_the_fitted_limit_is_logged_and_a_larger_one_taken_with_a_warning(monkeypatch, caplog):
    """At start the coordinator logs the limit it fitted to the host; a --max-model-len
    above it is taken as given, with a warning naming what would fit."""
    import logging
    from coordinator.memory import fitted_max_model_len, resolve_max_model_len
    from modeltools.synth import preset_config
    cfg = preset_config("qwen3.6-35b-a3b", experts=128)
    weights, sequences, memory = 10_480_000_000, 8, 24 << 30
    monkeypatch.setenv("FERMOE_HOST_MEMORY", str(memory))
    caplog.set_level(logging.INFO, logger="fermoe.coordinator")
    fitted = fitted_max_model_len(cfg, "f16", weights, sequences, memory)
    assert resolve_max_model_len(None, cfg, "f16", weights, sequences) == fitted
    assert f"max_model_len {fitted} positions" in caplog.records[-1].getMessage()
    asked = fitted + 1000
    assert resolve_max_model_len(asked, cfg, "f16", weights, sequences) == asked
    warning = caplog.records[-1]
    assert warning.levelname == "WARNING" and f"--max-model-len {asked}" in warning.getMessage()
    assert f"about {fitted} would" in warning.getMessage()


def test_a_coordinator_caps_its_sequences_at_max_model_len(tiny_q4_path):
    from coordinator.client import Client
    from tests.support.serving_harness import Daemon
    d = Daemon(tiny_q4_path, "--max-model-len", "24")
    try:
        with Client(d.addr, timeout_s=120) as c:
            with pytest.raises(Exception, match="the prompt is 25 tokens, longer than --max-model-len 24"):
                list(c.generate(tokens=list(range(3, 28))))
            done = list(c.generate(tokens=list(range(3, 13)), max_tokens=100, ignore_eos=True, seed=1))[-1]
        assert done.finish_reason == "length" and done.completion_tokens == 24 - 10 + 1 and not done.error
    finally:
        assert d.stop() == 0


def test_a_max_model_len_above_the_context_length_is_served_with_a_warning(short_path, short):
    """llama.cpp's -c above n_ctx_train: taken, with one warning that the model was trained on
    fewer positions; a prompt longer than the file's context length is then served (the
    workers learn the length from the Welcome)."""
    from coordinator.client import Client
    from tests.support.serving_harness import Daemon
    d = Daemon(short_path, "--max-model-len", "64")
    try:
        prompt = list(range(3, 3 + N_CTX + 10))                     # 50 tokens: past the file's 40
        with Client(d.addr, timeout_s=120) as c:
            assert c.status().n_ctx == 64
            done = list(c.generate(tokens=prompt, max_tokens=100, ignore_eos=True, seed=1))[-1]
        assert done.finish_reason == "length" and not done.error and done.completion_tokens == 64 - 50 + 1
    finally:
        assert d.stop() == 0
    warned = [l for l in d.log if "--max-model-len 64: the model was trained on 40 positions" in l]
    assert len(warned) == 1 and "WARNING" in warned[0] and "unreliable" in warned[0], "".join(d.log)


@pytest.mark.parametrize("args, memory, problem", [
    (["--max-model-len", "0"], None, "--max-model-len 0: must be >= 1"),
    ([], str(1 << 20), "state does not fit in this host's 0.0 GiB beside the weights: lower --max-sequences"),
])
def test_impossible_context_options_are_refused(tiny_q4_path, tmp_path, args, memory, problem):
    env = {**os.environ, "FERMOE_CACHE": str(tmp_path), **({"FERMOE_HOST_MEMORY": memory} if memory else {})}
    run = subprocess.run([sys.executable, "-m", "coordinator.daemon", "--model", str(tiny_q4_path), *args],
                         capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 1 and problem in run.stderr and "Traceback" not in run.stderr
