"""llama-server's own routes (/completion, /props, /slots, /apply-template, /tokenize,
/detokenize) answered by the real app in this process, against a scripted coordinator
(tests/support/inprocess_frontend.py): exact bodies and exact event sequences, each derived
by hand from the replies the coordinator was scripted to send."""
from __future__ import annotations

import importlib.metadata
import math

import msgspec
import pytest

from shared import protocol as P
from shared.gguf_file import GGUFFile
from shared.sampling import SamplingParams
from tests.support.inprocess_frontend import (MODEL_PATH, InProcessFrontend, data_lines, done, error, progress,
                                              started, token)

NAMES = ["temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n", "frequency_penalty",
         "presence_penalty", "seed", "logit_bias"]
# llama.cpp's defaults (SamplingParams'), as generation_settings lists them
DEFAULT_SETTINGS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.0,
                    "repeat_last_n": 64, "frequency_penalty": 0.0, "presence_penalty": 0.0, "seed": None,
                    "logit_bias": [], "n_predict": -1, "stop": [], "ignore_eos": False}
BUILD_INFO = f"fermoe {importlib.metadata.version('fermoe')}"
SYSTEM_HI = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]


def error_body(message, type_="invalid_request_error", param=None, code=None, **extra) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code, **extra}}


# ---- /completion ------------------------------------------------------------------------------
def test_completion_answers_llama_servers_fields_with_the_servers_defaults_filled_in():
    """Guards: a field of the answer misnamed or miscounted (tokens_cached, has_new_line, the
    timings' rates), the token -1 (held-back text) listed among the tokens, generation_settings
    showing the request's unset fields instead of the server's --temp / -n, or the Generate
    losing the request's n_predict, top_k, stop, or its unset list."""
    with InProcessFrontend(sampling_defaults={"temperature": 0.3, "top_k": 7}, n_predict=64) as fe:
        fe.coordinator.script(started(9, 4), token(1785, "Hello"), token(5, "\n"), token(3118, "ld"),
                              token(-1, "!"), done("stop", prompt_tokens=9, cached_prompt_tokens=4,
                                                   completion_tokens=3, prefill_ms=10.0, decode_tok_s=50.0))
        r = fe.post("/completion", json={"prompt": "Hi", "n_predict": 3, "top_k": 5, "stop": ["END"],
                                         "return_tokens": True})
        generate = fe.coordinator.generates[0]
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json() == {
        "index": 0, "content": "Hello\nld!", "tokens": [1785, 5, 3118], "id_slot": 0, "stop": True, "model": "tiny",
        "tokens_predicted": 3, "tokens_evaluated": 9,
        "generation_settings": DEFAULT_SETTINGS | {"temperature": 0.3, "top_k": 5, "n_predict": 3, "stop": ["END"]},
        "prompt": "Hi", "has_new_line": True, "truncated": False, "stop_type": "eos", "stopping_word": "",
        "tokens_cached": 12,
        "timings": {"cache_n": 4, "prompt_n": 5, "prompt_ms": 10.0, "prompt_per_token_ms": 2.0,
                    "prompt_per_second": 500.0, "predicted_n": 3, "predicted_ms": 60.0,
                    "predicted_per_token_ms": 20.0, "predicted_per_second": 50.0}}
    assert generate.request_id.startswith("cmpl-") and len(generate.request_id) == 37
    assert (generate.prompt, generate.tokens, generate.max_tokens, generate.stop) == ("Hi", None, 3, ["END"])
    assert generate.sampling == SamplingParams(top_k=5) and generate.grammar is None and generate.logprobs is None
    assert generate.unset == [n for n in NAMES if n != "top_k"]


@pytest.mark.parametrize("ending, stop_type, word", [
    (dict(finish_reason="stop"), "eos", ""), (dict(finish_reason="stop", stop_reason="END"), "word", "END"),
    (dict(finish_reason="length"), "limit", ""), (dict(finish_reason="cancelled"), "none", "")])
