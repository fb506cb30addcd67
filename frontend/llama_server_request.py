"""llama-server's request extensions, on /v1/chat/completions and /v1/completions as
llama-server takes them (its web page and many clients send them on every request).

Each is one of three kinds:

- honoured: `n_predict` (max_tokens; -1 until the end), `timings_per_token` (a
  `timings` object in every stream chunk), `return_progress` (streamed: a chunk with
  `prompt_progress` {total, cache, processed, time_ms} when the prompt is looked up in the
  cache, then after each forward pass over it), `samplers` (a sampler we have that the
  list leaves out is not used, as llama-server leaves it out), and on chat
  `chat_template_kwargs` (the template's variables) and `reasoning_format`
  (--reasoning-format for one request);
- accepted and logged, once per request ("ignored llama-server fields: ..."): what
  changes nothing here (`cache_prompt`: every prompt is cached; `id_slot`; `n_keep`,
  there is no context shift), or a sampler's parameter while that sampler is off;
- refused with a 400 naming it: a setting that would change the output and that we
  cannot honour (a DRY, XTC, mirostat, typical-p or dynamic-temperature sampler
  switched on, `n_probs`, a grammar...). Their off values are llama.cpp's defaults.

The `timings` object is llama-server's, in milliseconds: `prompt_n` prompt tokens
processed (`cache_n` more came from the prefix cache), `predicted_n` tokens
generated, with their times and rates. The final response and the last stream chunk
carry it whole, from the coordinator's own measures; per-token chunks carry what is
known while tokens come (prompt_ms as time to the first token, the predicted_*
fields), as the prompt's token count is known only at the end here.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from shared import protocol as P
from shared.sampling import WHOLE_CONTEXT

from .errors import APIError
from .fields import Body, Int, NPredict

log = logging.getLogger("fermoe.http")

# llama.cpp's sampler names (common_sampler_types_from_names) and one-letter codes
# (common_sampler_types_from_chars), as llama-server's `samplers` takes them
SAMPLER_NAMES = {"penalties": "penalties", "dry": "dry", "top_n_sigma": "top_n_sigma", "top-n-sigma": "top_n_sigma",
                 "top_k": "top_k", "top-k": "top_k", "typ_p": "typ_p", "typ-p": "typ_p", "typical_p": "typ_p",
                 "typical-p": "typ_p", "typical": "typ_p", "typ": "typ_p", "top_p": "top_p", "top-p": "top_p",
                 "nucleus": "top_p", "min_p": "min_p", "min-p": "min_p", "xtc": "xtc", "temperature": "temperature",
                 "temp": "temperature", "infill": "infill"}
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                 "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
# ours, and the value that turns each off when a `samplers` list leaves it out
OUR_SAMPLERS = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


class LlamaServerFields(Body):
    """The llama-server fields both endpoints accept (None: not sent)."""
    n_predict: NPredict | None = None
    timings_per_token: bool | None = None
    samplers: list[str] | str | None = None
    return_progress: bool | None = None
    # no effect here
    cache_prompt: bool | None = None
    id_slot: Int | None = None
    n_keep: Int | None = None
    n_discard: Int | None = None
    n_cache_reuse: Int | None = None
    return_tokens: bool | None = None
    verbose: bool | None = None
    post_sampling_probs: bool | None = None
    response_fields: list[str] | None = None
    sse_ping_interval: float | None = None
    repeat_last_n: Int | None = None
    # samplers we lack: accepted while off (llama.cpp's defaults), refused when on
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: Int | None = None
    dry_penalty_last_n: Int | None = None
    dry_sequence_breakers: list[str] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    mirostat: Int | None = None
    mirostat_tau: float | None = None
    mirostat_eta: float | None = None
    typical_p: float | None = None
    dynatemp_range: float | None = None
    dynatemp_exponent: float | None = None
    top_n_sigma: float | None = None
    min_keep: Int | None = None
    # features we lack: accepted while off
    n_probs: Int | None = None
    n_indent: Int | None = None
    n_cmpl: Int | None = None
    t_max_predict_ms: Int | None = None
    grammar: Any = None
    json_schema: Any = None
    lora: list[Any] | None = None
    # honoured on chat
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: str | None = None


FIELDS = LlamaServerFields.__struct_fields__
# read here, or by the chat endpoint (chat_template_kwargs, reasoning_format)
HONOURED = ("n_predict", "timings_per_token", "samplers", "repeat_last_n", "chat_template_kwargs", "reasoning_format",
            "response_fields", "return_progress")


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param, code="unsupported_parameter")


def constraint(b: LlamaServerFields) -> P.Constraint | None:
    """llama-server's `json_schema` (an object) or `grammar` (GBNF) as a Constraint, on any
    route; the coordinator compiles it before queueing (a bad one is a 400, invalid_grammar)."""
    schema = None if b.json_schema in ("", {}) else b.json_schema
    grammar = b.grammar or None
    if schema is not None and grammar is not None:
        raise APIError(400, "give json_schema or grammar, not both", param="grammar", code="invalid_value")
    if schema is not None:
        if not isinstance(schema, (dict, bool)):
            raise APIError(400, "json_schema must be a JSON schema object", param="json_schema", code="invalid_type")
        return P.Constraint(kind="json_schema", text=json.dumps(schema))
    if grammar is not None and not isinstance(grammar, str):
        raise APIError(400, "grammar must be a string (GBNF)", param="grammar", code="invalid_type")
    return None if grammar is None else P.Constraint(kind="gbnf", text=grammar)


def _switched_on(b: LlamaServerFields) -> list[tuple[str, str]]:
    """(field, what it would do) for every setting that changes the output and that we cannot honour."""
    on = []
    if b.dry_multiplier:
        on.append(("dry_multiplier", "the DRY sampler"))
    if b.xtc_probability and (b.xtc_threshold is None or b.xtc_threshold <= 0.5):
        on.append(("xtc_probability", "the XTC sampler"))
    if b.mirostat:
        on.append(("mirostat", f"mirostat {b.mirostat} sampling"))
    if b.typical_p is not None and b.typical_p < 1.0:
        on.append(("typical_p", "locally typical sampling"))
    if b.dynatemp_range is not None and b.dynatemp_range > 0:
        on.append(("dynatemp_range", "dynamic temperature"))
    if b.top_n_sigma is not None and b.top_n_sigma > 0:
        on.append(("top_n_sigma", "the top-n-sigma sampler"))
    if b.min_keep is not None and b.min_keep > 1:
        on.append(("min_keep", "a minimum of tokens every sampler keeps"))
    if b.n_probs:                   # /completion takes it before this; the OpenAI routes have logprobs
        on.append(("n_probs", "token probabilities (give logprobs and top_logprobs here)"))
    if b.n_indent:
        on.append(("n_indent", "a minimum line indentation"))
    if b.n_cmpl is not None and b.n_cmpl != 1:
        on.append(("n_cmpl", f"{b.n_cmpl} completions (only one choice per request is supported)"))
    if b.t_max_predict_ms:
        on.append(("t_max_predict_ms", "a time limit on generation"))
    if b.lora:
        on.append(("lora", "LoRA adapters"))
    return on


def apply(body, sampling: dict) -> dict:
    """Check `body`'s llama-server fields and fold the honoured ones into `sampling` (the
    Generate's keyword arguments, from the OpenAI fields); refuses what cannot be honoured."""
    on = _switched_on(body)
    if on:
        field, what = on[0]
        raise _refuse(field, f"{field} = {getattr(body, field)!r} asks for {what}, which is not supported "
                             f"(leave it out, or at llama.cpp's default that turns it off)")
    if body.repeat_last_n is not None:
        if body.repeat_last_n < -1:
            raise APIError(400, f"repeat_last_n = {body.repeat_last_n}: expected -1 (the whole context), 0 (off) "
                                f"or a number of tokens", param="repeat_last_n", code="invalid_value")
        sampling["repeat_last_n"] = WHOLE_CONTEXT if body.repeat_last_n == -1 else body.repeat_last_n
    if body.n_predict is not None:
        if body.n_predict == 0:
            raise _refuse("n_predict", "n_predict = 0 (evaluate the prompt only) is not supported")
        sampling["max_tokens"] = None if body.n_predict == -1 else body.n_predict
    if body.samplers is not None:
        _apply_samplers(body.samplers, sampling)
    if body.return_progress and getattr(body, "stream", False):    # progress is streamed only, as llama-server's
        sampling["return_progress"] = True
    ignored = [f for f in FIELDS if f not in HONOURED and getattr(body, f) is not None]
    if ignored:
        log.info("ignored llama-server fields: %s", ", ".join(ignored))
    return sampling


