"""`coordinator` started with a llama-server command line as model cards print it: llama-server's
spellings are taken (-m, -c, --port, -a, -n, the sampling defaults), flags without effect here
are accepted with a line in the log saying what fermoe does instead, and flags that would change
the output are refused at start, naming them. The sampling defaults are every request's that
does not set its own, on every route, shown in /props and in each /completion's
generation_settings."""
from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest

from coordinator.llama_server_flags import strip
from coordinator.options import parse_options
from shared.errors import FermoeError
from tests.support.http_server import Process
from tests.support.serving_harness import free_port

# a model card's command line (Qwen3.6's, the model swapped for the built-in one), on a free port
CARD = "-m tiny --jinja -c 8192 --temp 0.6 --top-p 0.95 --top-k 20 --min-p 0 --presence-penalty 1.5 " \
       "--reasoning-budget 0 -a qwen3.6 -ngl 99 -fa on --no-mmap -n 24 -s 7"


@pytest.fixture(scope="module")
def card_daemon():
    yield from started(*CARD.split())


def started(*flags: str):
    """`coordinator FLAGS --port P` (P free), until the module's tests are done; `.url` its API."""
    port = free_port()
    d = Process([sys.executable, "-m", "coordinator.daemon", *flags, "--port", str(port),
                 "--bind", f"tcp://127.0.0.1:{free_port()}", "--snapshot-mem", "32MiB", "--threads-per-worker", "1"])
    d.url = f"http://127.0.0.1:{port}"
    d.wait_http(d.url)
    yield d
    assert d.stop() == 0


def test_a_model_cards_command_line_serves(card_daemon):
    props = httpx.get(f"{card_daemon.url}/props", timeout=30).json()
    assert props["model_alias"] == "qwen3.6" and props["default_generation_settings"]["n_ctx"] == 8192
    params = props["default_generation_settings"]["params"]
    assert {k: params[k] for k in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "seed",
                                   "n_predict")} == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0,
                                                     "presence_penalty": 1.5, "seed": 7, "n_predict": 24}
    # a flag without effect is named in the log with what fermoe does instead (one line each)
    log = "".join(card_daemon.log)
    for flag in ("--jinja", "-ngl 99", "-fa on", "--no-mmap"):
        assert f"{flag}: accepted without effect (" in log, flag


def test_the_servers_defaults_are_a_requests_unless_it_sets_its_own(card_daemon):
    """Guards: the defaults ignored (llama.cpp's 0.8 used), or applied over a request's own value."""
    url = f"{card_daemon.url}/completion"
    plain = httpx.post(url, json={"prompt": "The sky is"}, timeout=60).json()
    settings = plain["generation_settings"]
    assert (settings["temperature"], settings["top_k"], settings["seed"], settings["n_predict"]) == (0.6, 20, 7, 24)
    assert plain["tokens_predicted"] == 24                   # -n 24: the request said nothing
    again = httpx.post(url, json={"prompt": "The sky is"}, timeout=60).json()
    assert again["content"] == plain["content"]              # -s 7: the same draw
    own = httpx.post(url, json={"prompt": "The sky is", "temperature": 0, "n_predict": 5, "seed": 1},
                     timeout=60).json()
    assert (own["generation_settings"]["temperature"], own["generation_settings"]["seed"]) == (0.0, 1)
    assert own["tokens_predicted"] == 5 and own["generation_settings"]["top_k"] == 20
    # the OpenAI route gets them too: its answer is /completion's, same seed, same length
    chat = httpx.post(f"{card_daemon.url}/v1/completions", json={"prompt": "The sky is"}, timeout=60).json()
    assert chat["choices"][0]["text"] == plain["content"] and chat["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize("flag, named", [("--lora x.gguf", "--lora"), ("--no-jinja", "--no-jinja"),
                                         ("--rope-scaling yarn", "--rope-scaling"), ("--grammar-file g", "--grammar-file"),
                                         ("-hf Qwen/Qwen3.6", "-hf"), ("--samplers=top_k", "--samplers")])
