"""The `fermoe` command as a user runs it: real processes, real files."""
from __future__ import annotations

import json
import msgspec
import os
import re
import socket

import numpy as np
import pytest

from shared.engine import ReferenceEngine
from shared.model import Model
from modeltools.synth import _tensor_list, preset_config
from modeltools.convert import tensor_type, OUT_TYPES
from tests.support.bench_keys import assert_keys_documented
from tests.support.eos_seed import seed_with_early_eos
from tests.support.sampling_cases import option_cases
from tests.support.serving_harness import fermoe, free_port, local_ids, local_text
from shared.ggml_types import tensor_nbytes


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


def test_the_default_model_is_the_packaged_tiny():
    from shared.builtin import BUILTIN
    greedy = ("-p", "Return the", "-n", 8, "--temp", 0)
    default = fermoe("generate", *greedy).stdout
    assert default.strip() and default == fermoe("generate", BUILTIN["tiny"], *greedy).stdout


def test_bench_decode_takes_a_builtin_model():
    """--max-model-len lets a timing run past the built-in model's 4096 positions (refused
    without it, below), as the daemon's does."""
    import bench.decode
    run = fermoe("bench", "decode", "tiny", "-t", 1, "--prompt", "4,6", "--tokens", 2, "--context", 4094,
                 "--max-model-len", 4200)
    out = json.loads(run.stdout)            # one object a prompt length, in the order given
    assert [o["prompt_tokens"] for o in out] == [4, 6] and out[0]["model"] == "tiny" and out[1]["decode_tok_s"] > 0
    assert out[0]["context"] == 4094
    assert_keys_documented(out[0], bench.decode)


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
    paths = dict(missing=tmp_path / "missing.gguf", corrupt=corrupt, tiny=tiny_path, out=tmp_path / "o.gguf",
                 port=free_port())                    # a port nothing listens on
    run = fermoe(*[a.format(**paths) for a in args], check=False)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr
    assert run.stderr.startswith("fermoe: error:") and message in run.stderr, run.stderr