def test_completion_stop_types(front, ending, stop_type, word):
    """Guards: a stop string's end read as eos (or an eos as a word), a limit or a cancel named
    wrongly, or the stopping word not passed on."""
    front.coordinator.script(started(3), token(1785, "Hello"), done(**ending, prompt_tokens=3, completion_tokens=1))
    body = front.post("/completion", json={"prompt": "Hi"}).json()
    assert (body["stop_type"], body["stopping_word"], body["content"], body["tokens"]) == (stop_type, word, "Hello", [])


def test_completion_stream_is_chunks_of_text_then_the_whole_answer():
    """Guards: a chunk for a token with no text, the tokens of a textless token lost instead of
    going with the next chunk, token -1 counted as predicted, the last chunk not empty or
    not stop: true, a `[DONE]` llama-server does not send, or a prompt of token ids not shown
    as its text."""
    with InProcessFrontend() as fe:
        fe.coordinator.script(started(2), token(312, "or"), token(5, ""), token(3118, "ld"), token(-1, "!"),
                              done("length", prompt_tokens=2, completion_tokens=3, prefill_ms=4.0,
                                   decode_tok_s=100.0))
        r = fe.post("/completion", json={"prompt": [1785, 324], "stream": True, "return_tokens": True})
        generate = fe.coordinator.generates[0]
    assert (generate.prompt, generate.tokens) == (None, [1785, 324])
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert r.headers["x-request-id"] == generate.request_id
    chunk = {"index": 0, "stop": False, "id_slot": 0, "tokens_evaluated": 0}
    assert data_lines(r.text) == [
        chunk | {"content": "or", "tokens": [312], "tokens_predicted": 1},
        chunk | {"content": "ld", "tokens": [5, 3118], "tokens_predicted": 3},
        chunk | {"content": "!", "tokens": [], "tokens_predicted": 3},                 # token -1: no id
        {"index": 0, "content": "", "tokens": [], "id_slot": 0, "stop": True, "model": "tiny",
         "tokens_predicted": 3, "tokens_evaluated": 2, "generation_settings": DEFAULT_SETTINGS,
         "prompt": "Hello w", "has_new_line": False, "truncated": False, "stop_type": "limit", "stopping_word": "",
         "tokens_cached": 5,
         "timings": {"cache_n": 0, "prompt_n": 2, "prompt_ms": 4.0, "prompt_per_token_ms": 2.0,
                     "prompt_per_second": 500.0, "predicted_n": 3, "predicted_ms": 30.0,
                     "predicted_per_token_ms": 10.0, "predicted_per_second": 100.0}}]


def test_completion_stream_lists_each_chunks_tokens_and_carries_timings_per_token(front):
    """Guards: a chunk's token ids left out (llama-server streams them whatever return_tokens
    says), or timings_per_token not honoured on the chunks."""
    front.coordinator.script(started(2), token(312, "or"), token(3118, "ld"), done("stop", prompt_tokens=2,
                                                                                   completion_tokens=2))
    events = data_lines(front.post("/completion", json={"prompt": "Hi", "stream": True,
                                                        "timings_per_token": True}).text)
    assert [(e["content"], e["tokens"], e["timings"]["predicted_n"]) for e in events] == [
        ("or", [312], 1), ("ld", [3118], 2), ("", [], 2)]
    assert set(events[0]["timings"]) == {"prompt_ms", "predicted_n", "predicted_ms", "predicted_per_token_ms",
                                         "predicted_per_second"}


def test_a_completion_that_fails_is_a_500_whole_and_an_error_event_streamed(front):
    """Guards: a failed generation answered as a success (whole), or its stream closed with the
    final answer instead of the error."""
    front.coordinator.script(started(2), token(1785, "Hello"), done("error", error="the worker died"))
    r = front.post("/completion", json={"prompt": "Hi"})
    assert (r.status_code, r.json()) == (500, error_body("the worker died", "server_error"))
    front.coordinator.script(started(2), token(1785, "Hello"), done("error", error="the worker died"))
    events = data_lines(front.post("/completion", json={"prompt": "Hi", "stream": True}).text)
    assert events == [{"index": 0, "content": "Hello", "tokens": [1785], "stop": False, "id_slot": 0,
                       "tokens_predicted": 1, "tokens_evaluated": 0}, error_body("the worker died", "server_error")]