def test_a_flag_that_would_change_the_output_is_refused_at_start(flag, named):
    r = subprocess.run([sys.executable, "-m", "coordinator.daemon", "-m", "tiny", *flag.split()], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr.startswith(f"coordinator: error: {named}: llama-server's flag is not supported by fermoe")


def test_llama_servers_spellings_and_values():
    opts = parse_options("-m tiny -c 0 -t 1 -np 3 --host ::1 --port 8091 --repeat-last-n -1 -s -1 -n -1 "
                         "-ctk f32 -ctv f32".split())
    assert (opts.max_model_len, opts.threads_per_worker, opts.max_sequences, opts.http) == (None, 1, 3, "[::1]:8091")
    assert opts.sampling_defaults == {"repeat_last_n": 2**31 - 1} and opts.n_predict is None   # the whole context
    assert opts.kv_cache_dtype == "f32"
    assert parse_options(["-m", "tiny", "--host", "0.0.0.0", "--api-key", "k"]).http == "0.0.0.0:8080"
    assert parse_options(["-m", "tiny", "--host", "127.0.0.1,::1", "--port", "9"]).http == "127.0.0.1:9,[::1]:9"
    for argv, problem in ((["--temp", "-1"], "--temp: temperature must be >= 0"),
                          (["--top-p", "0"], "--top-p: top_p must be in (0, 1]"),
                          (["-n", "0"], "-n 0: must be >= 1, or -1"), (["-c", "-5"], "-c -5: must be >= 0"),
                          (["-c", "8", "--max-model-len", "8"], "-c/--ctx-size and --max-model-len: give one"),
                          (["-ctk", "f16", "-ctv", "f32"], "fermoe keeps K and V in one type"),
                          (["-ctk", "q4_0"], "-ctk/-ctv q4_0: fermoe's KV cache types are"),
                          (["--port", "8090", "--http", "127.0.0.1:8091"], "--host/--port and --http: give one")):
        with pytest.raises(FermoeError, match=re.escape(problem)):
            parse_options(["-m", "tiny", *argv])


def test_strip_takes_each_flags_value_as_llama_server_does():
    """Guards: a flag's value left behind (and read as the next flag), or the next flag taken as its value."""
    argv, notes = strip(["-fa", "-ngl", "99", "--flash-attn=on", "-fa", "off", "-b", "512", "--temp", "0.6"])
    assert argv == ["--temp", "0.6"]
    assert [n.split(":")[0] for n in notes] == ["-fa", "-ngl 99", "--flash-attn=on", "-fa off", "-b 512"]
    with pytest.raises(FermoeError, match="-ngl: expected a value"):
        strip(["-ngl"])


# ChatML with a variable of its own, to see whose chat_template_kwargs the render took
GREETING_TEMPLATE = ("{{ '<|im_start|>system\\n' + greeting + '<|im_end|>\\n' }}{%- for m in messages %}"
                     "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
                     "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


@pytest.fixture(scope="module")
def template_daemon(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "greeting.jinja"
    path.write_text(GREETING_TEMPLATE)
    yield from started("-m", "tiny", "--chat-template-file", str(path),
                       "--chat-template-kwargs", '{"greeting": "Hello from the server"}')


def test_the_chat_template_and_its_kwargs_from_the_command_line(template_daemon):
    """Guards: the model's own template used despite --chat-template-file, or the server's kwargs
    over a request's own (or not at all)."""
    url = template_daemon.url
    assert httpx.get(f"{url}/props", timeout=30).json()["chat_template"] == GREETING_TEMPLATE
    hi = [{"role": "user", "content": "Hi"}]
    rendered = httpx.post(f"{url}/apply-template", json={"messages": hi}, timeout=30).json()["prompt"]
    assert rendered == ("<|im_start|>system\nHello from the server<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n")
    own = httpx.post(f"{url}/apply-template", json={"messages": hi, "chat_template_kwargs": {"greeting": "Bye"}},
                     timeout=30).json()["prompt"]
    assert own.startswith("<|im_start|>system\nBye<|im_end|>")
    # the coordinator renders the same prompt: its token count is the rendered text's
    n = len(httpx.post(f"{url}/tokenize", json={"content": rendered}, timeout=30).json()["tokens"])
    chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": hi, "max_tokens": 1}, timeout=60).json()
    assert chat["usage"]["prompt_tokens"] == n


@pytest.mark.parametrize("argv, problem", [
    (["--chat-template", "nosuch"], "--chat-template 'nosuch': not a Jinja template, nor a name fermoe knows (chatml)"),
    (["--chat-template", "{% if %}"], "--chat-template: the chat template does not parse"),
    (["--chat-template-file", "/nonexistent.jinja"], "--chat-template-file /nonexistent.jinja: cannot read it"),
    (["--chat-template", "chatml", "--chat-template-file", "f"], "--chat-template and --chat-template-file: give one"),
    (["--chat-template-kwargs", "[1]"], "--chat-template-kwargs: expected a JSON object, got list"),
    (["--chat-template-kwargs", "{x"], "--chat-template-kwargs: not JSON")])
def test_a_bad_chat_template_flag_is_named_at_start(argv, problem):
    with pytest.raises(FermoeError, match=re.escape(problem)):
        parse_options(["-m", "tiny", *argv])


def test_chatml_by_name():
    from coordinator.llama_server_flags import NAMED_TEMPLATES
    opts = parse_options(["-m", "tiny", "--chat-template", "chatml"])
    assert opts.chat_template == NAMED_TEMPLATES["chatml"]
    from shared.tokenizer import render_chat_template
    assert render_chat_template(opts.chat_template, [{"role": "user", "content": "Hi"}]) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def serving_daemon():
    for d in started("-m", "tiny", "--host", "127.0.0.1,::1", "-a", "qwen3.6,qwen", "--tags", "coding,local",
                     "--no-slots"):
        d.urls = [d.url, d.url.replace("127.0.0.1", "[::1]")]
        yield d


def test_serving_flags_several_hosts_aliases_tags_and_no_slots(serving_daemon):
    """Guards: only the first --host served, aliases beyond the first dropped, --no-slots ignored."""
    for url in serving_daemon.urls:
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200, url
    url = serving_daemon.urls[1]
    cards = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    assert [(c["id"], c["aliases"], c["tags"]) for c in cards] == [
        ("qwen3.6", ["qwen3.6", "qwen"], ["coding", "local"]), ("qwen", ["qwen3.6", "qwen"], ["coding", "local"])]
    assert httpx.get(f"{url}/v1/models/qwen", timeout=30).json()["id"] == "qwen"
    r = httpx.post(f"{url}/v1/completions", json={"model": "qwen", "prompt": "x", "max_tokens": 1}, timeout=60)
    assert r.json()["model"] == "qwen3.6"                  # replies carry the first name
    slots = httpx.get(f"{url}/slots", timeout=30)
    assert slots.status_code == 501 and "does not support slots endpoint" in slots.json()["error"]["message"]
