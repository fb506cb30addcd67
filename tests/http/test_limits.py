"""Every limit the front end and the coordinator put on a request, at its edge: the value at
the limit is taken, the next one refused with the right status and a message naming the
field. Fault guarded throughout: a comparison off by one (`>=` for `>`, `<` for `<=`) or a
limit moved, which tests of values far past the limit (21 for 20 is the exception) let
through. In this process where the check lives here; the context length where the
coordinator checks it, in one daemon."""
from __future__ import annotations

import asyncio
import base64
import json
import math
from types import SimpleNamespace

import pytest

from frontend import openai_request
from frontend.anthropic_request import AnthropicError, MessagesRequest
from frontend.anthropic_request import chat_request as anthropic_chat
from frontend.core import Settings, submit
from frontend.errors import APIError
from frontend.responses_request import ResponsesRequest
from frontend.responses_request import chat_request as responses_chat
from shared import protocol as P
from shared.errors import FermoeError
from shared.sampling import MAX_TOP_LOGPROBS
from tests.support.big_png import blank_png
from tests.support.request_units import chat_generate, completion_generate

USER = [{"role": "user", "content": "x"}]


def chat(**fields) -> P.Generate:
    return chat_generate(USER, **fields)


completion = completion_generate


def refused(make, **fields) -> APIError:
    with pytest.raises(APIError) as e:
        make(**fields)
    assert e.value.status == 400
    return e.value


# ---- logprobs and choices ----------------------------------------------------------------------
def test_top_logprobs_on_chat_is_taken_up_to_20():
    assert MAX_TOP_LOGPROBS == 20                                   # OpenAI's limit
    assert chat(logprobs=True, top_logprobs=20).logprobs == 20
    assert chat(logprobs=True, top_logprobs=0).logprobs == 0
    for n in (21, -1):
        e = refused(chat, logprobs=True, top_logprobs=n)
        assert (e.param, e.code, e.message) == ("top_logprobs", "invalid_value", f"top_logprobs must be in [0, 20], "
                                                                                 f"got {n}")


def test_logprobs_on_completions_is_taken_up_to_20():
    assert completion(logprobs=20).logprobs == 20 and completion(logprobs=0).logprobs == 0
    for n in (21, -1):
        e = refused(completion, logprobs=n)
        assert (e.param, e.code, e.message) == ("logprobs", "invalid_value", f"logprobs must be in [0, 20], got {n}")


def test_responses_take_no_top_logprobs_yet():
    base = {"model": "m", "input": "x"}
    for none in (0, None):
        responses_chat(ResponsesRequest.decode(json.dumps(base | {"top_logprobs": none}).encode()))
    with pytest.raises(APIError) as e:
        responses_chat(ResponsesRequest.decode(json.dumps(base | {"top_logprobs": 1}).encode()))
    assert (e.value.status, e.value.param) == (400, "top_logprobs") and "not supported" in e.value.message


@pytest.mark.parametrize("make", [chat, completion])
def test_n_is_taken_from_1_to_16(make):
    for n in (1, 16):
        assert make(n=n).request_id
    for n in (0, 17):
        e = refused(make, n=n)
        assert (e.param, e.code, e.message) == ("n", "invalid_value", f"n must be in [1, 16], got {n}")


def test_best_of_one_is_taken_two_refused():
    assert completion(best_of=1).request_id
    e = refused(completion, best_of=2)
    assert (e.param, e.code, e.message) == ("best_of", "unsupported_parameter", "best_of = 2: only one choice per "
                                                                                "request is supported")


def test_llama_servers_n_probs_is_taken_off_only():
    assert completion(n_probs=0).request_id
    e = refused(completion, n_probs=1)
    assert e.param == "n_probs" and "n_probs = 1" in e.message


