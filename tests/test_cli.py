"""The `fermoe` command as a user runs it: real processes, real files."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.model import Model
from shared.synth import _tensor_list, preset_config
from shared.convert import tensor_type, OUT_TYPES
from tests.eos_seed import seed_with_early_eos
from shared.ggml_types import tensor_nbytes


def fermoe(*args, env=None, check=True):
    run = subprocess.run([sys.executable, "-m", "coordinator.cli", *map(str, args)],
                         capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)
    if check and run.returncode != 0:
        raise AssertionError(f"fermoe {args} failed:\n{run.stderr}")
    return run


def test_logits_from_tokens_and_prompt(tiny_path, tmp_path):
    out = tmp_path / "logits.npy"
    fermoe("logits", tiny_path, "--engine", "reference", "--tokens", "1,2,3,400", "--out", out)
    logits = np.load(out)
    engine = ReferenceEngine(Model(tiny_path))
    # same computation in another process: equal up to BLAS summation order
    np.testing.assert_allclose(logits, engine.forward([1, 2, 3, 400], engine.new_state()), rtol=0, atol=1e-5)
    fermoe("logits", tiny_path, "--prompt", "Hello there", "--out", out)
    ids = Model(tiny_path).tokenizer.encode("Hello there")
    assert np.load(out).shape == (len(ids), 512)


def test_generate_is_seeded_and_greedy_is_stable(tiny_path):
    a = fermoe("generate", tiny_path, "-p", "Once upon a time", "-n", 12, "--seed", 7).stdout
    b = fermoe("generate", tiny_path, "-p", "Once upon a time", "-n", 12, "--seed", 7).stdout
    assert a == b and a.strip()
    g = fermoe("generate", tiny_path, "-p", "Once upon a time", "-n", 12, "--temp", 0).stdout
    assert g == fermoe("generate", tiny_path, "-p", "Once upon a time", "-n", 12, "--temp", 0, "--seed", 1).stdout
    # --seed -1 is llama.cpp's "a random seed"
    randoms = {fermoe("generate", tiny_path, "-p", "Once upon a time", "-n", 12, "--seed", -1).stdout for _ in range(3)}
    assert len(randoms) > 1


def test_ignore_eos_keeps_generating(tiny_q4_path):
    seed = seed_with_early_eos(tiny_q4_path, "Tell me everything", 48, 0.8)
    args = ("generate", tiny_q4_path, "--engine", "cpu", "-t", 1, "-p", "Tell me everything", "-n", 48,
            "--seed", seed, "--temp", 0.8)
    obeyed, ignored = fermoe(*args).stdout[:-1], fermoe(*args, "--ignore-eos").stdout[:-1]
    assert len(obeyed) < len(ignored) and ignored.startswith(obeyed)


def test_builtin_model_made_on_first_use(tmp_path):
    run = fermoe("generate", "-p", "hi", "-n", 3, "--chat", env={"FERMOE_CACHE": str(tmp_path)})
    assert list(tmp_path.glob("tiny-*.gguf")), run.stderr


def test_bench_decode_takes_a_builtin_model(tmp_path):
    import json
    run = fermoe("bench", "decode", "tiny", "-t", 1, "--prompt", 4, "--tokens", 2, env={"FERMOE_CACHE": str(tmp_path)})
    out = json.loads(run.stdout)
    assert out["model"] == "tiny" and out["decode_tok_s"] > 0 and list(tmp_path.glob("tiny-*.gguf"))


def test_synth_command_writes_a_loadable_model(tmp_path):
    out = tmp_path / "s.gguf"
    fermoe("synth", out, "--preset", "tiny", "--experts", 4, "--layers", 2, "--type", "f32", "--seed", 3)
    cfg = Model(out).config
    assert (cfg.n_expert, cfg.n_layer) == (4, 2)


@pytest.mark.parametrize("experts, paper_gb", [(128, 10.44), (256, 19.50)])
def test_full_size_preset_has_the_papers_size(experts, paper_gb):
    """Planned bytes of the real-dimension synthetic model (not written: 10+ GB).
    The paper's figure is all-Q4_0; we keep routers in F32 as llama.cpp does (+0.4-0.8%)."""
    cfg = preset_config("qwen3.6-35b-a3b", experts=experts)
    total = sum(tensor_nbytes(tensor_type(n, s, OUT_TYPES["q4_0"]), s) for n, s in _tensor_list(cfg))
    assert paper_gb * 1e9 <= total <= paper_gb * 1e9 * 1.01