def test_a_completion_the_coordinator_refuses_is_its_400(front):
    """Guards: an over-long prompt's refusal losing llama-server's n_prompt_tokens and n_ctx, or
    not naming `prompt`."""
    front.coordinator.script(error("the prompt is 300 tokens, over the context's 256", code="context_length_exceeded",
                                   n_prompt_tokens=300, n_ctx=256))
    r = front.post("/completion", json={"prompt": "Hi"})
    assert (r.status_code, r.json()) == (400, error_body("the prompt is 300 tokens, over the context's 256",
                                                         param="prompt", code="context_length_exceeded",
                                                         n_prompt_tokens=300, n_ctx=256))


@pytest.mark.parametrize("prompt, sent, shown", [
    ("Hi", dict(prompt="Hi"), "Hi"),
    (["Hi"], dict(prompt="Hi"), "Hi"),
    ([[1785, 324]], dict(tokens=[1785, 324]), "Hello w"),
    (["Hello", 312, " world"], dict(tokens=[1785, 312, 324, 312, 3118]), "Helloor world")])
def test_completion_prompt_forms(front, prompt, sent, shown):
    """Guards: a prompt of one string in a list sent as tokens, a mixed prompt's strings not
    tokenized in place (or the later ones given a BOS), or the answer's prompt not the text."""
    front.coordinator.script(done("stop"))
    assert front.post("/completion", json={"prompt": prompt}).json()["prompt"] == shown
    generate = front.coordinator.generates[0]
    assert (generate.prompt, generate.tokens) == (sent.get("prompt"), sent.get("tokens"))


@pytest.mark.parametrize("fields, constraint", [
    (dict(grammar='root ::= "a"'), P.Constraint(kind="gbnf", text='root ::= "a"')),
    (dict(json_schema={"type": "object"}), P.Constraint(kind="json_schema", text='{"type": "object"}')),
    (dict(json_schema={}, grammar='root ::= "b"'), P.Constraint(kind="gbnf", text='root ::= "b"')),
    (dict(json_schema="", grammar=""), None)])
def test_completion_grammar_and_json_schema_reach_the_coordinator(front, fields, constraint):
    """Guards: llama-server's grammar or json_schema dropped, or its empty forms taken as a constraint."""
    front.coordinator.script(done("stop"))
    assert front.post("/completion", json={"prompt": "x"} | fields).status_code == 200
    assert front.coordinator.generates[0].grammar == constraint


@pytest.mark.parametrize("raw, expected", [
    (b'{"n_predict": 3}', error_body("Missing required parameter: 'prompt'.", param="prompt",
                                     code="missing_required_parameter")),
    (b'{"prompt": [' + b'"a", ' * 64 + b'"b"]}', error_body("a list of 65 prompts: at most 64 in one request",
                                                             param="prompt", code="invalid_value")),
    (b'{"prompt": [[1], "b", [2, 1.5]]}', error_body("prompt: a mixed prompt holds strings and token ids only",
                                                     param="prompt", code="invalid_value")),
    (b'{"prompt": [5, 4096]}', error_body("prompt: token id 4096 is outside the vocabulary of 4096", param="prompt",
                                          code="invalid_value")),
    (b'{"prompt": []}', error_body("prompt: expected a string, token ids, or a list of both", param="prompt",
                                   code="invalid_value")),
    (b'{"prompt": 5}', error_body("prompt: expected a string, token ids, or a list of both", param="prompt",
                                  code="invalid_value")),
    (b'{"prompt": [1, true]}', error_body("prompt: a mixed prompt holds strings and token ids only",
                                          param="prompt", code="invalid_value")),
    (b'{"prompt": "x", "bogus": 1}', error_body("Unrecognized request argument supplied: bogus", param="bogus",
                                                code="unknown_parameter")),
    (b'{"prompt": "x", "top_k": "a"}', error_body("Invalid 'top_k': Expected `int | null`, got `str`",
                                                  param="top_k", code="invalid_value")),
    (b"not json", error_body("We could not parse the JSON body of your request.", code="invalid_json")),
    (b"[1]", error_body("the request body must be a JSON object", code="invalid_json")),
    (b'{"prompt": "x", "grammar": "root ::= x", "json_schema": {"type": "object"}}',
     error_body("give json_schema or grammar, not both", param="grammar", code="invalid_value")),
    (b'{"prompt": "x", "n_predict": 0}', error_body("n_predict = 0 (evaluate the prompt only) is not supported",
                                                    param="n_predict", code="unsupported_parameter"))])
