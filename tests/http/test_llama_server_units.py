"""frontend/llama_server_api.py's details by exact value, in this process (tests/support's
scripted coordinator): n_probs' bounds and refusals, /props with a tokenizer that has a BOS, a
byte piece or no template, and with no model file on this host, /slots turned off, a mixed
prompt's BOS, token id 0, several prompts' cancel, and the raw bytes of a stream."""
from __future__ import annotations

import importlib.metadata
import time

import pytest

from frontend import llama_server_api
from tests.support.inprocess_frontend import InProcessFrontend, data_lines, done, started, token

HI = [{"role": "user", "content": "Hi"}]


def error_body(message, type_="invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def tokenizer(fe):
    """The front end's own tokenizer (loaded once per front end: changing it touches no other test)."""
    return fe._call(fe.server.tokenizer())


# ---- n_probs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, expected", [
    ({"n_probs": 21}, error_body("n_probs must be an integer in [0, 20], got 21", param="n_probs",
                                 code="invalid_value")),
    ({"n_probs": 1.5}, error_body("n_probs must be an integer in [0, 20], got 1.5", param="n_probs",
                                  code="invalid_value")),
    ({"n_probs": 2, "post_sampling_probs": True},
     error_body("post_sampling_probs is not supported: n_probs gives the model's own probabilities, before the "
                "samplers", param="post_sampling_probs", code="unsupported_parameter"))])
def test_completion_n_probs_refusals_say_why(front, fields, expected):
    """Guards: an n_probs refusal's message, param or code other than these (the bounds not
    named, post_sampling_probs' refusal not saying why)."""
    r = front.post("/completion", json={"prompt": "Hi"} | fields)
    assert (r.status_code, r.json()) == (400, expected)
    assert front.coordinator.generates == []


@pytest.mark.parametrize("n, logprobs", [(0, None), (20, 20)])
def test_completion_n_probs_bounds_are_taken(front, n, logprobs):
    """Guards: n_probs 0 (llama-server's default: none) or 20 (the most) refused as out of range,
    or 0 asking for probabilities."""
    front.coordinator.script(started(2), token(1785, "Hello"), done("length", prompt_tokens=2, completion_tokens=1))
    r = front.post("/completion", json={"prompt": "Hi", "n_probs": n, "post_sampling_probs": n == 0})
    assert r.status_code == 200 and front.coordinator.generates[0].logprobs == logprobs
    assert ("completion_probabilities" in r.json()) is (logprobs is not None)


# ---- /props, /slots ---------------------------------------------------------------------------
def test_props_show_the_tokenizers_bos_a_byte_piece_and_no_template_as_empty():
    """Guards: a BOS never shown (the tiny model has none), a piece that is part of a UTF-8
    character failing instead of showing U+FFFD, or a model without a chat template shown as
    anything but ""."""
    with InProcessFrontend() as fe:
        tok = tokenizer(fe)
        tok.bos_id, tok.eos_id, tok.chat_template = 1785, 127, None     # "Hello", the byte C3
        body = fe.get("/props").json()
    assert (body["bos_token"], body["eos_token"], body["chat_template"]) == ("Hello", "\ufffd", "")


def test_props_without_the_model_file_show_no_tokenizer():
    """Guards: /props failing, or showing something, when this host cannot read the model's
    tokenizer (the coordinator's model path is elsewhere)."""
    with InProcessFrontend(model="/nowhere/model.gguf") as fe:
        r = fe.get("/props")
    body = r.json()
    assert r.status_code == 200 and (body["chat_template"], body["bos_token"], body["eos_token"],
                                     body["model_path"]) == ("", "", "", "/nowhere/model.gguf")


def test_build_info_without_an_installed_package_says_source(monkeypatch):
    """Guards: a front end run from a source tree (no package metadata) failing /props or naming
    a version."""
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)
    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert llama_server_api._build_info() == "fermoe source"


def test_slots_turned_off_answer_llama_servers_501():
    """Guards: --no-slots answered by anything but llama-server's 501 and its words."""
    with InProcessFrontend({"slots": False}) as fe:
        r = fe.get("/slots")
    assert (r.status_code, r.json()) == (501, error_body(
        "This server does not support slots endpoint. Start it with `--slots`", "server_error",
        code="not_supported_error"))


# ---- /apply-template --------------------------------------------------------------------------
def test_apply_template_renders_the_tools_and_honours_add_generation_prompt(front):
    """Guards: the request's tools left out of the rendered prompt, or add_generation_prompt: false
    ignored (the assistant's opening added anyway)."""
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object"}}}]
    r = front.post("/apply-template", json={"messages": HI, "tools": tools, "add_generation_prompt": False})
    prompt = r.json()["prompt"]
    assert r.status_code == 200 and '"name": "read_file"' in prompt
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n")