@pytest.mark.parametrize("args, message", [
    (["logits", "{missing}", "--tokens", "1", "--out", "x.npy"], "cannot open"),
    (["logits", "{corrupt}", "--tokens", "1", "--out", "x.npy"], "not a GGUF"),
    (["logits", "{tiny}", "--tokens", "1,x", "--out", "x.npy"], "comma-separated integers"),
    (["logits", "{tiny}", "--tokens", "99999", "--out", "x.npy"], "token ids must be in"),
    (["generate", "{tiny}", "-p", "hi", "--top-p", "0"], "top_p must be in"),
    (["generate", "{tiny}", "-p", "hi", "--engine", "warp"], "--engine 'warp'"),
    (["generate", "{tiny}", "-p", "hi", "--kv-cache-dtype", "f8"], "KV cache dtype 'f8'"),
    (["generate", "{tiny}", "-p", "hi", "--threads", str(os.cpu_count() + 1)], "CPUs of this machine"),
    (["synth", "{out}", "--experts", "1"], "--experts 1"),
    (["generate", "{tiny}", "-p", ""], "the prompt has no tokens"),
    (["generate", "{tiny}", "-p", "hi", "--seed", "-2"], "seed must be in [0, 2**64), got -2"),
    (["logits", "{tiny}", "--tokens", "1", "--out", "{missing}/x.npy"], "missing.gguf/x.npy: No such file or directory"),
    (["synth", "{missing}/x.gguf"], "missing.gguf/x.gguf: No such file or directory"),
    (["submit", "-p", "hi", "--addr", "garbage"], "cannot connect to 'garbage'"),
    (["submit", "-p", "hi", "--addr", "tcp://127.0.0.1:{port}"], "no answer from the coordinator"),
])
def test_errors_are_one_line_not_tracebacks(tiny_path, tmp_path, args, message):
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(os.urandom(4096))
    with socket.socket() as s:          # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    paths = dict(missing=tmp_path / "missing.gguf", corrupt=corrupt, tiny=tiny_path, out=tmp_path / "o.gguf",
                 port=port)
    run = fermoe(*[a.format(**paths) for a in args], check=False)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("fermoe: error:") and message in run.stderr, run.stderr


@pytest.mark.parametrize("args, message", [
    (["bench", "kernels", "--threads", "0"], "--threads 0: must be in [1,"),
    (["bench", "kernels", "--cols", "33"], "--cols 33: must be a positive multiple of 32"),
    (["bench", "decode", "{tiny}", "--context", "999999"], "past the model's context length of 262144"),
    (["bench", "serve", "{tiny}", "--prompt", "0"], "--prompt and --tokens must be at least 1"),
    (["bench", "serve", "{missing}"], "exited before it was ready: coordinator: error: {missing}: cannot open"),
])
def test_bench_options_are_refused_in_one_line(tiny_path, tmp_path, args, message):
    paths = dict(tiny=tiny_path, missing=tmp_path / "missing.gguf")
    run = fermoe(*[a.format(**paths) for a in args], check=False)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert message.format(**paths) in run.stderr, run.stderr


def test_cpu_engine_from_the_command_line(tiny_q4_path, tmp_path):
    from cpu_worker.native_engine import NativeEngine
    out = tmp_path / "cpu.npy"
    fermoe("logits", tiny_q4_path, "--engine", "cpu", "--threads", 2, "--tokens", "5,6,7,8", "--out", out)
    engine = NativeEngine(Model(tiny_q4_path), threads=2)
    np.testing.assert_allclose(np.load(out), engine.forward([5, 6, 7, 8], engine.new_state()), rtol=0, atol=1e-5)
    text = fermoe("generate", tiny_q4_path, "--engine", "cpu", "-p", "Hello", "-n", 8, "--temp", 0).stdout
    assert text == fermoe("generate", tiny_q4_path, "--engine", "cpu", "-t", 1, "-p", "Hello", "-n", 8,
                          "--temp", 0).stdout
