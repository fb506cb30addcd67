"""frontend/anthropic_api.py's details by exact value, in this process against a scripted
coordinator (tests/support/inprocess_frontend.py): the SSE bytes as sent, a call's input that
is not a JSON object, the refusals' and failures' messages, the request id, and
/v1/messages/count_tokens on prompts the template renders otherwise (tools, thinking off, an
assistant prefill, a refusal of the template's)."""
from __future__ import annotations

from frontend.anthropic_api import content_block
from frontend.blocks import Block
from shared.gguf_file import GGUFFile
from shared.tokenizer import Tokenizer
from tests.support.inprocess_frontend import MODEL_PATH, done, error, named_events, started, token

BODY = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}}


def tokens_of(prompt: str) -> int:
    f = GGUFFile(MODEL_PATH)
    tok = Tokenizer.from_metadata(f.metadata)
    f.close()
    return len(tok.encode(prompt))


def test_stream_bytes_keep_non_ascii_text_as_is(front):
    """Guards: events written with JSON's \\u escapes (ensure_ascii): the bytes on the wire, as
    Anthropic's own server sends them, are the UTF-8 text."""
    front.coordinator.script(started(3), token(1, "héllo ✓"), done("stop", prompt_tokens=3, completion_tokens=1))
    text = front.post("/v1/messages", json=BODY | {"stream": True, "thinking": {"type": "disabled"}}).text
    assert ('event: content_block_delta\ndata: {"type": "content_block_delta", "index": 0, "delta": '
            '{"type": "text_delta", "text": "héllo ✓"}}\n\n') in text


def test_a_calls_input_that_is_not_a_json_object_is_kept_whole():
    """Guards: a call whose arguments are not JSON, or JSON of another kind than an object,
    lost or given under another key (`input` must be an object: the text is kept under _raw,
    a non-object value under _value)."""
    call = dict(index=2, kind="call", id="toolu_1", name="f")
    assert content_block(Block(**call, text='{"a": [1]')) == {"type": "tool_use", "id": "toolu_1", "name": "f",
                                                              "input": {"_raw": '{"a": [1]'}}
    assert content_block(Block(**call, text="[1, 2]")) == {"type": "tool_use", "id": "toolu_1", "name": "f",
                                                           "input": {"_value": [1, 2]}}
    assert content_block(Block(**call, text='{"a": 1}')) == {"type": "tool_use", "id": "toolu_1", "name": "f",
                                                             "input": {"a": 1}}


def test_a_context_refusal_without_counts_is_the_coordinators_message(front):
    """Guards: a context_length_exceeded that carries no token counts rewritten as Anthropic's
    `prompt is too long: None tokens > None maximum` (it is chat's refusal, naming the messages)."""
    front.coordinator.script(error("the prompt does not fit", code="context_length_exceeded"))
    r = front.post("/v1/messages", json=BODY)
    assert (r.status_code, r.json()) == (400, {"type": "error", "error": {"type": "invalid_request_error",
                                                                          "message": "messages: the prompt does not fit"}})


def test_a_streamed_failure_without_a_message_says_the_request_failed(front):
    """Guards: a failed generation's stream ending in an error event with no message (the
    coordinator's Done gave none)."""
    front.coordinator.script(token(1, "Hm"), done("error"))
    events = named_events(front.post("/v1/messages", json=BODY | {"stream": True}).text)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "api_error", "message": "the request failed"}})


def test_the_request_id_is_msg_and_24_hex_digits(front):
    """Guards: the message id (Anthropic's msg_ and 24 characters) cut or grown."""
    front.coordinator.script(token(1, "x"), done("stop", completion_tokens=1))
    body = front.post("/v1/messages", json=BODY).json()
    rid = front.coordinator.generates[0].request_id
    assert body["id"] == rid and len(rid) == 28 and rid[:4] == "msg_" and int(rid[4:], 16) >= 0


def test_count_tokens_renders_the_tools():
    """Guards: the tools left out of the count (Claude Code's tools are most of its prompt)."""
    from tests.support.inprocess_frontend import InProcessFrontend
    prompt = ('<|im_start|>system\n# Tools\n\n<tools>\n{"type": "function", "function": {"name": "read_file", '
              '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}\n</tools>\n\n'
              'Call them as <tool_call><function=NAME><parameter=ARG>\n\nBe brief<|im_end|>\n'
              '<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n')
    with InProcessFrontend() as fe:
        r = fe.post("/v1/messages/count_tokens", json={
            "model": "m", "system": "Be brief", "messages": [{"role": "user", "content": "Hi"}],
            "tools": [{"name": "read_file", "input_schema": SCHEMA}]})
    assert (r.status_code, r.json()) == (200, {"input_tokens": tokens_of(prompt)})


def test_count_tokens_with_thinking_off_and_an_assistant_prefill(front):
    """Guards: the request's template settings (thinking off closes the think block in the
    generation prompt) or a final assistant message's continuation (no end of turn, no new
    generation prompt) left out of the count."""
    r = front.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}})
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert (r.status_code, r.json()) == (200, {"input_tokens": tokens_of(prompt)})
    r = front.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]})
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHel"
    assert (r.status_code, r.json()) == (200, {"input_tokens": tokens_of(prompt)})


def test_count_tokens_of_messages_the_template_refuses_is_a_400_saying_so(front):
    """Guards: the template's refusal (here: no user message) a 500, or a 400 without its
    words."""
    r = front.post("/v1/messages/count_tokens", json={
        "model": "m", "messages": [{"role": "assistant", "content": "x"}]})
    assert (r.status_code, r.json()) == (400, {"type": "error", "error": {
        "type": "invalid_request_error",
        "message": "the chat template rejected the messages: No user query found in messages."}})
