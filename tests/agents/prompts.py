"""A recorded request (bench/agent_session.py's records) as the daemon sees it: its API's
translation onto the chat path (the front end's own functions), then the prompt's token ids
rendered as the coordinator renders them."""
from __future__ import annotations

import json

from frontend import openai_request
from frontend.anthropic_request import MessagesRequest
from frontend.anthropic_request import chat_request as messages_chat
from frontend.responses_request import ResponsesRequest
from frontend.responses_request import chat_request as responses_chat
from frontend.schemas import ChatCompletionRequest, decode_body
from shared import protocol as P
from shared.chat import reasoning_kwargs
from shared.vision.chat import plan

GENERATION_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


def chat_body(record: dict) -> ChatCompletionRequest:
    """The record's request as a chat completion request, through its API's translation."""
    raw = json.dumps(record["body"]).encode()
    path = record["path"]
    if path == "/v1/messages":
        req = MessagesRequest.decode(raw)
        return messages_chat(req, stream=req.stream)
    if path == "/v1/responses":
        return responses_chat(ResponsesRequest.decode(raw))
    if path == "/v1/chat/completions":
        return decode_body(raw, ChatCompletionRequest)
    raise ValueError(f"not a generation route: {path}")


def generate_of(record: dict) -> P.Generate:
    return openai_request.chat_generate(chat_body(record))


def prompt_ids(record: dict, tokenizer, reasoning: str = "auto", budget: int = -1) -> list[int]:
    msg = generate_of(record)
    kwargs = reasoning_kwargs(msg.chat_template_kwargs, reasoning, budget)
    return plan(tokenizer, msg.messages, msg.tools, kwargs).tokens


def generations(records: list[dict]) -> list[dict]:
    """The records of generation requests, in order."""
    return [r for r in records if r["method"] == "POST" and r["path"] in GENERATION_PATHS]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
