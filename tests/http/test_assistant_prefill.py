"""A final assistant message is continued (an assistant prefill), as llama-server continues
one by default and vLLM's `continue_final_message` with `add_generation_prompt: false` asks:
the prompt ends with that message's text, its end of turn left off, and the answer is what
the raw prompt's completion is. `add_generation_prompt: true` alone starts a new turn after it;
both flags true, or a continuation with no final assistant message, are refused."""
from __future__ import annotations

import httpx
import pytest

from shared.builtin import BUILTIN
from shared.chat import render_chat
from shared.model import Model
from tests.support.http_server import HttpDaemon

ASKED = [{"role": "user", "content": "What does json.dumps do?"}]
PREFILLED = ASKED + [{"role": "assistant", "content": "It turns"}]
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def daemon():
    d = HttpDaemon(BUILTIN["tiny"])
    yield d
    assert d.stop() == 0


def test_the_prompt_ends_with_the_final_messages_text():
    """Guards: the final message closed (`<|im_end|>`) and a new turn opened, or its text cut."""
    tok = Model(BUILTIN["tiny"]).tokenizer
    whole = render_chat(tok, PREFILLED, add_generation_prompt=False)
    continued = render_chat(tok, PREFILLED, continue_final=True)
    assert whole == continued + "<|im_end|>\n" and continued.endswith("\n\nIt turns")
    # reasoning of the continued turn stays; a trailing space is the client's to keep
    turn = render_chat(tok, ASKED + [{"role": "assistant", "content": "A ", "reasoning_content": "r"}],
                       continue_final=True)
    assert turn.endswith("<|im_start|>assistant\n<think>\nr\n</think>\n\nA ")


def test_a_final_assistant_message_is_continued(daemon):
    """Guards: the prefill ignored (a new turn answered), or the front end splitting the
    continuation as reasoning."""
    rendered = httpx.post(f"{daemon.url}/apply-template", json={"messages": PREFILLED}, timeout=30).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt turns")
    chat = httpx.post(f"{daemon.url}/v1/chat/completions", json={"messages": PREFILLED, **GREEDY}, timeout=60).json()
    raw = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": rendered, **GREEDY}, timeout=60).json()
    message = chat["choices"][0]["message"]
    assert message["content"] == raw["choices"][0]["text"] and not message.get("reasoning_content")
    assert chat["usage"]["prompt_tokens"] == raw["usage"]["prompt_tokens"]
    vllm = {"continue_final_message": True, "add_generation_prompt": False}
    again = httpx.post(f"{daemon.url}/v1/chat/completions", json={"messages": PREFILLED, **GREEDY, **vllm},
                       timeout=60).json()
    assert again["choices"][0]["message"]["content"] == message["content"]


def test_add_generation_prompt_alone_opens_a_new_turn(daemon):
    body = {"messages": PREFILLED, "add_generation_prompt": True}
    rendered = httpx.post(f"{daemon.url}/apply-template", json=body, timeout=30).json()["prompt"]
    assert rendered.endswith("It turns<|im_end|>\n<|im_start|>assistant\n<think>\n")


@pytest.mark.parametrize("messages, flags, problem", [
    (PREFILLED, {"continue_final_message": True, "add_generation_prompt": True},
     "continue_final_message and add_generation_prompt may not both be true"),
    (ASKED, {"continue_final_message": True}, "continue_final_message needs a final assistant message, and the "
                                              "last one is 'user'")])
def test_impossible_prefills_are_refused(daemon, messages, flags, problem):
    r = httpx.post(f"{daemon.url}/v1/chat/completions", json={"messages": messages, **flags}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    assert problem in r.json()["error"]["message"]