@pytest.mark.parametrize("args, message", [
    (["bench", "kernels", "--threads", "0"], "--threads 0: must be in [1,"),
    (["bench", "kernels", "--cols", "33"], "--cols 33: must be a positive multiple of 32"),
    (["bench", "decode", "{tiny}", "--context", "999999"], "past the model's context length of 262144"),
    (["bench", "decode", "{tiny}", "--context", "999", "--max-model-len", "500"], "past --max-model-len 500"),
    (["bench", "decode", "{tiny}", "--max-model-len", "0"], "--max-model-len 0: must be at least 1"),
    (["bench", "serve", "{tiny}", "--prompt", "0"], "--prompt and --tokens must be at least 1"),
    (["bench", "serve", "{missing}"], "exited before it was ready: coordinator: error: {missing}: cannot open"),
    (["bench", "tools", "-t", "0"], "argument -t/--threads: 0: must be at least 1"),
    (["bench", "vision", "--threads", "two"], "argument -t/--threads: 'two': expected a whole number"),
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


# ---- the options as they should act, against the library run in this process -----------

def _cli(capsys, *args) -> str:
    """A `fermoe` command in this process (argparse to output): its stdout."""
    from fermoe.cli import main
    assert main([str(a) for a in args]) == 0
    return capsys.readouterr().out


def test_generate_chat_wraps_the_prompt_in_the_chat_template(tiny_q4_path, capsys):
    templated = Model(tiny_q4_path).tokenizer.apply_chat_template([{"role": "user", "content": "Hello"}])
    expected = local_text(tiny_q4_path, templated, 12, eos=True, temperature=0.8, seed=3)
    assert expected != local_text(tiny_q4_path, "Hello", 12, eos=True, temperature=0.8, seed=3)   # it tells apart
    out = _cli(capsys, "generate", tiny_q4_path, "-t", 1, "-p", "Hello", "-n", 12, "--seed", 3, "--chat")
    assert out == expected + "\n"


def test_generate_sampling_options_act_as_the_sampler_does(tiny_q4_path, capsys):
    """--temp, --top-k, --top-p, --min-p, --repeat-penalty and --seed, each at a value
    where it changes what is sampled: what shared.generate samples with it."""
    prompt, n = "Sampling options", 16
    decode = Model(tiny_q4_path).tokenizer.decode
    cases = option_cases(lambda params: local_ids(tiny_q4_path, prompt, n, **msgspec.structs.asdict(params)))
    for option, (args, ids) in cases.items():
        out = _cli(capsys, "generate", tiny_q4_path, "-t", 1, "-p", prompt, "-n", n, "--ignore-eos", *args)
        assert out == decode(ids) + "\n", option


def test_generate_runs_until_end_of_generation_unless_told(tiny_q4_path, capsys):
    seed = seed_with_early_eos(tiny_q4_path, "How many", 48, 0.8)
    out = _cli(capsys, "generate", tiny_q4_path, "-t", 1, "-p", "How many", "--seed", seed)
    assert out == local_text(tiny_q4_path, "How many", 48, eos=True, temperature=0.8, seed=seed) + "\n"


@pytest.mark.parametrize("given, read", [
    (r"a\nb", "a\nb"), (r"\t\r\'\"\?\a\b\f\v", "\t\r'\"?\a\b\f\v"), (r"\\n", "\\n"), (r"\x41\x7e", "A~"),
    (r"\xc3\xa9t\xc3\xa9", "été"), (r"\q \x4 \xg1 end\\", r"\q \x4 \xg1 end\\"[:-1]), ("tail\\", "tail\\"),
])
def test_escapes_are_read_as_llama_cpp_reads_them(given, read):
    from fermoe.escapes import process_escapes
    assert process_escapes(given) == read


def test_prompt_and_stop_escapes_on_the_command_line(tiny_q4_path, capsys):
    """-p "a\\nb" is a newline, as in llama.cpp; --no-escape takes it as given. \\x bytes
    that are no UTF-8 are one line of error."""
    def gen(*args):
        return _cli(capsys, "generate", tiny_q4_path, "-t", 1, "-n", 8, "--seed", 2, "--ignore-eos", *args)
    newline = local_text(tiny_q4_path, "Line one\nLine two", 8, temperature=0.8, seed=2)
    literal = local_text(tiny_q4_path, "Line one\\nLine two", 8, temperature=0.8, seed=2)
    assert newline != literal
    assert gen("-p", r"Line one\nLine two") == newline + "\n"
    assert gen("-p", r"Line one\nLine two", "--no-escape") == literal + "\n"
    run = fermoe("generate", tiny_q4_path, "-p", r"bad \xff byte", check=False)
    assert run.returncode == 1 and run.stderr.count("\n") == 1
    assert run.stderr.startswith(r"fermoe: error: -p 'bad \\xff byte': its \x escapes give bytes that are not UTF-8")


def test_help_says_what_fermoe_is_and_lists_every_command():
    from fermoe.cli import COMMANDS, build_parser
    text = fermoe("--help").stdout
    assert text.count("fermoe runs Qwen3.5/3.6-35B-A3B-class mixture-of-experts models") == 1
    assert "examples:" in text and "fermoe demo" in text and "--stop \"\\n\\n\"" in text
    listed = re.findall(r"^    (\w+) +\S", text, re.M)
    assert sorted(listed) == sorted(COMMANDS), listed
    parser = build_parser()
    for command in COMMANDS:                     # each command's own help: a description, every option explained
        sub = parser._subparsers._group_actions[0].choices[command]
        assert sub.description, command
        unexplained = [a.dest for a in sub._actions if not a.help and a.dest != "help"]
        assert not unexplained, (command, unexplained)


def test_random_weights_are_noted_once_and_the_builtin_model_chats(tiny_q4_path, tmp_path):
    """A model of `fermoe synth` (random weights) says so on stderr, once; a trained model's
    runs say nothing, --chat on the built-in model (trained on chat episodes) included: asked
    for one sentence about a text (written for this test), it answers with the text's first."""
    synth = fermoe("generate", tiny_q4_path, "-p", "Hi", "-n", 4, "--ignore-eos")
    assert synth.stderr == (f"fermoe: {tiny_q4_path} has random weights (written by fermoe synth): its output is "
                            "noise, for speed measurements only\n")
    assert fermoe("generate", "-p", "Hi", "-n", 4, "--ignore-eos").stderr == ""
    text = r"In one sentence, what is this about?\n\nCreate a fresh temporary directory and return its path.\n" \
           r"The caller removes it when done."
    chat = fermoe("generate", "-p", text, "-n", 64, "--temp", 0, "--chat")
    assert chat.stderr == ""
    assert chat.stdout.endswith("</think>\n\nCreate a fresh temporary directory and return its path.\n"), chat.stdout


def test_generate_engine_reference(tiny_q4_path, capsys):
    expected = local_text(tiny_q4_path, "Once upon a time", 8, eos=True, engine="reference", temperature=0.8, seed=2)
    assert expected != local_text(tiny_q4_path, "Once upon a time", 8, eos=True, temperature=0.8, seed=2)
    out = _cli(capsys, "generate", tiny_q4_path, "--engine", "reference", "-p", "Once upon a time", "-n", 8,
               "--seed", 2)
    assert out == expected + "\n"


def _dead_arenas() -> set[str]:
    """/dev/shm arenas whose creating process is gone (what a coordinator that did not
    clean up leaves)."""
    names = set()
    for name in os.listdir("/dev/shm"):
        m = re.fullmatch(r"fermoe-(\d+)-[0-9a-f]{8}", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            names.add(name)
    return names


def test_demo_streams_a_greedy_continuation_and_stops(tmp_path, monkeypatch):
    """`fermoe demo` on the built-in model: a coordinator comes up, the prompt's greedy
    continuation streams (what a local greedy run gives), and everything stops (status 0,
    no arena left behind)."""
    monkeypatch.setenv("FERMOE_CACHE", str(tmp_path))
    leaked_before = _dead_arenas()
    run = fermoe("demo", "-p", r"The old GPU\tsaid", "-n", 12)      # its coordinator on a free port of its own
    from shared.builtin import resolve_model
    ids = local_ids(resolve_model("tiny"), "The old GPU\tsaid", 12, eos=True, temperature=0.0)
    expected = Model(resolve_model("tiny")).tokenizer.decode(ids)
    assert expected.strip() and run.stdout == "The old GPU\tsaid" + expected + "\n"   # the prompt, its continuation
    why = "12 tokens (-n)" if len(ids) == 12 else "end of generation"
    assert re.fullmatch(rf"stopped: {re.escape(why)}; prompt \d+ tokens \(0 cached\), prefill \d+ ms, "
                        rf"{len(ids)} tokens generated at [\d.]+ tok/s\n", run.stderr), run.stderr
    assert _dead_arenas() <= leaked_before


def test_demo_refuses_an_address_another_process_listens_on():
    """Fault guarded: the demo's coordinator failed to bind an address already taken, the
    demo sent its prompt to whatever listened there (another model, possibly), and then
    reported that its coordinator had exited."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        addr = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        run = fermoe("demo", "-n", 2, "--addr", addr, check=False)
    assert run.returncode == 1 and run.stdout == "", run.stdout
    assert f"--addr {addr}: another process listens there already" in run.stderr, run.stderr


def test_demo_agent_runs_a_real_tool_loop(tmp_path, monkeypatch):
    """`fermoe demo --agent` on the built-in model: it calls pydoc with the name asked, the tool
    runs here (Python's pydoc: the docstring's first line is shown), and the model answers with
    that docstring's first sentence; one summary line a reply."""
    from shared.pydoc_tool import first_sentence, lookup
    monkeypatch.setenv("FERMOE_CACHE", str(tmp_path))
    run = fermoe("demo", "--agent", "--addr", f"tcp://127.0.0.1:{free_port()}")
    lines = run.stdout.splitlines()
    doc = lookup("json.dumps")
    assert lines[0] == "user: What does json.dumps do?"
    assert lines[1].startswith("think: ") and lines[2] == "call: pydoc " + json.dumps({"name": "json.dumps"})
    assert lines[3].startswith("tool: " + doc.splitlines()[0])
    assert lines[-1] == "answer: " + first_sentence(doc)
    assert [line.split(";")[0] for line in run.stderr.splitlines()] == ["stopped: end of generation"] * 2


def test_bench_tools_counts_calls_on_held_out_names(tmp_path):
    """`fermoe bench tools` prints JSON; on the first held-out names (asyncio's, whose module
    the model has seen) it calls pydoc with the exact name; a name file it cannot read is refused."""
    out = json.loads(fermoe("bench", "tools", "--limit", 3, "-t", 1).stdout)
    assert (out["names"], out["called"], out["called_correctly"]) == (3, 3, 3), out
    assert 0 <= out["answered_exactly"] <= out["answerable"] <= 3 and out["thinking"] is True
    import bench.tool_calls
    assert_keys_documented(out, bench.tool_calls)
    bad = tmp_path / "names.txt"
    bad.write_text("json.dumps\n")
    run = fermoe("bench", "tools", "--names", bad, check=False)
    assert run.returncode != 0 and "expected 'KIND NAME'" in run.stderr


def test_demo_on_a_random_model_says_its_output_is_noise(tiny_q4_path):
    run = fermoe("demo", tiny_q4_path, "-n", 3, "--addr", f"tcp://127.0.0.1:{free_port()}")
    notice, summary = run.stderr.splitlines()
    assert notice == f"fermoe: {tiny_q4_path} has random weights (written by fermoe synth): its output is noise, " \
                     "for speed measurements only"
    assert summary.startswith("stopped: ") and run.stdout.startswith("This module provides")


def _expected_type(name: str, shape, matrices: str) -> str:
    """The README's rule: routers and the conv kernel stay F32, as vectors do; every
    other matrix takes the file's type."""
    keep_f32 = name.endswith(("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight"))
    return "F32" if len(shape) < 2 or keep_f32 else matrices


def _types(path) -> dict[str, tuple[str, tuple]]:
    gguf = pytest.importorskip("gguf")
    return {t.name: (t.tensor_type.name, tuple(t.shape)) for t in gguf.GGUFReader(str(path)).tensors}


def test_convert_command_writes_f16(tmp_path):
    """`fermoe convert --type f16` on a small Hugging Face checkpoint: the library's file
    byte for byte, its matrices F16 (routers and conv F32), the embedding the checkpoint's
    rounded to half precision."""
    hf_oracle = pytest.importorskip("tests.support.hf_oracle")
    gguf = pytest.importorskip("gguf")
    from modeltools.convert import convert
    from modeltools.safetensors_file import Checkpoint
    ckpt = hf_oracle.save_checkpoint(hf_oracle.build_hf_model("qwen35moe-a"), tmp_path / "hf")
    out = tmp_path / "cmd.gguf"
    run = fermoe("convert", ckpt, out, "--type", "f16")
    assert "wrote" in run.stderr and "f16" in run.stderr
    convert(ckpt, tmp_path / "lib.gguf", "f16", progress=False)
    assert out.read_bytes() == (tmp_path / "lib.gguf").read_bytes()
    types = _types(out)
    assert {n: t for n, (t, _) in types.items()} == {n: _expected_type(n, s, "F16") for n, (_, s) in types.items()}
    assert {t for t, _ in types.values()} == {"F16", "F32"}
    embd = next(t for t in gguf.GGUFReader(str(out)).tensors if t.name == "token_embd.weight")
    hf_embd = Checkpoint(ckpt).load("model.embed_tokens.weight")
    np.testing.assert_array_equal(np.asarray(embd.data).reshape(hf_embd.shape), hf_embd.astype(np.float16))


def test_synth_command_writes_f16_and_its_seed_decides_the_weights(tmp_path, capsys):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    fermoe("synth", a, "--experts", 4, "--layers", 2, "--type", "f16", "--seed", 3)
    types = _types(a)
    assert {n: t for n, (t, _) in types.items()} == {n: _expected_type(n, s, "F16") for n, (_, s) in types.items()}
    assert {t for t, _ in types.values()} == {"F16", "F32"}
    _cli(capsys, "synth", b, "--experts", 4, "--layers", 2, "--type", "f16", "--seed", 3)
    _cli(capsys, "synth", c, "--experts", 4, "--layers", 2, "--type", "f16", "--seed", 4)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert Model(c).config.n_layer == 2


def test_synth_stores_the_chat_template_it_is_given(tmp_path):
    from shared.gguf_file import GGUFFile
    from tests.support.qwen_template import QWEN_STYLE_TEMPLATE
    template = tmp_path / "chat.jinja"
    template.write_text(QWEN_STYLE_TEMPLATE)
    fermoe("synth", tmp_path / "m.gguf", "--chat-template-file", template)
    with GGUFFile(tmp_path / "m.gguf") as f:
        assert f.metadata["tokenizer.chat_template"] == QWEN_STYLE_TEMPLATE
    out = fermoe("synth", tmp_path / "n.gguf", "--chat-template-file", tmp_path / "none.jinja", check=False)
    assert out.returncode == 1 and "--chat-template-file" in out.stderr and "No such file" in out.stderr


def test_keys_writes_private_pairs_and_refuses_to_overwrite(tmp_path):
    from shared.curve import ClientKeys, ServerKeys
    keys = tmp_path / "keys"
    r = fermoe("keys", keys)
    assert "wrote" in r.stderr and (keys / "workers" / "worker.key_secret").name in r.stderr
    for d in (keys, keys / "workers", keys / "clients"):
        assert os.stat(d).st_mode & 0o777 == 0o700
    for secret in ("server.key_secret", "workers/worker.key_secret", "clients/client.key_secret"):
        assert os.stat(keys / secret).st_mode & 0o777 == 0o600
    server = ServerKeys(keys)               # they load back, each pair carrying the server's public key
    assert ClientKeys(keys / "workers" / "worker.key_secret").server == server.public
    before = (keys / "workers" / "worker.key_secret").read_text()
    again = fermoe("keys", keys, check=False)
    assert again.returncode == 1 and "already there" in again.stderr and "--force" in again.stderr
    assert (keys / "workers" / "worker.key_secret").read_text() == before
    fermoe("keys", keys, "--worker", "host2")           # a pair more, same server
    assert ClientKeys(keys / "workers" / "host2.key_secret").server == server.public
    assert not (keys / "clients" / "host2.key_secret").exists()
    fermoe("keys", keys, "--force")
    assert (keys / "workers" / "worker.key_secret").read_text() != before
    assert len(ServerKeys(keys).workers.keys) == 2
