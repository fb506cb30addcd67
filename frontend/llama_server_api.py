"""llama-server's own API, for front ends written for llama.cpp (its web page among them), in
its field names and shapes: POST /completion, GET /props, POST /apply-template, GET /slots.

/completion is /v1/completions underneath (openai_request.completion_generate: the same sampling
fields, llama_server_request.py's extensions, the same Generate); what differs is the prompt forms
and the answer:
- `prompt`: a string, token ids, or a mix of both (strings tokenized here, BOS only before a
  leading string, as llama-server's tokenize_mixed); or a list of several of those (no token id
  among its items), each its own request: the answer is then an array of theirs, in order,
  each with its `index`, and a stream interleaves their chunks (prompt_batch.py).
- `grammar` (GBNF) / `json_schema` become the Generate's Constraint, compiled by the coordinator
  as chat's response_format is.
- The answer: {content, tokens, id_slot, stop, model, tokens_predicted, tokens_evaluated,
  generation_settings, prompt, has_new_line, truncated, stop_type, stopping_word,
  tokens_cached, timings}; `stop_type` is eos, word (`stopping_word` set), limit or none (the
  request was cancelled). Streamed: one `data:` line per piece of text, {content, tokens,
  stop: false, ...}, then the whole answer with empty content and stop: true; no [DONE].
  A chunk's `tokens` lists its token ids; the whole answer's only with `return_tokens`, as
  llama-server does. `n_probs` (1-20) adds `completion_probabilities` (logprobs.py), to the
  answer or to each chunk for its tokens; `timings` numbers are never null (0.0 where nothing
  was measured, as for the rate of a one-token answer). `response_fields` keeps only the fields
  it lists in the answer (the last chunk of a stream), `generation_settings/n_predict` brought
  to the top under that name.

/slots has no per-slot state to show here: the coordinator schedules requests over its
workers' decode capacity (--max-sequences each), so it lists that many slots, as many of
them `is_processing` as requests are running.
"""
from __future__ import annotations

import importlib.metadata
import json
import math
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse

from shared import protocol as P
from shared.chat import render_chat
from shared.errors import ChatTemplateError
from shared.sampling import MAX_TOP_LOGPROBS, InvalidSampling, SamplingParams

from . import openai_request
from .core import read_body, submit
from .errors import APIError
from .formats import TextFormat
from .logprobs import Logprobs
from .schemas import ChatCompletionRequest, CompletionRequest, _validation_error, decode_body, decode_object
from .prompt_batch import MAX_PROMPTS, PromptBatch
from .streaming import GenerationResponse, _failure_error, send_json

STOP_TYPES = {"stop": "eos", "length": "limit", "cancelled": "none"}


def _build_info() -> str:
    try:
        return f"fermoe {importlib.metadata.version('fermoe')}"
    except importlib.metadata.PackageNotFoundError:
        return "fermoe source"


async def _tokenizer_or_none(server):
    try:
        return await server.tokenizer()
    except APIError:
        return None


def _prompts(prompt) -> list:
    """llama-server's `prompt`: one prompt, or a list of several (strings, token-id lists, or
    mixed lists), each answered on its own."""
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise APIError(400, f"a list of {len(prompt)} prompts: at most {MAX_PROMPTS} in one request",
                           param="prompt", code="invalid_value")
        return prompt
    return [prompt]