def test_bad_completions_are_400s_that_never_reach_the_coordinator(front, raw, expected):
    """Guards: a bad body answered by anything but its own 400 (a 500, another field named), or
    sent to the coordinator anyway."""
    r = front.post("/completion", content=raw)
    assert (r.status_code, r.json()) == (400, expected)
    assert front.coordinator.generates == []


# ---- /props, /slots ---------------------------------------------------------------------------
def worker(alive=True, kind="cpu") -> P.WorkerInfo:
    return P.WorkerInfo(worker_id="w", pid=1, threads=1, running=0, alive=alive, kind=kind)


def slot(i, processing, params, n_ctx=4096) -> dict:
    return {"id": i, "id_task": -1, "n_ctx": n_ctx, "speculative": False, "is_processing": processing,
            "params": params, "prompt": "",
            "next_token": {"has_next_token": processing, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                           "stopping_word": ""}}


def test_props_are_the_coordinators_state_and_the_models_tokenizer():
    """Guards: total_slots counting dead or GPU workers (or not multiplying by --max-sequences),
    the defaults not the server's, the model's template, BOS or EOS misread, or the path, alias
    or vision flag not the coordinator's."""
    workers = [worker(), worker(), worker(alive=False), worker(kind="gpu")]
    with InProcessFrontend(n_ctx=4096, max_sequences=2, workers=workers, vision=True, n_predict=64,
                           sampling_defaults={"temperature": 0.3}) as fe:
        r = fe.get("/props")
    f = GGUFFile(MODEL_PATH)
    template = f.metadata["tokenizer.chat_template"]
    f.close()
    assert r.status_code == 200 and r.json() == {
        "default_generation_settings": slot(0, False, DEFAULT_SETTINGS | {"temperature": 0.3, "n_predict": 64}),
        "total_slots": 4, "model_alias": "tiny", "model_path": MODEL_PATH,
        "modalities": {"vision": True, "audio": False}, "chat_template": template, "bos_token": "",
        "eos_token": "<|im_end|>", "build_info": BUILD_INFO, "webui": False, "is_sleeping": False}


def test_props_name_the_alias_and_the_servers_chat_template():
    """Guards: --alias not preferred to the coordinator's name, or --chat-template not the one shown."""
    with InProcessFrontend({"alias": "qwen"}, chat_template="{{ messages[0].content }}") as fe:
        body = fe.get("/props").json()
    assert (body["model_alias"], body["chat_template"], body["total_slots"]) == ("qwen", "{{ messages[0].content }}",
                                                                                  1)
    assert body["default_generation_settings"] == slot(0, False, DEFAULT_SETTINGS, n_ctx=0)


