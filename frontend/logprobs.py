"""`logprobs` in OpenAI's shapes, from the coordinator's Token messages (each token's
log-probability and the most likely tokens', under the model's distribution before any
sampling modifier: see shared/sampling.logprobs_of).

Chat (`logprobs: true`, `top_logprobs: 0..20`): `{"content": [{token, logprob, bytes,
top_logprobs: [{token, logprob, bytes}]}], "refusal": null}`, the token's text with its
UTF-8 bytes (a token may hold part of a character: its text then shows U+FFFD, its bytes
are exact). Completions (`logprobs: 0..20`): the legacy `{tokens, token_logprobs,
top_logprobs: [{text: logprob}], text_offset}`. llama-server's /completion (`n_probs: 1..20`):
`completion_probabilities: [{id, token, bytes, logprob, top_logprobs: [{id, token, bytes,
logprob}]}]`. Every generated token is listed, the
reasoning and tool-call markup's too, in the order generated; a stream attaches to each
chunk the tokens that came since the last one, so the chunks' lists concatenate to the
whole response's.
"""
from __future__ import annotations

from shared import protocol as P
from shared.sampling import MAX_TOP_LOGPROBS

from .errors import APIError


def requested(body, chat: bool) -> int | None:
    """How many most likely tokens each token lists; None: no logprobs. vLLM's rules: chat's
    top_logprobs needs logprobs true; at most 20."""
    if chat:
        if body.logprobs not in (None, True, False):
            raise APIError(400, f"logprobs must be a boolean, got {body.logprobs!r}", param="logprobs",
                           code="invalid_type")
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if not body.logprobs:
            return None
        n, param = body.top_logprobs or 0, "top_logprobs"
    else:
        if body.logprobs is None or body.logprobs is False:
            return None
        if isinstance(body.logprobs, bool) or not isinstance(body.logprobs, int):
            raise APIError(400, f"logprobs must be an integer, got {body.logprobs!r}", param="logprobs",
                           code="invalid_type")
        n, param = body.logprobs, "logprobs"
    if not 0 <= n <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"{param} must be in [0, {MAX_TOP_LOGPROBS}], got {n}", param=param,
                       code="invalid_value")
    return n


class Logprobs:
    """The logprobs of one response, collected token by token; take() gives what came since
    the last take() in the endpoint's shape (None if nothing did)."""

    def __init__(self, tokenizer, chat: bool, llama: bool = False):
        self.tokenizer, self.chat, self.llama = tokenizer, chat, llama
        self.pending: list[P.Token] = []
        self.offset = 0                     # completions' text_offset: characters so far

    def add(self, msg: P.Token) -> None:
        if msg.logprob is not None:
            self.pending.append(msg)

    def take(self) -> dict | None:
        if not self.pending:
            return None
        tokens, self.pending = self.pending, []
        if self.llama:
            return self._llama(tokens)
        return self._chat(tokens) if self.chat else self._text(tokens)

    def _piece(self, token: int) -> tuple[str, bytes]:
        raw = self.tokenizer.piece_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def _chat(self, tokens: list[P.Token]) -> dict:
        def entry(token: int, logprob: float) -> dict:
            text, raw = self._piece(token)
            return {"token": text, "logprob": logprob, "bytes": list(raw)}
        return {"content": [entry(m.token, m.logprob) | {"top_logprobs": [entry(t.token, t.logprob)
                                                                          for t in m.top_logprobs or []]}
                            for m in tokens], "refusal": None}

    def _llama(self, tokens: list[P.Token]) -> list[dict]:
        """llama-server's completion_probabilities (n_probs): each token's id, text, bytes and
        log-probability, and the n most likely tokens' the same."""
        def entry(token: int, logprob: float) -> dict:
            text, raw = self._piece(token)
            return {"id": token, "token": text, "bytes": list(raw), "logprob": logprob}
        return [entry(m.token, m.logprob) | {"top_logprobs": [entry(t.token, t.logprob) for t in m.top_logprobs or []]}
                for m in tokens]

    def _text(self, tokens: list[P.Token]) -> dict:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for m in tokens:
            text = self._piece(m.token)[0]
            out["tokens"].append(text)
            out["token_logprobs"].append(m.logprob)
            out["top_logprobs"].append({self._piece(t.token)[0]: t.logprob for t in m.top_logprobs or []})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
