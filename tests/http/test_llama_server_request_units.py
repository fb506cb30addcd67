"""frontend/llama_server_request.py's details by exact value, called directly: `samplers`'
refusals, a switched-on sampler's refusal, and llama-server's timings (their rounding, a slow
decode rate, the front end's own measure when the coordinator gives none)."""
from __future__ import annotations

import pytest

from frontend import llama_server_request as L
from frontend.errors import APIError
from shared import protocol as P


def refusal(call) -> dict:
    with pytest.raises(APIError) as e:
        call()
    return e.value.status, e.value.body()


def error_body(message, param, code) -> dict:
    return {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}


@pytest.mark.parametrize("samplers, expected", [
    ("tkqz", error_body("samplers: unknown sampler(s) 'q', 'z'", "samplers", "invalid_value")),
    (["temperature", "bogus", "nope"], error_body("samplers: unknown sampler(s) 'bogus', 'nope'", "samplers",
                                                  "invalid_value")),
    ("kp", error_body("samplers without temperature are not supported", "samplers", "unsupported_parameter"))])
def test_samplers_refusals_name_what_is_wrong(samplers, expected):
    """Guards: an unknown sampler (by letter or by name) taken silently, or a refusal's message,
    its list of the unknown ones, or its code other than these."""
    assert refusal(lambda: L._apply_samplers(samplers, {})) == (400, expected)


def test_a_switched_on_sampler_is_refused_saying_what_it_would_do():
    """Guards: the refusal of a sampler we lack not saying which sampler the field turns on."""
    body = L.LlamaServerFields(dry_multiplier=0.5)
    assert refusal(lambda: L.apply(body, {})) == (400, error_body(
        "dry_multiplier = 0.5 asks for the DRY sampler, which is not supported (leave it out, or at llama.cpp's "
        "default that turns it off)", "dry_multiplier", "unsupported_parameter"))


def test_times_and_rates_round_to_the_microsecond_and_zero_where_nothing_was_measured():
    """Guards: a time or a rate rounded otherwise than to 3 decimals, or a per-token time or a
    rate of nothing (no tokens, no time) shown as anything but 0.0; a time under 1 ms giving
    no rate."""
    assert (L._ms(0.00123456), L._per(10.0, 3), L._rate(1, 3.0)) == (1.235, 3.333, 333.333)
    assert (L._per(5.0, 0), L._rate(3, 0.0), L._rate(1, 0.5)) == (0.0, 0.0, 2000.0)


def test_final_timings_use_a_slow_decode_rate_and_else_the_tokens_own_times():
    """Guards: a decode rate under 1 token/s ignored, or without one the time from the first token
    to the last misread (added, or dropped for 0), or a request with no token given a time."""
    done = P.Done(request_id="r", finish_reason="length", prompt_tokens=3, completion_tokens=1, decode_tok_s=0.5)
    assert L.Timings().final(done)["predicted_ms"] == 2000.0
    t = L.Timings()
    t.token(10.0)
    t.token(10.25)
    done = P.Done(request_id="r", finish_reason="length", prompt_tokens=3, completion_tokens=2)
    assert (t.final(done)["predicted_ms"], L.Timings().final(done)["predicted_ms"]) == (250.0, 0.0)


def test_each_sampler_we_lack_is_refused_when_on_and_taken_at_its_off_value():
    """Guards: a setting that changes the output let through (or one at llama.cpp's off value
    refused) at its bound: XTC's threshold 0.5 (it acts up to 0.5), top-n-sigma 0, min_keep 1;
    or a refusal not saying what the field would do."""
    on = L.LlamaServerFields(dry_multiplier=0.5, xtc_probability=0.1, xtc_threshold=0.5, mirostat=2, typical_p=0.9,
                             dynatemp_range=0.5, top_n_sigma=0.5, min_keep=2, n_probs=3, n_indent=2, n_cmpl=2,
                             t_max_predict_ms=100, lora=[{"id": 0}])
    assert L._switched_on(on) == [
        ("dry_multiplier", "the DRY sampler"), ("xtc_probability", "the XTC sampler"),
        ("mirostat", "mirostat 2 sampling"), ("typical_p", "locally typical sampling"),
        ("dynatemp_range", "dynamic temperature"), ("top_n_sigma", "the top-n-sigma sampler"),
        ("min_keep", "a minimum of tokens every sampler keeps"),
        ("n_probs", "token probabilities (give logprobs and top_logprobs here)"),
        ("n_indent", "a minimum line indentation"),
        ("n_cmpl", "2 completions (only one choice per request is supported)"),
        ("t_max_predict_ms", "a time limit on generation"), ("lora", "LoRA adapters")]
    off = L.LlamaServerFields(dry_multiplier=0.0, xtc_probability=0.1, xtc_threshold=0.6, mirostat=0, typical_p=1.0,
                              dynatemp_range=0.0, top_n_sigma=0.0, min_keep=1, n_probs=0, n_indent=0, n_cmpl=1,
                              t_max_predict_ms=0, lora=[])
    assert L._switched_on(off) == []


def test_repeat_last_n_below_minus_one_is_refused():
    """Guards: repeat_last_n -2 taken (only -1, the whole context, is below 0), or its refusal's
    code other than invalid_value."""
    assert refusal(lambda: L.apply(L.LlamaServerFields(repeat_last_n=-2), {})) == (400, error_body(
        "repeat_last_n = -2: expected -1 (the whole context), 0 (off) or a number of tokens", "repeat_last_n",
        "invalid_value"))


def test_return_progress_of_a_body_that_cannot_stream_is_not_asked(caplog):
    """Guards: progress asked of the coordinator for a body without `stream` (progress is
    streamed only), or the fields that change nothing not logged by name, once."""
    caplog.set_level("INFO", logger="fermoe.http")
    assert L.apply(L.LlamaServerFields(return_progress=True, cache_prompt=True, id_slot=1), {}) == {}
    assert [r.getMessage() for r in caplog.records] == ["ignored llama-server fields: cache_prompt, id_slot"]


@pytest.mark.parametrize("fields, expected", [
    ({"json_schema": 5}, error_body("json_schema must be a JSON schema object", "json_schema", "invalid_type")),
    ({"json_schema": "{}"}, error_body("json_schema must be a JSON schema object", "json_schema", "invalid_type")),
    ({"grammar": ["root ::= x"]}, error_body("grammar must be a string (GBNF)", "grammar", "invalid_type"))])
def test_a_constraint_of_the_wrong_type_is_refused(fields, expected):
    """Guards: a json_schema that is not an object (a number, a JSON text) or a grammar that is
    not a string sent on to the coordinator, or refused in other words."""
    assert refusal(lambda: L.constraint(L.LlamaServerFields(**fields))) == (400, expected)


def test_a_json_schema_of_true_is_a_constraint():
    """Guards: the schema `true` (anything) refused as not an object."""
    assert L.constraint(L.LlamaServerFields(json_schema=True)) == P.Constraint(kind="json_schema", text="true")