async def _prompt(server, prompt) -> str | list[int]:
    """One of llama-server's prompt forms -> a string or token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise APIError(400, "prompt: expected a string, token ids, or a list of both", param="prompt",
                       code="invalid_value")
    if not all(isinstance(p, str) or (isinstance(p, int) and not isinstance(p, bool)) for p in prompt):
        raise APIError(400, "prompt: a mixed prompt holds strings and token ids only", param="prompt",
                       code="invalid_value")
    if all(isinstance(p, int) for p in prompt):
        return prompt
    tok = await server.tokenizer()
    ids: list[int] = []
    for i, p in enumerate(prompt):
        ids += tok.encode(p, add_bos=None if i == 0 else False) if isinstance(p, str) else [p]
    return ids


async def _logit_bias(server, value) -> tuple[tuple[int, float], ...]:
    """llama-server's logit_bias: [[token id, bias]], [["text", bias]] (each of the text's
    tokens), or OpenAI's {"token id": bias}; a bias of false bans the token."""
    if value is None or value == [] or value == {}:
        return ()
    if isinstance(value, dict):
        value = [[k, v] for k, v in value.items()]
    if not isinstance(value, list) or not all(isinstance(p, list) and len(p) == 2 for p in value):
        raise APIError(400, 'logit_bias: expected [[token id or "text", bias], ...] or {"token id": bias}',
                       param="logit_bias", code="invalid_value")
    pairs = []
    for key, bias in value:
        if bias is False:
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise APIError(400, f"logit_bias: the bias of {key!r} must be a number or false, got {bias!r}",
                           param="logit_bias", code="invalid_value")
        if isinstance(key, str) and not key.isdigit():
            ids = (await server.tokenizer()).encode(key)
        elif isinstance(key, (int, str)) and not isinstance(key, bool):
            ids = [int(key)]
        else:
            raise APIError(400, f"logit_bias: expected a token id or a text, got {key!r}", param="logit_bias",
                           code="invalid_value")
        pairs += [(i, float(bias)) for i in ids]
    try:
        return SamplingParams(logit_bias=tuple(sorted(pairs))).logit_bias
    except InvalidSampling as e:
        raise APIError(400, str(e), param="logit_bias", code="invalid_value") from None


def _n_probs(n, post_sampling) -> int | None:
    """llama-server's n_probs: the most likely tokens listed with each one (0: none)."""
    if n is None or n == 0:
        return None
    if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"n_probs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {n!r}", param="n_probs",
                       code="invalid_value")
    if post_sampling:
        raise APIError(400, "post_sampling_probs is not supported: n_probs gives the model's own probabilities, "
                            "before the samplers", param="post_sampling_probs", code="unsupported_parameter")
    return n


async def completion(request: Request):
    server = request.app.state.server
    data = decode_object(await read_body(request))
    n_probs = _n_probs(data.pop("n_probs", None), data.get("post_sampling_probs"))
    bias = await _logit_bias(server, data.pop("logit_bias", None))
    if "prompt" not in data:
        raise APIError(400, "Missing required parameter: 'prompt'.", param="prompt",
                       code="missing_required_parameter")
    built = [await _generate(server, data | {"prompt": prompt}, n_probs, bias) for prompt in _prompts(data["prompt"])]
    responses = []
    try:
        for i, (body, msg, text) in enumerate(built):
            probs = Logprobs(await server.tokenizer(), chat=False, llama=True) if n_probs else None
            model, upstream, stream = await submit(server, msg)
            responses.append(CompletionResponse(upstream, stream, TextFormat(), model, body.stream, False,
                                                server.metrics, server.system_fingerprint,
                                                bool(body.timings_per_token), logprobs=probs, prompt=text,
                                                msg=server.effective(msg), fields=body.response_fields,
                                                return_tokens=bool(body.return_tokens), index=i))
    except BaseException:
        for response in responses:                  # the prompts sent before one that could not be
            response.upstream.cancel(response.rid)
        raise
    return responses[0] if len(responses) == 1 else PromptBatch(responses, built[0][0].stream)


async def _generate(server, data: dict, n_probs: int | None, bias) -> tuple[CompletionRequest, P.Generate, str]:
    """One prompt's request: its body, its Generate, and its prompt as text (the answer's `prompt`)."""
    data["prompt"] = await _prompt(server, data["prompt"])
    try:
        body = msgspec.convert(data, CompletionRequest)
    except msgspec.ValidationError as e:
        raise _validation_error(str(e)) from None
    msg = openai_request.completion_generate(body)
    if n_probs:
        msg = msgspec.structs.replace(msg, logprobs=n_probs)
    if body.ignore_eos:         # llama-server's: the end-of-generation tokens banned, shown as their bias
        tok = await server.tokenizer()
        bias = tuple(sorted({**dict(bias), **{t: -math.inf for t in tok.eos_ids}}.items()))
    if bias:
        msg = msgspec.structs.replace(msg, sampling=msg.sampling.replace(logit_bias=bias),
                                      unset=[f for f in msg.unset if f != "logit_bias"])
    tok = await _tokenizer_or_none(server) if not isinstance(data["prompt"], str) else None
    if tok is not None and (bad := next((t for t in data["prompt"] if not 0 <= t < tok.n_vocab), None)) is not None:
        raise APIError(400, f"prompt: token id {bad} is outside the vocabulary of {tok.n_vocab}", param="prompt",
                       code="invalid_value")
    text = data["prompt"] if isinstance(data["prompt"], str) else tok.decode(data["prompt"]) if tok else ""
    return body, msg, text


