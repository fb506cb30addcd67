"""The OpenAI-compatible HTTP API with real processes on the tiny model: `coordinator
--http` (daemon, worker, uvicorn front end on a free loopback port) driven by the
official `openai` client, and by raw HTTP for the framing, the errors and a fuzz
(disconnects, limits and load: test_http_load.py). Served text is checked against
the same generation computed in this process (tests/http_server.py)."""
from __future__ import annotations

import json
import math
import random
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.http_server import HttpDaemon, LocalEngine, sse_events
from tests.support.serving_harness import wait_until

MAX_SEQUENCES = 4           # a worker decoding several at once, as served (no test here counts on four)
MAX_REQUEST = 4 << 20       # --max-request-size: small enough to exceed cheaply, above the old 1 MiB message cap
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Why is the sky blue?"}]
TOOLS = [{"type": "function", "function": {"name": "pydoc", "description": "A docstring",
                                           "parameters": {"type": "object", "properties": {"name": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def daemon(tiny_q4_path):
    d = HttpDaemon(tiny_q4_path, "--max-sequences", str(MAX_SEQUENCES), "--max-request-size", str(MAX_REQUEST))
    yield d
    assert d.stop() == 0


@pytest.fixture(scope="module")
def local(tiny_q4_path):
    return LocalEngine(tiny_q4_path)


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
    assert [m.id for m in models] == [str(tiny_q4_path)]                   # --model as given, as llama-server
    assert client.models.retrieve(models[0].id).id == models[0].id
    assert client.models.retrieve("gpt-4o").id == models[0].id             # one model, under any name
    assert httpx.get(f"{daemon.url}/models").json()["data"][0]["id"] == models[0].id
    for path in ("/health", "/v1/health"):
        assert httpx.get(f"{daemon.url}{path}").json()["status"] == "ok"


def test_any_model_name_is_the_model_served(daemon, client, tiny_q4_path):
    r = client.chat.completions.create(model="gpt-4o", messages=CHAT, max_tokens=2)
    assert r.model == str(tiny_q4_path) and r.choices[0].finish_reason in ("length", "stop")
    for path, body in [("/chat/completions", {"messages": CHAT}), ("/completions", {"prompt": "x"})]:
        r = post(daemon, path, body | {"model": "tiny", "max_tokens": 2, "seed": 1})
        assert r.status_code == 200 and r.json()["model"] == str(tiny_q4_path), (path, r.text)
        assert r.json()["choices"] == post(daemon, f"/v1{path}", body | {"max_tokens": 2, "seed": 1}).json()["choices"]


def test_system_fingerprint_and_timings(daemon, client):
    whole = client.completions.create(model="x", prompt="The old GPU said", max_tokens=4, seed=2,
                                      extra_body={"ignore_eos": True})
    fingerprint = whole.system_fingerprint
    assert fingerprint.startswith("fp_") and len(fingerprint) == 13
    t = whole.model_extra["timings"]
    assert t["prompt_n"] + t["cache_n"] == whole.usage.prompt_tokens and t["predicted_n"] == 4
    assert t["prompt_ms"] > 0 and t["predicted_per_second"] > 0
    with httpx.stream("POST", f"{daemon.url}/v1/chat/completions", timeout=60,
                      json={"messages": CHAT, "n_predict": 5, "max_tokens": 40, "ignore_eos": True, "stream": True,
                            "timings_per_token": True, "cache_prompt": True, "id_slot": -1}) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    assert {c["system_fingerprint"] for c in chunks} == {fingerprint}
    texts = [c for c in chunks if c["choices"][0]["delta"].get("content")]
    counts = [c["timings"]["predicted_n"] for c in texts]         # a token of no text yet makes no chunk
    assert counts == sorted(set(counts)) and 1 <= counts[0] and counts[-1] <= 5
    assert all(c["timings"]["predicted_ms"] >= 0 and c["timings"]["prompt_ms"] > 0 for c in texts)
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length" and last["timings"]["predicted_n"] == 5
    assert set(last["timings"]) == {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second",
                                    "predicted_n", "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    assert "timings" not in chunks[0]


def test_cors_lets_any_page_call_by_default(daemon):
    origin = {"Origin": "http://page.example:3000"}
    pre = httpx.options(f"{daemon.url}/v1/chat/completions", headers=origin | {
        "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"})
    # as llama-server answers: 200, the origin reflected with credentials allowed, DELETE among the methods
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://page.example:3000"
    assert pre.headers["access-control-allow-credentials"] == "true"
    assert pre.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
    assert pre.headers["access-control-allow-headers"] == "authorization, content-type"
    bare = httpx.options(f"{daemon.url}/v1/chat/completions", headers=origin | {"Access-Control-Request-Method": "POST"})
    assert bare.status_code == 200 and bare.headers["access-control-allow-headers"] == "*"
    r = httpx.get(f"{daemon.url}/v1/models", headers=origin)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://page.example:3000"
    assert r.headers["access-control-allow-credentials"] == "true"
    assert "access-control-allow-origin" not in httpx.get(f"{daemon.url}/v1/models").headers   # not a page


def test_the_chat_page_has_its_icon(daemon):
    assert '<link rel="icon" type="image/svg+xml" href="favicon.ico">' in httpx.get(daemon.url).text
    r = httpx.get(f"{daemon.url}/favicon.ico")
    assert r.status_code == 200 and r.headers["content-type"] == "image/svg+xml" and r.text.startswith("<svg")


def test_an_over_long_prompt_is_context_length_exceeded(daemon):
    chat = post(daemon, "/v1/chat/completions", {"messages": [{"role": "user", "content": "sky blue " * 140000}]})
    text = post(daemon, "/v1/completions", {"prompt": [1] * 262145})
    for r, param in [(chat, "messages"), (text, "prompt")]:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert (error["code"], error["param"], error["n_ctx"]) == ("context_length_exceeded", param, 262144)
        assert error["n_prompt_tokens"] > 262144 and error["type"] == "invalid_request_error"
        assert f"{error['n_prompt_tokens']} tokens" in error["message"] and "262144" in error["message"]
    assert text.json()["error"]["n_prompt_tokens"] == 262145


def test_a_request_over_1_mib_within_the_limit_reaches_the_coordinator(daemon):
    prompt = "The old GPU said hello to the new one. " * 54000                    # 2.1 MB: 972k tokens
    r = post(daemon, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    body = json.dumps({"prompt": "x" * MAX_REQUEST})
    r = post(daemon, "/v1/completions", body)
    assert r.status_code == 413, r.text
    message = r.json()["error"]["message"]
    assert f"is {len(body)} bytes, over the limit of {MAX_REQUEST} bytes (4 MiB)" in message
    assert "--max-request-size" in message and r.json()["error"]["code"] == "request_too_large"


def test_chat_completion_is_the_local_generation(client, local):
    r = client.chat.completions.create(model="tiny-q4_0", messages=CHAT, max_tokens=12, seed=5, temperature=0.8)
    ids = local.chat_ids(CHAT)
    text, n = local.text(ids, 12, seed=5, temperature=0.8)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("length" if n == 12 else "stop")
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), n, len(ids) + n)


def test_logprobs_in_openais_shapes_streamed_and_not(client, local):
    """Chat: each token's text, bytes, logprob and top_logprobs; a stream's chunks carry
    the same list in pieces. Completions: the legacy lists. The tokens' bytes make the
    text; the most likely tokens' probabilities sum to at most 1."""
    kwargs = dict(model="tiny-q4_0", messages=CHAT, max_tokens=10, seed=8, temperature=0.8, logprobs=True,
                  top_logprobs=4)
    whole = client.chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 10
    assert b"".join(bytes(t.bytes) for t in content).decode(errors="replace") == whole.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 4
        assert t.top_logprobs[0].logprob >= t.logprob and sum(math.exp(x.logprob) for x in t.top_logprobs) <= 1.0001
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in content]
    text = client.completions.create(model="tiny-q4_0", prompt="The old GPU said", max_tokens=6, seed=2,
                                     logprobs=2)
    lp = text.choices[0].logprobs
    assert "".join(lp.tokens) == text.choices[0].text and len(lp.token_logprobs) == 6
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0
    plain = client.chat.completions.create(model="tiny-q4_0", messages=CHAT, max_tokens=2, seed=8)
    assert plain.choices[0].logprobs is None


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


def test_tools_history_and_template_settings_reach_the_template(client, local):
    """The built-in model's ChatML template renders no tools: the prompt is the one the template
    makes of the history (its calls and reasoning carried to the coordinator), and
    chat_template_kwargs / reasoning_effort reach it (enable_thinking=false pre-fills <think>)."""
    history = CHAT + [{"role": "assistant", "content": "Let me look.", "reasoning_content": "hmm",
                       "tool_calls": [{"id": "call_1", "type": "function",
                                       "function": {"name": "pydoc", "arguments": '{"name": "os.path"}'}}]},
                      {"role": "developer", "content": "Answer now."}]
    r = client.chat.completions.create(model="m", messages=history, tools=TOOLS, tool_choice="auto", max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    rendered = local.tok.apply_chat_template([*CHAT, {"role": "assistant", "content": "Let me look."},
                                              {"role": "system", "content": "Answer now."}], enable_thinking=False)
    assert r.usage.prompt_tokens == len(local.tok.encode(rendered))
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    off = client.chat.completions.create(model="m", messages=CHAT, max_tokens=1, reasoning_effort="none")
    assert off.usage.prompt_tokens == len(local.chat_ids(CHAT)) + len(local.tok.encode("<think>\n\n</think>\n\n"))


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
    # llama-server's names: only the tokens evaluated count as prompt processed (none: all cached)
    assert grew("llamacpp:prompt_tokens_total") == u.prompt_tokens - u.prompt_tokens_details.cached_tokens == 0
    assert grew("llamacpp:tokens_predicted_total") == u.completion_tokens
    assert after["llamacpp:requests_processing"] == after["llamacpp:requests_deferred"] == 0
    assert after["fermoe:num_requests_running"] == after["fermoe:num_requests_waiting"] == 0
    assert after['fermoe:worker_alive{worker_id="cpu0.0"}'] == 1 and after["fermoe:coordinator_up"] == 1
    assert 0 < after["fermoe:snapshot_usage_perc"] <= 1
    # the two pools: KV slots and state slots, and how many entries hold a state
    assert after["fermoe:snapshot_slots"] > after["fermoe:snapshot_state_slots"] >= 4
    assert 0 < after["fermoe:snapshot_states"] <= after["fermoe:snapshot_entries"]
    assert after["fermoe:snapshot_free_state_slots"] < after["fermoe:snapshot_state_slots"]


def test_tokenize_and_detokenize_use_the_models_tokenizer(daemon, local):
    text = "Hello world, the old GPU said."
    ids = local.tok.encode(text)
    assert post(daemon, "/tokenize", {"content": text}).json() == {"tokens": ids}
    pieces = post(daemon, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids and "".join(p["piece"] for p in pieces) == text
    assert post(daemon, "/detokenize", {"tokens": ids}).json() == {"content": text}


ERRORS = [   # (path, body, status, param or None, a word of the message)
    ("/v1/chat/completions", {}, 400, "messages", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages", "length"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "robot"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "int"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     400, "messages[0].content[0]", "image_url"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 17}, 400, "n", "n must be in [1, 16]"),
    ("/v1/chat/completions", {"messages": CHAT, "frobnicate": 1}, 400, "frobnicate", "Unrecognized"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": "hot"}, 400, "temperature", "str"),
    ("/v1/chat/completions", {"messages": CHAT, "temperature": 2.5}, 400, "temperature", "2.0"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function.name",
     "function.name"),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "auto"}, 400, "tool_choice", "'tools'"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": {"type": "function",
                                                                               "function": {"name": "nope"}}},
     400, "tool_choice", "'nope'"),
    ("/v1/chat/completions", {"messages": CHAT, "tools": TOOLS, "tool_choice": "required",
                              "response_format": {"type": "json_object"}}, 400, "response_format", "forces a call"),
    ("/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, 400, "response_format.json_schema.schema", "objekt"),
    ("/v1/chat/completions", {"messages": CHAT + [{"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "pydoc", "arguments": "{"}}]}]}, 400,
     "messages[2].tool_calls[0].function.arguments", "JSON"),
    ("/v1/chat/completions", {"messages": CHAT, "top_logprobs": 3}, 400, "top_logprobs", "needs logprobs: true"),
    ("/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "[0, 20]"),
    ("/v1/completions", {"prompt": "x", "logprobs": 3.5}, 400, "logprobs", "integer"),
    ("/v1/chat/completions", {"messages": CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options",
     "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "seed": 2**64}, 400, "seed", "18446744073709551615"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2**64}, 400, "max_tokens", "<="),
    ("/v1/chat/completions", {"messages": CHAT, "top_k": -(2**70)}, 400, "top_k", ">= -1"),
    ("/v1/chat/completions", {"messages": CHAT, "n_predict": 2**64}, 400, "n_predict", "<="),
    ("/v1/chat/completions", {"messages": CHAT, "mirostat": 2}, 400, "mirostat", "mirostat"),
    ("/v1/chat/completions", {"messages": CHAT, "samplers": ["dry", "tfs_z"]}, 400, "samplers", "tfs_z"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "42"}]}, 400, None, "chat template"),
    ("/v1/chat/completions", b'{"messages": [', 400, None, "JSON"),
    ("/v1/completions", {"prompt": [1] * 262145, "stream": True}, 400, "prompt", "longer than"),  # before a stream
    ("/v1/completions", {"prompt": [[1], [2]]}, 400, "prompt", "batch"),
    ("/v1/completions", {"prompt": [10**6]}, 400, None, "token ids"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p", "top_p"),    # the sampler's range, within the API's
    ("/v1/completions", {"prompt": "x", "echo": True}, 400, "echo", "echo"),
    ("/v1/completions", b"x" * (MAX_REQUEST + 1), 413, None, "--max-request-size"),
    ("/detokenize", {"tokens": [2**64]}, 400, "tokens[0]", "<="),
    ("/tokenize", {"text": "x"}, 400, "text", "Unrecognized"),
    ("/tokenize", {}, 400, "content", "Missing"),
    ("/detokenize", {"tokens": [10**6]}, 400, "tokens", "token ids"),
]


@pytest.mark.parametrize("path, body, status, param, word", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_bad_requests_get_openai_errors(daemon, path, body, status, param, word):
    r = post(daemon, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error) and word in error["message"]
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
        body.update(rng.choice([{"temperature": -0.1}, {"top_p": 1.5}, {"n": 17}, {"max_tokens": -5},
                                {"presence_penalty": 9}, {"seed": -7}, {"stop": 5}, {"stream": "yes"},
                                {"seed": 2**64 + rng.randrange(2**80)}, {"max_tokens": 2**63},
                                {"top_k": rng.choice([2**64, -(2**70)])}, {"n_predict": 2**70},
                                {"id_slot": -(2**64)}, {"n_keep": 2**90}, {"dry_multiplier": 1.5}]))
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


def test_every_refusal_leaves_one_line_in_the_daemons_log_without_the_body(daemon):
    """Fault guarded: a 4xx or 5xx from the front end left no trace in the daemon's log."""
    secret = "a-string-only-the-body-holds"
    cases = [("/v1/chat/completions", {"messages": [{"role": "user", "content": secret}], "max_tokens": -7}, 400),
             ("/v1/completions", {"prompt": [10**9], "max_tokens": 2, "user": secret}, 400),
             ("/v1/no-such-route", {"prompt": secret}, 404)]
    for path, body, status in cases:
        assert httpx.post(f"{daemon.url}{path}", json=body, timeout=60).status_code == status
        line = wait_until(lambda: next((l for l in daemon.log if f"POST {path} -> {status}: " in l), None), 10,
                          f"the log line of {path}'s {status}")
        assert len(line.split(" -> ")[1]) > 6 and secret not in line, line
    assert not any(secret in line for line in daemon.log)
