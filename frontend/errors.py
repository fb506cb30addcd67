"""OpenAI's error JSON: every refusal of the HTTP API is one of these."""
from __future__ import annotations

RETRY_AFTER_S = 1           # the Retry-After of a 503 that a moment may cure (a full queue, a coordinator starting)


class APIError(Exception):
    """An error answered as OpenAI answers it: {"error": {message, type, param, code}}, plus
    any `extra` fields (llama-server's n_prompt_tokens and n_ctx on an over-long prompt)."""

    TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
             405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 501: "server_error", 503: "server_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}
        self.extra = extra or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code, **self.extra}}