class CompletionResponse(GenerationResponse):
    def __init__(self, *args, prompt: str, msg: P.Generate, return_tokens: bool, fields: list[str] | None = None,
                 index: int = 0, **kw):
        super().__init__(*args, **kw)
        self.prompt, self.msg, self.return_tokens, self.fields = prompt, msg, return_tokens, fields
        self.index = index                          # of its prompt, in a request of several
        self.n = 0

    def final(self, done: P.Done, content: str, tokens: list[int]) -> dict:
        stop_type = "word" if done.finish_reason == "stop" and done.stop_reason else \
            STOP_TYPES.get(done.finish_reason, "none")
        return {"index": self.index, "content": content, "tokens": tokens, "id_slot": 0, "stop": True,
                "model": self.model,
                "tokens_predicted": done.completion_tokens, "tokens_evaluated": done.prompt_tokens,
                "generation_settings": generation_settings(self.msg), "prompt": self.prompt,
                "has_new_line": "\n" in content, "truncated": False, "stop_type": stop_type,
                "stopping_word": done.stop_reason or "", "tokens_cached": done.prompt_tokens + done.completion_tokens,
                "timings": self.timings.final(done)}

    async def _whole(self, msg, send) -> None:
        read = await self._read_all(msg, send)
        if read is None:
            return
        tokens, msg = read
        ids = [t.token for t in tokens if t.token >= 0] if self.return_tokens else []
        answer = self._probs(self.final(msg, "".join(t.text for t in tokens), ids))
        await send_json(send, 200, answer if self.fields is None else only(answer, self.fields))

    def _probs(self, body: dict) -> dict:
        """With n_probs, the tokens' probabilities since the last body that carried them."""
        if self.logprobs is not None:
            body["completion_probabilities"] = self.logprobs.take() or []
        return body

    def opening_events(self) -> list[bytes]:
        return []                                   # llama-server's stream opens with its first token

    async def _stream_events(self, msg, send) -> None:
        out, tokens = [], []                        # (the headers went out in _start_stream)
        while not isinstance(msg, P.Done):
            if isinstance(msg, P.Progress):
                out.append(_data({"index": self.index, "content": "", "tokens": [], "stop": False, "id_slot": 0,
                                  "tokens_predicted": 0, "tokens_evaluated": self.stream.started.prompt_tokens,
                                  "prompt_progress": self.prompt_progress(msg)}))
            else:
                tokens = self._text_event(msg, out, tokens)
            if self.stream.queue.empty() and out:
                await self._send_events(send, out)
                out = []
            msg = await self._next()
            if self.gone:
                return
        last = self.error_body(_failure_error(msg)) if msg.finish_reason == "error" else \
            self._probs(self.final(msg, "", tokens))
        if self.fields is not None and msg.finish_reason != "error":
            last = only(last, self.fields)
        await self._send_events(send, out + [_data(last)], more=False)

    def _text_event(self, msg: P.Token, out: list[bytes], tokens: list[int]) -> list[int]:
        """A token: its id is listed by the next chunk of text (llama-server's `tokens`); the
        ids not sent yet are returned."""
        self._add_logprobs(msg)
        if msg.token >= 0:
            tokens.append(msg.token)
            self.n += 1
        if not msg.text:
            return tokens
        chunk = self._probs({"index": self.index, "content": msg.text, "tokens": tokens, "stop": False, "id_slot": 0,
                             "tokens_predicted": self.n, "tokens_evaluated": 0})
        if self.timings_per_token:
            chunk["timings"] = self.timings.partial()
        out.append(_data(chunk))
        return []

