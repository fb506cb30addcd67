"""The OpenAI-compatible HTTP API with real processes on the tiny model: `coordinator
--http` (daemon, worker, uvicorn front end on a free loopback port) driven by the
official `openai` client, and by raw HTTP for the framing, the errors and a fuzz
(disconnects, limits and load: test_http_load.py). Served text is checked against
the same generation computed in this process (tests/http_server.py)."""
from __future__ import annotations

import json
import os
import random
import uuid

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.http_server import HttpDaemon, LocalEngine, sse_events

MAX_SEQUENCES = 4           # a worker decoding several at once, as served (no test here counts on four)
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    d = HttpDaemon(tiny_q4_path, "--max-sequences", str(MAX_SEQUENCES))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def local(tiny_q4_path):
    return LocalEngine(tiny_q4_path)


@pytest.fixture(scope="module")
def client(daemon):
    return OpenAI(base_url=f"{daemon.url}/v1", api_key="unused", max_retries=0, timeout=120)


def post(daemon, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{daemon.url}{path}", content=content, timeout=120, **kw)


def scrape(daemon) -> dict[str, float]:
    """Every sample of /metrics: name{labels} -> value."""
    text = httpx.get(f"{daemon.url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def test_models_and_health(daemon, client, tiny_q4_path):
    models = client.models.list().data
    assert [m.id for m in models] == [os.path.basename(tiny_q4_path)]
    assert client.models.retrieve(models[0].id).id == models[0].id
    assert httpx.get(f"{daemon.url}/health").json()["status"] == "ok"


def test_chat_completion_is_the_local_generation(client, local):
    r = client.chat.completions.create(model="tiny-q4_0", messages=CHAT, max_tokens=12, seed=5, temperature=0.8)
    ids = local.chat_ids(CHAT)
    text, n = local.text(ids, 12, seed=5, temperature=0.8)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("length" if n == 12 else "stop")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)


def test_chat_stream_is_framed_as_openai_frames_it(daemon, client, local):
    text, n = local.text(local.chat_ids(CHAT), 10, seed=6, temperature=0.8)
    chunks = list(client.chat.completions.create(messages=CHAT, max_tokens=10, seed=6, model="tiny-q4_0",
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == text
    finishing = [i for i, c in enumerate(chunks) if c.choices and c.choices[0].finish_reason]
    assert finishing == [len(chunks) - 2]                         # one, just before the usage chunk
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    with httpx.stream("POST", f"{daemon.url}/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "max_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    body = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and "usage" not in c for c in body)   # not asked for


def test_completions_streamed_and_not(client, local):
    prompt = "The old GPU said"
    text, n = local.text(local.tok.encode(prompt), 12, seed=7, temperature=0.8)
    whole = client.completions.create(model="tiny-q4_0", prompt=prompt, max_tokens=12, seed=7)
    assert whole.choices[0].text == text and whole.usage.completion_tokens == n
    chunks = list(client.completions.create(model="tiny-q4_0", prompt=prompt, max_tokens=12, seed=7, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    as_ids = client.completions.create(model="tiny-q4_0", prompt=local.tok.encode(prompt), max_tokens=12, seed=7)
    assert as_ids.choices[0].text == text


def test_seeds_and_penalties_reach_the_sampler(client, local):
    prompt = "Why is the sky blue?"
    ids = local.tok.encode(prompt)
    # penalties that favour repeats: the random tiny model's greedy runs seldom repeat a
    # token, so only these move them, each penalty its own way (checked first)
    cases = [dict(), dict(presence_penalty=-1.0), dict(frequency_penalty=-0.6), dict(repeat_penalty=0.3)]
    expected = [local.text(ids, 16, temperature=0.0, **c)[0] for c in cases]
    assert len(set(expected)) == len(cases)
    for case, text in zip(cases, expected):
        extra = {"repeat_penalty": case.pop("repeat_penalty")} if "repeat_penalty" in case else {}
        r = client.completions.create(model="tiny-q4_0", prompt=prompt, max_tokens=16, temperature=0.0,
                                      extra_body=extra, **case)
        assert r.choices[0].text == text, (case, extra)
    seeded = [client.chat.completions.create(model="tiny-q4_0", messages=CHAT, max_tokens=16, seed=42)
              .choices[0].message.content for _ in range(2)]
    assert seeded[0] == seeded[1] == local.text(local.chat_ids(CHAT), 16, seed=42)[0]


def test_repeated_prompt_is_cached_and_counted(daemon, client):
    prompt = f"A prompt of its own, {uuid.uuid4().hex}, long enough to span a few snapshot blocks."
    first = client.completions.create(model="tiny-q4_0", prompt=prompt, max_tokens=6, seed=1)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    before = scrape(daemon)
    again = client.completions.create(model="tiny-q4_0", prompt=prompt, max_tokens=6, seed=1)
    after = scrape(daemon)
    u = again.usage
    assert u.prompt_tokens_details.cached_tokens == u.prompt_tokens == first.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text

    def grew(name):
        return after[name] - before.get(name, 0.0)
    assert grew("fermoe:prefix_cache_queries_total") == u.prompt_tokens
    assert grew("fermoe:prefix_cache_hits_total") == u.prompt_tokens_details.cached_tokens
    assert grew("fermoe:prompt_tokens_total") == u.prompt_tokens
    assert grew("fermoe:generation_tokens_total") == u.completion_tokens
    assert grew("fermoe:time_to_first_token_seconds_count") == 1
    assert grew("fermoe:inter_token_latency_seconds_count") == u.completion_tokens - 1
    assert grew("fermoe:e2e_request_latency_seconds_count") == 1
    assert grew('fermoe:request_success_total{finished_reason="%s"}' % again.choices[0].finish_reason) == 1
    assert grew("fermoe:snapshot_hits_total") == 1
    assert after["fermoe:num_requests_running"] == after["fermoe:num_requests_waiting"] == 0
    assert after['fermoe:worker_alive{worker_id="cpu0.0"}'] == 1 and after["fermoe:coordinator_up"] == 1
    assert 0 < after["fermoe:snapshot_usage_perc"] <= 1


def test_tokenize_and_detokenize_use_the_models_tokenizer(daemon, local):
    text = "Hello world, the old GPU said."
    ids = local.tok.encode(text)
    assert post(daemon, "/tokenize", {"content": text}).json() == {"tokens": ids}
    pieces = post(daemon, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    assert post(daemon, "/detokenize", {"tokens": ids}).json() == {"content": text}


LONG = {"prompt": [1] * 262145}         # one token past the tiny model's context of 262144
ERRORS = [   # (path, body, status, param or None, a word of the message)
    ("/v1/chat/completions", {}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "length"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "int"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]", "image_url"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 2}, 400, "n", "one choice"),
    ("/v1/chat/completions", {"messages": CHAT, "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature", "str"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 2.5}, 400, "temperature", "2.0"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools", "tools"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True}, 400, "logprobs", "logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "model": "gpt-4o"}, 404, "model", "gpt-4o"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, None, "chat template"),
    ("/v1/chat/completions", b'{"messages": [', 400, None, "JSON"),
    ("/v1/completions", LONG, 400, None, "longer than the model's context length of 262144"),
    ("/v1/completions", LONG | {"stream": True}, 400, None, "longer than"),   # refused before any stream
    ("/v1/completions", {"prompt": [[1], [2]]}, 400, "prompt", "batch"),
    ("/v1/completions", {"prompt": [10**6]}, 400, None, "token ids"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, None, "top_p"),
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "echo"),
    ("/v1/completions", b"x" * (5 << 20), 413, None, "exceeds"),
    ("/tokenize", {"text": "x"}, 400, "text", "Unrecognized"),
    ("/tokenize", {}, 400, "content", "Missing"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens", "token ids"),
]


@pytest.mark.parametrize("path, body, status, param, word", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_requests_get_openai_errors(daemon, path, body, status, param, word):
    r = post(daemon, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and word in error["message"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


def test_wrong_paths_and_methods(daemon):
    assert httpx.get(f"{daemon.url}/v1/nothing").json()["error"]["message"] == "no such endpoint: /v1/nothing"
    r = httpx.get(f"{daemon.url}/v1/chat/completions")
    assert r.status_code == 405 and "GET" in r.json()["error"]["message"]


def _fuzzed(rng: random.Random) -> tuple[str, bytes]:
    """A request that is wrong in one way or another (never a valid one)."""
    path = rng.choice(["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
    valid = {"/v1/chat/completions": {"messages": CHAT, "max_tokens": 1}, "/v1/completions": {"prompt": "x"},
             "/tokenize": {"content": "x"}, "/detokenize": {"tokens": [1]}}[path]
    junk = [None, True, -1, 1e308, "", "x" * rng.randint(1, 50), [], [None], {}, {"a": [1]}, -(2**70)]
    kind = rng.randrange(5)
    body = dict(valid)
    if kind == 0:                               # a known field of another type
        field = rng.choice(list(valid))
        body[field] = rng.choice([v for v in junk if v is not None and type(v) is not type(valid[field])])
    elif kind == 1:                             # an unknown field
        body["".join(rng.choices("abcdefghij_", k=rng.randint(1, 12))) + "_zz"] = rng.choice(junk)
    elif kind == 2:                             # a sampling field out of its range
        body.update(rng.choice([{"temperature": -0.1}, {"top_p": 1.5}, {"n": 3}, {"max_tokens": -5},
                                {"presence_penalty": 9}, {"seed": -7}, {"stop": 5}, {"stream": "yes"}]))
        if path in ("/tokenize", "/detokenize"):
            body["no_such_field"] = 1
    raw = json.dumps(body).encode()
    if kind == 3:                               # cut short: never a whole JSON object
        raw = raw[:rng.randrange(len(raw))]
    elif kind == 4:                             # bytes that are no JSON object
        raw = rng.choice([rng.randbytes(rng.randint(0, 40)), b"[1, 2]", b'"text"', b"null", b"\xff\xfe{"])
    return path, raw


def test_a_thousand_fuzzed_requests_are_each_answered_4xx(daemon):
    rng = random.Random(0)
    with httpx.Client(base_url=daemon.url, timeout=30) as http:
        for _ in range(1000):
            path, raw = _fuzzed(rng)
            r = http.post(path, content=raw)
            assert 400 <= r.status_code < 500 and "message" in r.json()["error"], (path, raw, r.text)
    assert daemon.proc.poll() is None and httpx.get(f"{daemon.url}/health").status_code == 200
    r = post(daemon, "/v1/completions", {"prompt": "after the storm", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
