"""Cross-origin requests (CORS), so that a web page served elsewhere may call the API.

By default any origin may (Access-Control-Allow-Origin: *, as llama-server and vLLM
answer); --cors-origins narrows it to a list, or turns it off. A preflight (OPTIONS
with Access-Control-Request-Method) is answered here, 204, before the API key is
asked for: browsers never send credentials on a preflight. Every other response to
an allowed origin, a 401 included, carries the headers that let the page read it.
"""
from __future__ import annotations

from .errors import APIError
from .streaming import send_json

METHODS = b"GET, POST, OPTIONS"
DEFAULT_HEADERS = b"Authorization, Content-Type"
EXPOSED = b"X-Request-Id, Retry-After"
MAX_AGE = b"600"


class CORS:
    """ASGI middleware; `origins`: () off, ("*",) any, else the allowed origins."""

    def __init__(self, app, origins: tuple[str, ...]):
        self.app = app
        self.any = origins == ("*",)
        self.origins = frozenset(o.encode() for o in origins)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.origins:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        allowed = self.any or origin in self.origins
        if scope["method"] == "OPTIONS" and b"access-control-request-method" in headers:
            return await self._preflight(send, origin, allowed, headers.get(b"access-control-request-headers"))
        if not allowed:
            return await self.app(scope, receive, send)

        async def with_cors(message):
            if message["type"] == "http.response.start":
                message = message | {"headers": list(message.get("headers", [])) + self._allow(origin)
                                     + [(b"access-control-expose-headers", EXPOSED)]}
            await send(message)
        await self.app(scope, receive, with_cors)

    def _allow(self, origin: bytes) -> list[tuple[bytes, bytes]]:
        if self.any:
            return [(b"access-control-allow-origin", b"*")]
        return [(b"access-control-allow-origin", origin), (b"vary", b"Origin")]

    async def _preflight(self, send, origin: bytes, allowed: bool, asked: bytes | None) -> None:
        if not allowed:
            error = APIError(403, f"the origin {origin.decode('latin-1')} may not call this API "
                                  f"(the server's --cors-origins does not list it)")
            return await send_json(send, 403, error.body(), {"Vary": "Origin"})
        headers = self._allow(origin) + [(b"access-control-allow-methods", METHODS),
                                         (b"access-control-allow-headers", asked or DEFAULT_HEADERS),
                                         (b"access-control-max-age", MAX_AGE)]
        await send({"type": "http.response.start", "status": 204, "headers": headers})
        await send({"type": "http.response.body", "body": b""})