def _apply_samplers(samplers: list[str] | str, sampling: dict) -> None:
    """Samplers we have that the list leaves out are turned off, as llama-server leaves them
    out of its chain; those we lack may be named while their parameters keep them off. The
    order is fixed (penalties, top_k, temperature, top_p, min_p, as vLLM applies them)."""
    if isinstance(samplers, str):
        unknown = sorted(set(samplers) - set(SAMPLER_CHARS))
        named = {SAMPLER_CHARS[c] for c in samplers if c in SAMPLER_CHARS}
    else:
        unknown = sorted({s for s in samplers if s not in SAMPLER_NAMES})
        named = {SAMPLER_NAMES[s] for s in samplers if s in SAMPLER_NAMES}
    if unknown:
        raise APIError(400, f"samplers: unknown sampler(s) {', '.join(map(repr, unknown))}", param="samplers",
                       code="invalid_value")
    if "temperature" not in named:
        raise _refuse("samplers", "samplers without temperature are not supported")
    for name, off in OUR_SAMPLERS.items():
        if name not in named:
            sampling[name] = off


class Timings:
    """llama-server's `timings` for one request (see the module's docstring)."""

    def __init__(self):
        self.arrived = time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None
        self.n = 0

    def token(self, now: float) -> None:
        if self.first is None:
            self.first = now
        self.last = now
        self.n += 1

    def partial(self) -> dict:
        """While tokens come: what the front end measures itself."""
        if self.first is None:
            return {}
        return {"prompt_ms": _ms(self.first - self.arrived), **self._predicted(self.n, _ms(self.last - self.first))}

    def final(self, done) -> dict:
        """At the end: the coordinator's counts, and its workers' times where it has them."""
        prompt_n = done.prompt_tokens - done.cached_prompt_tokens
        n = done.completion_tokens
        if done.decode_tok_s > 0:
            predicted_ms = n / done.decode_tok_s * 1000
        else:
            predicted_ms = _ms(self.last - self.first) if self.first is not None else 0.0
        return {"cache_n": done.cached_prompt_tokens, "prompt_n": prompt_n, "prompt_ms": done.prefill_ms,
                "prompt_per_token_ms": _per(done.prefill_ms, prompt_n),
                "prompt_per_second": _rate(prompt_n, done.prefill_ms), **self._predicted(n, predicted_ms)}

    @staticmethod
    def _predicted(n: int, ms: float) -> dict:
        return {"predicted_n": n, "predicted_ms": ms, "predicted_per_token_ms": _per(ms, n),
                "predicted_per_second": _rate(n, ms)}


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 3)


def _per(ms: float, n: int) -> float:
    return round(ms / n, 3) if n else 0.0


def _rate(n: int, ms: float) -> float:
    return round(n / ms * 1000, 3) if ms > 0 else 0.0
