"""The Starlette application: the routes of every API, the API key, CORS (what they share is
core.py: the settings, request limits, submission to the coordinator).

    GET  /                      the chat page (static/chat.html)
    GET  /favicon.ico           its icon, an SVG (never needs the key)
    GET  /health, /v1/health    200 once the coordinator has a ready worker, else 503 (never needs the key)
    GET  /metrics               Prometheus text format (metrics.py)
    GET  /v1/models[/{id}]      the one model the coordinator serves, under its name (--alias, else
                                the coordinator's --model as given); any {id} is that model
    POST /v1/chat/completions   messages rendered with the model's chat template (by the coordinator;
                                openai_api.py)
    POST /v1/completions        a prompt string or token ids (openai_api.py)
    POST /tokenize, /detokenize llama-server's, with the model's tokenizer loaded here
    POST /v1/responses          OpenAI's Responses API (responses_api.py)
    POST /completion, /apply-template, GET /props, /slots   llama-server's own API (llama_server_api.py)
    POST /v1/messages[/count_tokens]  Anthropic's Messages API (anthropic_api.py)

/models, /chat/completions and /completions answer as their /v1 forms (llama-server
takes both). One model is served, so a request's `model`, whatever it names, is that
model, as llama-server serves its one model under any name. Request bodies and the
messages they become are bounded by one limit, --max-request-size.
"""
from __future__ import annotations

import contextlib
import hmac
import logging
from pathlib import Path

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from . import anthropic_api, llama_server_api, openai_api, responses_api
from .core import Server, Settings, read_body
from .cors import CORS
from .errors import RETRY_AFTER_S
from .metrics import Metrics
from .schemas import APIError, DetokenizeRequest, TokenizeRequest, decode_body
from .streaming import send_json
from .upstream import Upstream

log = logging.getLogger("fermoe.http")
# the page and its icon are static (the page asks for the key itself)
OPEN_PATHS = frozenset({"/health", "/v1/health", "/", "/favicon.ico"})
STATIC = Path(__file__).with_name("static")


# ---- what every API shares: health, models, the tokenizer, the page -------------------
async def health(request: Request):
    st = await request.app.state.server.status()
    ready = sum(w.alive for w in st.workers)
    if st.unavailable:
        raise APIError(503, st.unavailable, code="unavailable")
    if st.sleeping:                            # up: a request wakes the workers (--sleep-idle-seconds)
        return JSONResponse({"status": "ok", "workers_ready": ready, "sleeping": True})
    if not ready:
        raise APIError(503, "no worker is ready yet", headers={"Retry-After": RETRY_AFTER_S})
    return JSONResponse({"status": "ok", "workers_ready": ready})


async def metrics(request: Request):
    server: Server = request.app.state.server
    try:
        st = await server.status()
    except APIError:
        st = None                              # fermoe:coordinator_up 0 says it
    return Response(server.metrics.render(st), media_type="text/plain; version=0.0.4; charset=utf-8")


async def list_models(request: Request):
    """One card per name the model goes by (--alias a,b), each naming the others and --tags."""
    server = request.app.state.server
    await server.model_id()
    return JSONResponse({"object": "list", "data": [_model_card(server, name) for name in server.names]})


async def get_model(request: Request):
    server = request.app.state.server
    await server.model_id()
    asked = request.path_params["model"]
    return JSONResponse(_model_card(server, asked if asked in server.names else server.name))


def _model_card(server: Server, name: str) -> dict:
    return {"id": name, "object": "model", "created": server.started, "owned_by": "fermoe", "aliases": server.names,
            "tags": list(server.settings.tags)}


async def tokenize(request: Request):
    body = decode_body(await read_body(request), TokenizeRequest)
    tok = await request.app.state.server.tokenizer()
    ids = tok.encode(body.content, add_bos=body.add_special)
    if not body.with_pieces:
        return JSONResponse({"tokens": ids})
    return JSONResponse({"tokens": [{"id": i, "piece": tok.piece_bytes(i).decode("utf-8", errors="replace")}
                                    for i in ids]})


async def detokenize(request: Request):
    body = decode_body(await read_body(request), DetokenizeRequest)
    tok = await request.app.state.server.tokenizer()
    bad = [t for t in body.tokens if t >= tok.n_vocab]
    if bad:
        raise APIError(400, f"token ids must be in [0, {tok.n_vocab}); got {bad[:8]}", param="tokens")
    return JSONResponse({"content": tok.decode(body.tokens)})


async def chat_page(request: Request):
    return HTMLResponse((STATIC / "chat.html").read_text())