def test_slots_show_the_running_requests_and_fail_on_no_slot_when_all_are_busy():
    """Guards: the wrong slots shown as processing, fail_on_no_slot ignored, or refusing while a
    slot is free."""
    with InProcessFrontend(n_ctx=4096, max_sequences=2, running=1) as fe:
        r = fe.get("/slots")
        assert (r.status_code, r.json()) == (200, [slot(0, True, DEFAULT_SETTINGS), slot(1, False, DEFAULT_SETTINGS)])
        assert fe.get("/slots?fail_on_no_slot=1").status_code == 200
        fe.coordinator.status = msgspec.structs.replace(fe.coordinator.status, running=2)
        r = fe.get("/slots?fail_on_no_slot=1")
        assert (r.status_code, r.json()) == (503, error_body("no slot available", "server_error",
                                                             code="unavailable"))
        r = fe.get("/slots")
        assert (r.status_code, r.json()) == (200, [slot(0, True, DEFAULT_SETTINGS), slot(1, True, DEFAULT_SETTINGS)])


# ---- /apply-template --------------------------------------------------------------------------
@pytest.mark.parametrize("status, fields, prompt", [
    ({}, {}, "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
             "<think>\n"),
    ({}, {"chat_template_kwargs": {"enable_thinking": False}},
     "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
     "<think>\n\n</think>\n\n"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, {},
     "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
     "<think>\n\n</think>\n\n"),
    ({}, {"messages": SYSTEM_HI + [{"role": "assistant", "content": "Sure"}]},
     "<|im_start|>system\nBe brief<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
     "<think>\n\n</think>\n\nSure")])
def test_apply_template_renders_as_the_coordinator_will(status, fields, prompt):
    """Guards: the request's or the server's template variables not applied, or a final
    assistant message not continued (its end of turn left on)."""
    with InProcessFrontend(**status) as fe:
        r = fe.post("/apply-template", json={"messages": SYSTEM_HI} | fields)
    assert (r.status_code, r.json()) == (200, {"prompt": prompt})


@pytest.mark.parametrize("body, expected", [
    ({"messages": [{"role": "system", "content": "x"}]},
     error_body("the chat template rejected the messages: No user query found in messages.")),
    ({"messages": []}, error_body("Invalid 'messages': Expected `array` of length >= 1", param="messages",
                                  code="invalid_value"))])
def test_apply_template_refusals(front, body, expected):
    """Guards: a template's refusal escaping as a 500, or a bad body not named."""
    r = front.post("/apply-template", json=body)
    assert (r.status_code, r.json()) == (400, expected)


# ---- /tokenize, /detokenize -------------------------------------------------------------------
@pytest.mark.parametrize("fields, expected", [
    ({}, {"tokens": [1785, 324, 312, 3118]}),
    ({"add_special": True}, {"tokens": [1785, 324, 312, 3118]}),        # the model has no BOS
    ({"with_pieces": True}, {"tokens": [{"id": 1785, "piece": "Hello"}, {"id": 324, "piece": " w"},
                                        {"id": 312, "piece": "or"}, {"id": 3118, "piece": "ld"}]})])
def test_tokenize(front, fields, expected):
    """Guards: pieces not the tokens' own text, or with_pieces ignored."""
    r = front.post("/tokenize", json={"content": "Hello world"} | fields)
    assert (r.status_code, r.json()) == (200, expected)


def test_tokenize_pieces_of_part_of_a_character_show_the_replacement_character(front):
    """Guards: a piece holding part of a UTF-8 character raising instead of being shown as U+FFFD."""
    r = front.post("/tokenize", json={"content": "é", "with_pieces": True})
    assert r.json() == {"tokens": [{"id": 127, "piece": "\ufffd"}, {"id": 102, "piece": "\ufffd"}]}   # C3, A9


def test_detokenize_and_its_refusals(front):
    """Guards: ids past the vocabulary decoded (or crashing) instead of a 400 naming them."""
    r = front.post("/detokenize", json={"tokens": [1785, 324, 312, 3118]})
    assert (r.status_code, r.json()) == (200, {"content": "Hello world"})
    r = front.post("/detokenize", json={"tokens": [1785, 4096, 5000]})
    assert (r.status_code, r.json()) == (400, error_body("token ids must be in [0, 4096); got [4096, 5000]",
                                                         param="tokens"))
    r = front.post("/detokenize", json={"tokens": [-1]})
    assert (r.status_code, r.json()) == (400, error_body("Invalid 'tokens[0]': Expected `int` >= 0",
                                                         param="tokens[0]", code="invalid_value"))
    r = front.post("/tokenize", json={"content": 5})
    assert (r.status_code, r.json()) == (400, error_body("Invalid 'content': Expected `str`, got `int`",
                                                         param="content", code="invalid_value"))