def only(answer: dict, fields: list[str]) -> dict:
    """llama-server's response_fields: just those fields, in their order; `a/b` brings b out of
    a to the top level, named `a/b` there; a field the answer lacks is left out."""
    out = {}
    for path in fields:
        value, found = answer, True
        for part in path.split("/"):
            if not isinstance(value, dict) or part not in value:
                found = False
                break
            value = value[part]
        if found:
            out[path] = value
    return out


def _data(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def generation_settings(msg: P.Generate) -> dict:
    """A request's sampling as it runs (Server.effective: the server's defaults filled in); a
    banned token's bias shows as false, as llama-server shows it."""
    sampling = msgspec.to_builtins(msg.sampling)
    sampling["logit_bias"] = [[t, b if math.isfinite(b) else False] for t, b in msg.sampling.logit_bias]
    return sampling | {"n_predict": -1 if msg.max_tokens is None else msg.max_tokens, "stop": msg.stop,
                       "ignore_eos": msg.ignore_eos}


def _defaults(server) -> dict:
    """What a request that sets nothing gets: the server's --temp, ..., -n."""
    blank = P.Generate(request_id="", prompt="", unset=[*SamplingParams.names(), "max_tokens"])
    return generation_settings(server.effective(blank))


def _slot(i: int, n_ctx: int, processing: bool, params: dict) -> dict:
    return {"id": i, "id_task": -1, "n_ctx": n_ctx, "speculative": False, "is_processing": processing,
            "params": params, "prompt": "",
            "next_token": {"has_next_token": processing, "has_new_line": False, "n_remain": -1, "n_decoded": 0,
                           "stopping_word": ""}}


async def props(request: Request):
    server = request.app.state.server
    st = await server.status()
    tok = await _tokenizer_or_none(server)

    def piece(token_id: int | None) -> str:
        return tok.piece_bytes(token_id).decode("utf-8", errors="replace") if tok and token_id is not None else ""
    return JSONResponse({
        "default_generation_settings": _slot(0, st.n_ctx, False, _defaults(server)), "total_slots": _total_slots(st),
        "model_alias": server.name, "model_path": st.model, "modalities": {"vision": st.vision, "audio": False},
        "chat_template": (tok.chat_template or "") if tok else "", "bos_token": piece(tok.bos_id if tok else None),
        "eos_token": piece(tok.eos_id if tok else None), "build_info": _build_info(), "webui": False,
        "is_sleeping": st.sleeping})


def _total_slots(st: P.StatusReply) -> int:
    return max(st.max_sequences, 1) * max(sum(w.alive and w.kind == "cpu" for w in st.workers), 1)


async def slots(request: Request):
    server = request.app.state.server
    if not server.settings.slots:                   # llama-server's words for it
        raise APIError(501, "This server does not support slots endpoint. Start it with `--slots`",
                       code="not_supported_error")
    st = await server.status()
    total = _total_slots(st)
    if request.query_params.get("fail_on_no_slot") and st.running >= total:
        raise APIError(503, "no slot available", code="unavailable")
    return JSONResponse([_slot(i, st.n_ctx, i < st.running, _defaults(server)) for i in range(total)])


async def apply_template(request: Request):
    server = request.app.state.server
    body = decode_body(await read_body(request), ChatCompletionRequest)
    msg = openai_request.chat_generate(body)
    tok = await server.tokenizer()
    try:
        return JSONResponse({"prompt": render_chat(tok, msg.messages, msg.tools,
                                                    server.template_kwargs(msg.chat_template_kwargs),
                                                    msg.continue_final_message, msg.add_generation_prompt)})
    except ChatTemplateError as e:
        raise APIError(400, str(e)) from None         # its message says whose refusal it is


ROUTES: list[tuple[str, Any, list[str]]] = [("/completion", completion, ["POST"]), ("/props", props, ["GET"]),
                                            ("/apply-template", apply_template, ["POST"]), ("/slots", slots, ["GET"])]