# ---- prompts ----------------------------------------------------------------------------------
def test_a_mixed_prompt_gets_the_bos_before_its_leading_string_only():
    """Guards: a mixed prompt's later strings given a BOS too, or its leading one none, when the
    model adds one (llama-server's tokenize_mixed)."""
    with InProcessFrontend() as fe:
        tok = tokenizer(fe)
        tok.bos_id, tok.add_bos = 7, True
        fe.coordinator.script(done("stop"))
        assert fe.post("/completion", json={"prompt": ["Hello", 312, " world"]}).status_code == 200
        assert fe.coordinator.generates[0].tokens == [7, 1785, 312, 324, 312, 3118]


def test_token_id_zero_is_a_token(front):
    """Guards: token id 0 refused as outside the vocabulary, or left out of a chunk's or the
    answer's tokens (and of tokens_predicted)."""
    front.coordinator.script(started(2), token(0, "!"), token(1785, "Hello"),
                             done("length", prompt_tokens=2, completion_tokens=2))
    r = front.post("/completion", json={"prompt": [0, 1785], "return_tokens": True})
    assert (r.status_code, r.json()["tokens"], r.json()["prompt"]) == (200, [0, 1785], "!Hello")
    front.coordinator.script(started(2), token(0, "!"), done("length", prompt_tokens=2, completion_tokens=1))
    events = data_lines(front.post("/completion", json={"prompt": "Hi", "stream": True}).text)
    assert (events[0]["tokens"], events[0]["tokens_predicted"]) == ([0], 1)


def test_a_token_prompt_without_the_model_file_is_shown_as_empty():
    """Guards: a prompt of token ids failing (or shown as something) when this host cannot read
    the tokenizer to decode it."""
    with InProcessFrontend(model="/nowhere/model.gguf") as fe:
        fe.coordinator.script(done("stop"))
        r = fe.post("/completion", json={"prompt": [5, 6]})
    assert (r.status_code, r.json()["prompt"]) == (200, "")


def test_sixty_four_prompts_are_one_request(front):
    """Guards: the limit on prompts in one request off by one (64, MAX_PROMPTS, refused)."""
    for _ in range(64):
        front.coordinator.script(done("stop"))
    r = front.post("/completion", json={"prompt": ["a"] * 64, "response_fields": ["index"]})
    assert (r.status_code, r.json()) == (200, [{"index": i} for i in range(64)])


def test_prompts_sent_before_one_that_cannot_be_sent_are_cancelled():
    """Guards: the prompts of a request already sent left running in the coordinator when a
    later prompt of the same request cannot be sent (over the coordinator's message limit)."""
    with InProcessFrontend(max_request_size=1000) as fe:
        fe.coordinator.script(started(2), 1.0, done("stop"))
        r = fe.post("/completion", json={"prompt": ["Hi", "a" * 2000]})
        assert r.status_code == 413
        deadline = time.monotonic() + 5
        while not fe.coordinator.cancels and time.monotonic() < deadline:
            time.sleep(0.01)
        assert fe.coordinator.cancels == [fe.coordinator.generates[0].request_id]


# ---- streams ----------------------------------------------------------------------------------
def test_a_stream_writes_text_as_utf_8_and_sends_chunks_as_they_come(front):
    """Guards: a chunk's text escaped to ASCII (llama-server writes UTF-8), or the chunks that came
    before a pause not sent (the send they go out with broken)."""
    front.coordinator.script(started(2), token(1785, "hé"), 0.05, token(312, "or"),
                             done("length", prompt_tokens=2, completion_tokens=2))
    r = front.post("/completion", json={"prompt": "Hi", "stream": True, "response_fields": ["content"]})
    assert r.text.split("\n\n")[:3] == [
        'data: {"index": 0, "content": "hé", "tokens": [1785], "stop": false, "id_slot": 0, "tokens_predicted": 1, '
        '"tokens_evaluated": 0}',
        'data: {"index": 0, "content": "or", "tokens": [312], "stop": false, "id_slot": 0, "tokens_predicted": 2, '
        '"tokens_evaluated": 0}',
        'data: {"content": ""}']


def test_a_failed_stream_with_response_fields_ends_with_the_whole_error(front):
    """Guards: response_fields applied to a stream's closing error (leaving {} where the error
    should be)."""
    front.coordinator.script(started(2), token(1785, "Hello"), done("error", error="the worker died"))
    events = data_lines(front.post("/completion", json={"prompt": "Hi", "stream": True,
                                                        "response_fields": ["content"]}).text)
    assert events[-1] == error_body("the worker died", "server_error")