# ---- logit_bias, n_probs, response_fields ---------------------------------------------------------
@pytest.mark.parametrize("bias, pairs", [
    ([[1785, 2.5]], ((1785, 2.5),)),
    ([[" dumps", -1]], ((82, -1.0), (361, -1.0), (469, -1.0))),        # each of the text's tokens, in id order
    ([[324, False], ["12", 3]], ((12, 3.0), (324, -math.inf))),         # false bans; a digit string is an id
    ({"7": 1.5}, ((7, 1.5),)),                                           # OpenAI's object form
    ([], ())])
def test_completion_logit_bias_forms_reach_the_sampler(front, bias, pairs):
    """Guards: a form misread (text not split into its tokens, false not a ban, the object form
    dropped), or logit_bias left among the fields the server's defaults fill."""
    front.coordinator.script(started(2), token(1785, "Hello"), done("stop", prompt_tokens=2, completion_tokens=1))
    r = front.post("/completion", json={"prompt": "Hi", "logit_bias": bias})
    generate = front.coordinator.generates[-1]
    assert r.status_code == 200 and generate.sampling.logit_bias == pairs
    assert ("logit_bias" in generate.unset) is (not pairs)
    shown = r.json()["generation_settings"]["logit_bias"]
    assert shown == [[t, b if math.isfinite(b) else False] for t, b in pairs]


@pytest.mark.parametrize("bias, message", [
    ([[5, "x"]], "logit_bias: the bias of 5 must be a number or false, got 'x'"),
    ([[5, True]], "logit_bias: the bias of 5 must be a number or false, got True"),
    ([5, 1], 'logit_bias: expected [[token id or "text", bias], ...] or {"token id": bias}'),
    ([[5, 1, 2]], 'logit_bias: expected [[token id or "text", bias], ...] or {"token id": bias}'),
    ([[None, 1]], "logit_bias: expected a token id or a text, got None"),
    ([[5, 100.5]], "logit_bias: token 5: expected an id >= 0 and a bias in [-100, 100] (or a ban), got 100.5"),
    ("no", 'logit_bias: expected [[token id or "text", bias], ...] or {"token id": bias}')])
def test_bad_completion_logit_bias_is_refused_before_the_coordinator(front, bias, message):
    r = front.post("/completion", json={"prompt": "Hi", "logit_bias": bias})
    assert (r.status_code, r.json()) == (400, error_body(message, param="logit_bias", code="invalid_value"))
    assert front.coordinator.generates == []


def test_completion_n_probs_whole_and_streamed(front):
    """Guards: probabilities missing, given for the wrong tokens, or (streamed) repeated in
    every chunk instead of each chunk's own."""
    first = token(1785, "Hello", -0.25, [(1785, -0.25), (312, -1.5)])
    second = token(324, " w", -0.75, [(312, -0.5), (324, -0.75)])
    front.coordinator.script(started(2), first, second, done("length", prompt_tokens=2, completion_tokens=2))
    body = front.post("/completion", json={"prompt": "Hi", "n_probs": 2}).json()
    assert front.coordinator.generates[-1].logprobs == 2

    def entry(i, piece, lp):
        return {"id": i, "token": piece, "bytes": list(piece.encode()), "logprob": lp}
    want = [entry(1785, "Hello", -0.25) | {"top_logprobs": [entry(1785, "Hello", -0.25), entry(312, "or", -1.5)]},
            entry(324, " w", -0.75) | {"top_logprobs": [entry(312, "or", -0.5), entry(324, " w", -0.75)]}]
    assert body["completion_probabilities"] == want
    front.coordinator.script(started(2), first, second, done("length", prompt_tokens=2, completion_tokens=2))
    events = data_lines(front.post("/completion", json={"prompt": "Hi", "n_probs": 2, "stream": True}).text)
    assert [e["completion_probabilities"] for e in events] == [[want[0]], [want[1]], []]