# ---- the fields' ranges ---------------------------------------------------------------------------
INT64_MAX = 2**63 - 1
RANGES = [   # (field, the last value taken, the first refused, msgspec's words for the bound)
    ("temperature", 2.0, math.nextafter(2.0, 3), "`float` <= 2.0"),
    ("temperature", 0.0, math.nextafter(0.0, -1), "`float` >= 0.0"),
    ("top_p", 1.0, math.nextafter(1.0, 2), "`float` <= 1.0"),
    ("presence_penalty", 2.0, math.nextafter(2.0, 3), "`float` <= 2.0"),
    ("frequency_penalty", -2.0, math.nextafter(-2.0, -3), "`float` >= -2.0"),
    ("repeat_penalty", 100.0, math.nextafter(100.0, 101), "`float` <= 100.0"),
    ("repeat_penalty", math.nextafter(0.0, 1), 0.0, "`float` > 0.0"),
    ("max_tokens", 1, 0, "`int` >= 1"), ("max_tokens", INT64_MAX, INT64_MAX + 1, f"`int` <= {INT64_MAX}"),
    ("max_completion_tokens", 1, 0, "`int` >= 1"),
    ("top_k", -1, -2, "`int` >= -1"), ("seed", -1, -2, "`int` >= -1"),
    # unbounded, a budget past 2**64 - 1 failed to serialise on its way to the coordinator: a 500
    ("reasoning_budget", -1, -2, "`int` >= -1"),
    ("reasoning_budget", INT64_MAX, INT64_MAX + 1, f"`int` <= {INT64_MAX}"),
    ("stop", ["s"] * 16, ["s"] * 17, "`array` of length <= 16"),
]


@pytest.mark.parametrize("field, last, first, bound", RANGES, ids=[f"{r[0]}={r[2]!r}"[:40] for r in RANGES])
def test_each_chat_fields_range_at_its_edges(field, last, first, bound):
    assert chat(**{field: last}).request_id
    e = refused(chat, **{field: first})
    assert (e.param, e.message) == (field, f"Invalid '{field}': Expected {bound}")


def test_the_seed_takes_64_bits():
    assert chat(seed=2**64 - 1).sampling.seed == 2**64 - 1
    e = refused(chat, seed=2**64)
    assert (e.param, e.message) == ("seed", "Invalid 'seed': Expected `int` <= 18446744073709551615")


ANTHROPIC = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("field, last, first, message", [
    ("max_tokens", 1, 0, "Invalid 'max_tokens': Expected `int` >= 1"),
    ("max_tokens", INT64_MAX, INT64_MAX + 1, f"Invalid 'max_tokens': Expected `int` <= {INT64_MAX}"),
    ("temperature", 1.0, math.nextafter(1.0, 2), "Invalid 'temperature': Expected `float` <= 1.0"),
    ("top_p", 1.0, math.nextafter(1.0, 2), "Invalid 'top_p': Expected `float` <= 1.0"),
    ("stop_sequences", ["s"] * 16, ["s"] * 17, "Invalid 'stop_sequences': Expected `array` of length <= 16"),
    ("thinking", {"type": "enabled", "budget_tokens": 0}, {"type": "enabled", "budget_tokens": -1},
     "thinking.budget_tokens: thinking.budget_tokens: expected an integer >= 0, got -1"),
    ("thinking", {"type": "enabled", "budget_tokens": INT64_MAX}, {"type": "enabled", "budget_tokens": 2**70},
     f"thinking.budget_tokens: expected an integer <= {INT64_MAX}, got {2**70}")])
def test_each_messages_fields_range_at_its_edges(field, last, first, message):
    """Anthropic's own ranges (temperature up to 1.0, not chat's 2.0)."""
    def make(value):
        return anthropic_chat(MessagesRequest.decode(json.dumps(ANTHROPIC | {field: value}).encode()), False)
    assert make(last).messages
    with pytest.raises(AnthropicError) as e:
        make(first)
    assert (e.value.status, e.value.message) == (400, message)


def test_responses_max_output_tokens_at_its_edge():
    base = {"model": "m", "input": "x"}
    assert responses_chat(ResponsesRequest.decode(json.dumps(base | {"max_output_tokens": 1}).encode())).max_tokens == 1
    with pytest.raises(APIError) as e:
        ResponsesRequest.decode(json.dumps(base | {"max_output_tokens": 0}).encode())
    assert (e.value.status, e.value.param) == (400, "max_output_tokens") and ">= 1" in e.value.message


# ---- sizes: the request body, the message to the coordinator, an image's bytes and pixels ---------
BODY_LIMIT = 1000


def padded(size: int, base: dict) -> bytes:
    """`base` of exactly `size` bytes (its user message's text padded), refused for its
    max_tokens of 0 once read."""
    head = json.dumps(base | {"max_tokens": 0, "messages": [{"role": "user", "content": ""}]}).encode()
    at = head.index(b'"content": ""') + len(b'"content": "')
    return head[:at] + b"p" * (size - len(head)) + head[at:]


