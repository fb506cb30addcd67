"""Cross-origin requests (CORS), so that a web page served elsewhere may call the API, as
llama-server answers them.

By default any origin may; --cors-origins narrows it to a list (`localhost` in it: any
loopback origin, on any port), or turns it off. An allowed origin is reflected in
Access-Control-Allow-Origin (never `*`), with Access-Control-Allow-Credentials, so that a
page may send cookies or an Authorization header. A preflight (OPTIONS with
Access-Control-Request-Method) is answered here, 200, before the API key is asked for:
browsers never send credentials on a preflight; it allows GET, POST, DELETE and OPTIONS and
the headers the page asked for (`*` when it named none). Every other response to an allowed
origin, a 401 included, carries the headers that let the page read it.
"""
from __future__ import annotations

from .errors import APIError
from .streaming import send_json

METHODS = b"GET, POST, DELETE, OPTIONS"
DEFAULT_HEADERS = b"*"
EXPOSED = b"X-Request-Id, Retry-After"
MAX_AGE = b"600"


class CORS:
    """ASGI middleware; `origins`: () off, ("*",) any, else the allowed origins."""

    def __init__(self, app, origins: tuple[str, ...]):
        self.app, self.on = app, bool(origins)
        self.any = origins == ("*",)
        self.loopback = "localhost" in origins
        self.origins = frozenset(o.encode() for o in origins if o != "localhost")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.on:
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        origin = headers.get(b"origin")
        if origin is None:
            return await self.app(scope, receive, send)
        allowed = self.any or origin in self.origins or (self.loopback and is_loopback_origin(origin))
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
        return [(b"access-control-allow-origin", origin), (b"access-control-allow-credentials", b"true"),
                (b"vary", b"Origin")]

    async def _preflight(self, send, origin: bytes, allowed: bool, asked: bytes | None) -> None:
        if not allowed:
            error = APIError(403, f"the origin {origin.decode('latin-1')} may not call this API "
                                  f"(the server's --cors-origins does not list it)")
            return await send_json(send, 403, error.body(), {"Vary": "Origin"})
        headers = self._allow(origin) + [(b"access-control-allow-methods", METHODS),
                                         (b"access-control-allow-headers", asked or DEFAULT_HEADERS),
                                         (b"access-control-max-age", MAX_AGE)]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b""})


LOOPBACK_HOSTS = (b"localhost", b"127.0.0.1", b"[::1]")


def is_loopback_origin(origin: bytes) -> bool:
    """http(s)://localhost, 127.x.x.x or [::1], on any port."""
    scheme, sep, rest = origin.partition(b"://")
    if not sep or scheme not in (b"http", b"https"):
        return False
    host = rest.rsplit(b":", 1)[0] if not rest.endswith(b"]") else rest
    return host in LOOPBACK_HOSTS or (host.startswith(b"127.") and host[4:].replace(b".", b"").isdigit())
