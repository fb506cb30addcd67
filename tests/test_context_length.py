"""The model's context length (GGUF `{arch}.context_length`, llama.cpp's n_ctx_train):
no engine runs a sequence past it, a generation that reaches it ends with
finish_reason "length", and a prompt longer than it is refused up front, locally
and by the coordinator."""
from __future__ import annotations

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
from tests.gguf_edit import DROP, rewrite_gguf

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


def test_the_cli_refuses_a_prompt_longer_than_the_context(short_path):
    ids = ",".join(str(i) for i in range(3, 3 + N_CTX + 1))
    out = subprocess.run([sys.executable, "-m", "coordinator.cli", "logits", str(short_path), "--tokens", ids,
                          "--out", "/dev/null"], capture_output=True, text=True)
    assert out.returncode != 0 and f"context length of {N_CTX}" in out.stderr and "Traceback" not in out.stderr
    out = subprocess.run([sys.executable, "-m", "coordinator.cli", "bench", "decode", str(short_path),
                          "--prompt", "8", "--tokens", "4", "--context", "36"], capture_output=True, text=True)
    assert out.returncode != 0 and f"context length of {N_CTX}" in out.stderr and "Traceback" not in out.stderr


def test_a_served_generation_stops_at_the_context(short_path, short):
    w = CPUWorker(str(short_path), "tcp://127.0.0.1:9", "ctx-worker", threads=1)   # never answered
    try:
        w.sent = []
        w.send = w.sent.append
        prompt = short.tokenizer.encode("The old GPU said")
        w.handle_assign(P.Assign(request_id="a", tokens=prompt, resume=[], snapshots=[], max_tokens=1000,
                                 temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                                 seed=3, ignore_eos=True))
        while w.sequences:
            w.work_round()
        sampled = [m.token for m in w.sent if isinstance(m, P.Sampled)]
        finished = [m for m in w.sent if isinstance(m, P.Finished)]
        assert finished[0].finish_reason == "length" and not finished[0].error
        assert len(sampled) == N_CTX - len(prompt) + 1
        assert sampled == list(generate(w.engine, prompt, 1000, SamplingParams(temperature=0.8, seed=3)))
    finally:
        w.close()