async def favicon(request: Request):
    return Response((STATIC / "favicon.svg").read_bytes(), media_type="image/svg+xml",
                    headers={"Cache-Control": "max-age=86400"})


# ---- errors, the key, accounting -------------------------------------------------------
async def api_error(request: Request, exc: APIError):
    return JSONResponse(exc.body(), exc.status, headers={k: str(v) for k, v in exc.headers.items()})


async def http_error(request: Request, exc: HTTPException):
    message = {404: f"no such endpoint: {request.url.path}",
               405: f"method {request.method} is not allowed on {request.url.path}"}.get(exc.status_code, exc.detail)
    return await api_error(request, APIError(exc.status_code, message))


async def server_error(request: Request, exc: Exception):
    log.exception("request %s %s failed", request.method, request.url.path)
    return await api_error(request, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))


class Gate:
    """ASGI middleware: the Bearer key on every path but the open ones, per-endpoint counts
    (by route path; any other path, a model's own /v1/models/NAME too, counts as "other"),
    and a log line for every refusal (status, route, the error's message; never the body)."""

    def __init__(self, app, server: Server, endpoints: frozenset[str]):
        self.app, self.server, self.endpoints = app, server, endpoints
        key = server.settings.api_key
        self.key = key.encode() if key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        endpoint = scope["path"] if scope["path"] in self.endpoints else "other"

        status = 0

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.server.metrics.http_requests.labels(endpoint=endpoint, status=str(status)).inc()
            elif message["type"] == "http.response.body" and status >= 400:
                _log_refusal(scope, status, message.get("body", b""))
                status = 0                          # one line, however many chunks
            await send(message)

        problem = self._refusal(scope)
        if problem is not None:
            if scope["path"] in anthropic_api.PATHS:
                problem = anthropic_api.AnthropicError(401, problem.message)
            return await send_json(counted_send, 401, problem.body(), {"WWW-Authenticate": "Bearer"})
        await self.app(scope, receive, counted_send)

    def _refusal(self, scope) -> APIError | None:
        if self.key is None or scope["path"] in OPEN_PATHS:
            return None
        headers = dict(scope["headers"])
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if b"x-api-key" in headers:                 # Anthropic's clients send the key so
            scheme, token = b"bearer", headers[b"x-api-key"]
        if not token or scheme.lower() != b"bearer":
            return APIError(401, "You didn't provide an API key. Provide it in an Authorization header using "
                                 "Bearer auth (Authorization: Bearer YOUR_KEY) or in x-api-key.",
                            code="missing_api_key")
        if not hmac.compare_digest(token.strip(), self.key):
            return APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return None


def _log_refusal(scope, status: int, body: bytes) -> None:
    """One line for a 4xx or 5xx answer: the route, the status and the error's own message
    (OpenAI's and Anthropic's bodies both carry error.message)."""
    try:
        reason = msgspec.json.decode(body)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        reason = body[:200].decode("utf-8", "replace")
    log.log(logging.ERROR if status >= 500 else logging.WARNING, "%s %s -> %d: %s", scope.get("method", ""),
            scope["path"], status, reason)


def build_app(settings: Settings) -> Starlette:
    server = Server(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.upstream = Upstream(settings.connect, curve_key=settings.curve_key)
        server.upstream.start()
        yield
        await server.upstream.close()

    server.metrics = Metrics(waiting=lambda: server.upstream.waiting if server.upstream else 0)
    routes = [Route("/", chat_page), Route("/favicon.ico", favicon), Route("/metrics", metrics),
              Route("/tokenize", tokenize, methods=["POST"]), Route("/detokenize", detokenize, methods=["POST"])]
    for prefix in ("/v1", ""):                   # llama-server answers on both
        routes += [Route(f"{prefix}/health", health), Route(f"{prefix}/models", list_models),
                   Route(f"{prefix}/models/{{model:path}}", get_model),
                   Route(f"{prefix}/chat/completions", openai_api.chat_completions, methods=["POST"]),
                   Route(f"{prefix}/completions", openai_api.completions, methods=["POST"])]
    routes += [Route("/v1/responses", responses_api.responses, methods=["POST"]),
               Route("/v1/messages", anthropic_api.messages, methods=["POST"]),
               Route("/v1/messages/count_tokens", anthropic_api.count_tokens, methods=["POST"])]
    routes += [Route(path, endpoint, methods=methods) for path, endpoint, methods in llama_server_api.ROUTES]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.server = server
    app.add_middleware(Gate, server=server, endpoints=frozenset(r.path for r in routes if "{" not in r.path))
    app.add_middleware(CORS, origins=settings.cors_origins)     # outermost: a preflight never meets the key
    return app