def test_a_request_body_at_the_limit_is_read_one_byte_more_is_413():
    """Fault guarded: the body limit checked with `>=` refused a body of exactly
    --max-request-size bytes (or `> limit + 1` let one more in), with a Content-Length and
    without (chunked: counted as it comes)."""
    from starlette.testclient import TestClient

    from frontend.app import build_app
    app = build_app(Settings(connect="tcp://127.0.0.1:9", max_request_size=BODY_LIMIT))
    with TestClient(app) as http:
        for path, base in [("/v1/chat/completions", {}), ("/v1/messages", {"model": "m"})]:
            for body in (padded(BODY_LIMIT, base), iter([padded(BODY_LIMIT, base)])):
                at = http.post(path, content=body)
                assert at.status_code == 400 and "max_tokens" in at.json()["error"]["message"], at.text
            assert len(padded(BODY_LIMIT, base)) == BODY_LIMIT
            over = http.post(path, content=padded(BODY_LIMIT + 1, base))
            assert over.status_code == 413 and over.json()["error"]["message"] == (
                "the request body is 1001 bytes, over the limit of 1000 bytes (0.9766 KiB); the server's "
                "--max-request-size raises it"), over.text
            chunked = http.post(path, content=iter([padded(BODY_LIMIT + 1, base)]))
            assert "content-length" not in chunked.request.headers
            assert chunked.status_code == 413 and chunked.json()["error"]["message"] == (
                "the request body is over 1001 bytes, over the limit of 1000 bytes (0.9766 KiB); the server's "
                "--max-request-size raises it"), chunked.text


def test_a_message_to_the_coordinator_at_its_limit_is_sent_one_byte_more_is_413():
    """The coordinator's --max-request-size, when lower than the front end's own. Fault
    guarded: `>=` for `>` in submit() refused a message of exactly the limit."""
    msg = P.Generate(request_id="r", prompt="x" * 500)
    size = len(P.encode(msg))
    sent = []

    async def model_id():
        return "m"

    def server(limit):
        return SimpleNamespace(model_id=model_id, coordinator_limit=limit, settings=Settings(connect="x"),
                               upstream=SimpleNamespace(submit=lambda m, data: sent.append(data) or "stream"))
    assert asyncio.run(submit(server(size), msg))[2] == "stream" and [len(d) for d in sent] == [size]
    with pytest.raises(APIError) as e:
        asyncio.run(submit(server(size - 1), msg))
    assert (e.value.status, e.value.code) == (413, "request_too_large") and len(sent) == 1
    assert e.value.message.startswith(f"the request is {size} bytes as a message to the coordinator, over the limit "
                                      f"of {size - 1} bytes (")
    assert e.value.message.endswith(" KiB); the coordinator's --max-request-size raises it"), e.value.message


# ---- images: their bytes (front end and coordinator), their pixels and the request's ----------------
def data_url(data: bytes) -> dict:
    return {"url": "data:image/png;base64," + base64.b64encode(data).decode()}


def test_an_images_bytes_at_the_limit(vision):
    """The front end refuses at once a data: URL whose payload cannot hold MAX_IMAGE_BYTES
    (its base64 text is longer than that of the largest image taken); the coordinator counts
    the decoded bytes exactly. Fault guarded: either check off by one, in either direction."""
    from shared.vision.chat import plan

    assert P.MAX_IMAGE_BYTES == 20 << 20
    most = openai_request.data_url_bytes("p", data_url(bytes(P.MAX_IMAGE_BYTES)))
    assert len(most) == P.MAX_IMAGE_BYTES
    # MAX + 1 and MAX + 2 bytes are base64 text as long as MAX's: the coordinator's to refuse
    with pytest.raises(APIError) as e:
        openai_request.data_url_bytes("p", data_url(bytes(P.MAX_IMAGE_BYTES + 3)))
    assert (e.value.status, e.value.param, e.value.message) == (
        400, "p", f"image_url: the image is over the limit of {P.MAX_IMAGE_BYTES} bytes")

    tokenizer, cfg = vision
    image = blank_png(64, 64)
    at = image + bytes(P.MAX_IMAGE_BYTES - len(image))                  # a PNG is read to its IEND
    assert len(plan(tokenizer, _chat(at), vision=cfg, max_image_bytes=P.MAX_IMAGE_BYTES).grids) == 1
    with pytest.raises(FermoeError) as e:
        plan(tokenizer, _chat(at + b"\0"), vision=cfg, max_image_bytes=P.MAX_IMAGE_BYTES)
    assert str(e.value) == f"image 1: {P.MAX_IMAGE_BYTES + 1} bytes, over the limit of {P.MAX_IMAGE_BYTES} bytes"