@pytest.mark.parametrize("n_probs, extra, param", [(21, {}, "n_probs"), (-1, {}, "n_probs"), (True, {}, "n_probs"),
                                                   (2, {"post_sampling_probs": True}, "post_sampling_probs")])
def test_completion_n_probs_refusals(front, n_probs, extra, param):
    r = front.post("/completion", json={"prompt": "Hi", "n_probs": n_probs, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    assert front.coordinator.generates == []


def test_completion_response_fields(front):
    """Guards: fields not listed kept, a nested field left nested or under another name than its
    path (llama-server's json_get_nested_values keys it by the path), its order lost."""
    for stream in (False, True):
        front.coordinator.script(started(2), token(1785, "Hello"), done("length", prompt_tokens=2, completion_tokens=1))
        r = front.post("/completion", json={"prompt": "Hi", "n_predict": 1, "stream": stream,
                                            "response_fields": ["stop_type", "generation_settings/n_predict",
                                                                "timings/predicted_n", "nothing/here", "content"]})
        last = data_lines(r.text)[-1] if stream else r.json()
        assert list(last.items()) == [("stop_type", "limit"), ("generation_settings/n_predict", 1),
                                      ("timings/predicted_n", 1),
                                      ("content", "" if stream else "Hello")]


# ---- return_progress ----------------------------------------------------------------------------
PROGRESS = (started(9, 4), progress(4, 0.0), progress(7, 12.5), progress(9, 20.0), token(1785, "Hello"),
            done("length", prompt_tokens=9, cached_prompt_tokens=4, completion_tokens=1))


def test_completion_streams_prompt_progress(front):
    """Guards: return_progress not passed on (the coordinator sends no Progress), or a progress
    chunk in another shape than llama-server's: its total and cache taken from elsewhere than the
    prompt's size and cached part, processed not the Progress's, or the chunk held back until the
    first token."""
    front.coordinator.script(*PROGRESS)
    r = front.post("/completion", json={"prompt": "Hi", "n_predict": 1, "stream": True, "return_progress": True})
    assert front.coordinator.generates[0].return_progress is True
    chunks = data_lines(r.text)
    head = {"index": 0, "content": "", "tokens": [], "stop": False, "id_slot": 0, "tokens_predicted": 0,
            "tokens_evaluated": 9}
    assert chunks[:3] == [head | {"prompt_progress": {"total": 9, "cache": 4, "processed": n, "time_ms": ms}}
                          for n, ms in ((4, 0.0), (7, 12.5), (9, 20.0))]
    assert chunks[3]["content"] == "Hello" and chunks[4]["stop"] is True and len(chunks) == 5


def test_chat_streams_prompt_progress_as_llama_server(front):
    """Guards: the progress chunk's choice not llama-server's role delta (its web page reads
    prompt_progress from a chunk of the stream), or progress asked of the coordinator for a
    request that is not streamed (llama-server reports it in streams only)."""
    front.coordinator.script(*PROGRESS)
    r = front.post("/v1/chat/completions", json={"messages": SYSTEM_HI, "max_tokens": 1, "stream": True,
                                                 "return_progress": True})
    chunks = data_lines(r.text)
    progress_chunks = [c for c in chunks if isinstance(c, dict) and "prompt_progress" in c]
    assert [(c["choices"], c["prompt_progress"]) for c in progress_chunks] == [
        ([{"index": 0, "delta": {"role": "assistant", "content": None}, "logprobs": None, "finish_reason": None}],
         {"total": 9, "cache": 4, "processed": n, "time_ms": ms}) for n, ms in ((4, 0.0), (7, 12.5), (9, 20.0))]
    assert chunks.index(progress_chunks[0]) == 1            # after the opening role chunk, before the text
    front.coordinator.script(started(9, 4), token(1785, "Hello"), done("length", prompt_tokens=9, completion_tokens=1))
    front.post("/v1/chat/completions", json={"messages": SYSTEM_HI, "max_tokens": 1, "return_progress": True})
    assert front.coordinator.generates[1].return_progress is False


# ---- several prompts in one /completion ------------------------------------------------------------
def test_several_prompts_answer_an_array_in_prompt_order(front):
    """Guards: the list refused or taken as one mixed prompt, the answers out of prompt order or
    without their index, a prompt's tokens given to another (the token-id prompt is detokenized
    for its `prompt`), or a refused prompt's error lost among the others' answers."""
    front.coordinator.script(started(2), 0.05, token(1785, "Hello"), done("length", prompt_tokens=2, completion_tokens=1))
    front.coordinator.script(started(3), token(3118, "ld"), done("stop", prompt_tokens=3, completion_tokens=1))
    r = front.post("/completion", json={"prompt": ["Hi", [1785, 11]], "n_predict": 1,
                                        "response_fields": ["index", "content", "prompt", "stop_type"]})
    assert [g.prompt or g.tokens for g in front.coordinator.generates] == ["Hi", [1785, 11]]
    assert r.status_code == 200 and r.json() == [
        {"index": 0, "content": "Hello", "prompt": "Hi", "stop_type": "limit"},
        {"index": 1, "content": "ld", "prompt": "Hello,", "stop_type": "eos"}]
    front.coordinator.script(started(2), token(1785, "Hello"), done("length", prompt_tokens=2, completion_tokens=1))
    front.coordinator.script(error("the prompt is 9 tokens, over the context of 8", code="context_length_exceeded",
                                   n_prompt_tokens=9, n_ctx=8))
    r = front.post("/completion", json={"prompt": ["Hi", "a longer one"], "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["message"] == "the prompt is 9 tokens, over the context of 8"


def test_several_prompts_stream_their_chunks_each_with_its_index(front):
    """Guards: a second set of headers, one prompt's chunks under another's index, or the stream
    ended when the first prompt's is."""
    front.coordinator.script(started(2), token(1785, "Hello"), done("length", prompt_tokens=2, completion_tokens=1))
    front.coordinator.script(started(2), token(3118, "ld"), done("length", prompt_tokens=2, completion_tokens=1))
    r = front.post("/completion", json={"prompt": ["Hi", "Yo"], "n_predict": 1, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
    chunks = [(c["index"], c["content"], c["stop"]) for c in data_lines(r.text)]
    # (the scripted coordinator answers one Generate after the other)
    assert chunks == [(0, "Hello", False), (0, "", True), (1, "ld", False), (1, "", True)]


def test_ignore_eos_bans_the_end_of_generation_tokens_and_shows_their_bias(front):
    """Guards: /completion's ignore_eos taken as vLLM's (end tokens sampled and streamed on)
    instead of llama-server's (banned: a bias of -inf on each end-of-generation token, listed in
    generation_settings as false), or a request's own bias lost beside them."""
    front.coordinator.script(started(2), token(1785, "Hello"), done("length", prompt_tokens=2, completion_tokens=1))
    r = front.post("/completion", json={"prompt": "Hi", "n_predict": 1, "ignore_eos": True,
                                        "logit_bias": [[5, 1.5]]})
    eog = [4070, 4072, 4089, 4090, 4091]            # the tiny model's <|im_end|>, <|endoftext|>, ...
    assert front.coordinator.generates[0].sampling.logit_bias == ((5, 1.5), *((t, -math.inf) for t in eog))
    settings = r.json()["generation_settings"]
    assert settings["logit_bias"] == [[5, 1.5], *([t, False] for t in eog)] and settings["ignore_eos"] is True