def test_an_images_pixels_at_the_limit():
    """The largest image decoded at all: 64 Mi pixels. Fault guarded: `>=` for `>`."""
    from shared.vision.image import ImageError, ImageLimits, header

    assert ImageLimits().max_input_pixels == 64 << 20
    assert header(blank_png(8192, 8192)) == (8192, 8192)
    with pytest.raises(ImageError) as e:
        header(blank_png(8193, 8192))
    assert str(e.value) == "image: the image is 8193x8192 = 67117056 pixels, over the limit of 67108864 pixels"
    small = ImageLimits(max_input_pixels=64 * 64)
    assert header(blank_png(64, 64), small) == (64, 64)
    with pytest.raises(ImageError, match="^image: the image is 64x65 = 4160 pixels, over the limit of 4096 pixels$"):
        header(blank_png(64, 65), small)


def test_a_requests_pixels_at_the_limit(vision):
    """All the images of a request: 64 Mi pixels together, exactly taken, one more refused
    (before any image is decoded)."""
    from shared.vision.chat import plan
    from shared.vision.image import ImageError, ImageLimits

    tokenizer, cfg = vision
    assert ImageLimits().max_request_pixels == 64 << 20 == 8191 * 8191 + 127 * 129
    big = blank_png(8191, 8191)
    assert len(plan(tokenizer, _chat(big, blank_png(127, 129)), vision=cfg).grids) == 2
    with pytest.raises(ImageError) as e:
        plan(tokenizer, _chat(big, blank_png(128, 128)), vision=cfg)
    assert str(e.value) == ("the request's 2 images hold 67108865 pixels together, over the limit of 67108864 pixels "
                            "a request")


def test_an_images_aspect_ratio_at_the_limit(vision):
    from shared.vision.chat import plan
    from shared.vision.image import ImageError

    tokenizer, cfg = vision
    assert len(plan(tokenizer, _chat(blank_png(400, 2)), vision=cfg).grids) == 1         # 200: taken
    with pytest.raises(ImageError, match=r"^image 1: the image is 402x2: its aspect ratio 201 is over 200$"):
        plan(tokenizer, _chat(blank_png(402, 2)), vision=cfg)


@pytest.fixture(scope="module")
def vision(tmp_path_factory):
    """A tokenizer whose chat template places images (fermoe synth's, Qwen3.5's) and a tower's config."""
    from modeltools.synth import synth
    from modeltools.vision.synth import preset_config
    from shared.model import Model
    path = tmp_path_factory.mktemp("limits") / "m.gguf"
    synth(path, "tiny", layers=2, out_type="q8_0", seed=0, progress=False)
    return Model(path).tokenizer, preset_config("tiny")


def _chat(*images: bytes) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image", "data": d} for d in images] + [{"type": "text",
                                                                                          "text": "What?"}]}]


# ---- the context length: the coordinator's check, through the front end ------------------------------
MAX_MODEL_LEN = 24


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    from tests.support.http_server import HttpDaemon
    d = HttpDaemon(tiny_q4_path, "--max-model-len", str(MAX_MODEL_LEN), "--max-sequences", "1")
    yield d
    assert d.stop() == 0


def test_a_prompt_of_the_whole_context_is_served_one_token_more_is_refused(daemon):
    """A prompt of max_model_len tokens is taken (and gets the one token the context has left),
    one token more is OpenAI's context_length_exceeded, with llama-server's sizes and the
    prompt named. Fault guarded: `>=` for `>` in the coordinator's length check, or the last
    position not run."""
    import httpx
    prompt = list(range(3, 3 + MAX_MODEL_LEN))
    r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": prompt, "max_tokens": 5, "seed": 1,
                                                         "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    assert (r.json()["usage"]["prompt_tokens"], r.json()["usage"]["completion_tokens"]) == (MAX_MODEL_LEN, 1)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    r = httpx.post(f"{daemon.url}/v1/completions", json={"prompt": prompt + [3], "max_tokens": 5}, timeout=120)
    assert r.status_code == 400 and r.json()["error"] == {
        "message": f"the prompt is {MAX_MODEL_LEN + 1} tokens, longer than --max-model-len {MAX_MODEL_LEN}",
        "type": "invalid_request_error", "param": "prompt", "code": "context_length_exceeded",
        "n_prompt_tokens": MAX_MODEL_LEN + 1, "n_ctx": MAX_MODEL_LEN}, r.text
