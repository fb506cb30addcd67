"""A coding agent's session, recorded and replayed: the requests a client such as Claude
Code, Codex CLI or opencode sends, kept as it sent them, so that a session can be measured
again against any server (`fermoe bench agent --session FILE`) and the API layers can be
tested against the real shapes without the client (tests/agents/).

Recording: `Recorder` is an HTTP proxy in front of a server. The client is pointed at the
proxy; every request is passed on unchanged and its answer streamed back as it comes, and
one JSON line a request is appended to the session file:

  method, path, query     as the client sent them
  headers                 the few request headers that change an answer (anthropic-beta,
                          anthropic-version, openai-beta); never the API key
  body                    the request's JSON body (null when it had none or was not JSON)
  status                  the server's status code
  usage                   {prompt_tokens, cached_tokens, completion_tokens}, read from
                          whichever API's usage the answer carried (null where it had none)
  errors                  the error events of a streamed answer (an error after the headers)
  ttft_s                  s: from the request to its first generated token (streamed), or
                          to the whole answer (not streamed)

Replaying sends each recorded POST again, in order, with its recorded body and headers, and
reads the same fields from the new answers.
"""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

KEPT_HEADERS = ("anthropic-beta", "anthropic-version", "openai-beta")
HOP_BY_HOP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive", "accept-encoding",
              "proxy-connection", "te", "upgrade"}


# ---- reading an answer ---------------------------------------------------------------

def sse_payloads(text: str) -> list[dict]:
    """The JSON data of each server-sent event (comments, [DONE] and non-JSON data skipped)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                try:
                    out.append(json.loads(data))
                except ValueError:
                    pass
    return out


def usage_of(payloads: list[dict]) -> dict | None:
    """{prompt_tokens, cached_tokens, completion_tokens} from an answer of any of the three
    APIs (its events, or a single JSON body), or None where it carried no usage."""
    found = None
    for p in payloads:
        for u in _usages(p):
            found = _merge(found, _normalized(u))
    return found


def _usages(p: dict):
    if not isinstance(p, dict):
        return
    if isinstance(p.get("usage"), dict):                          # chat chunk / body, Anthropic body
        yield p["usage"]
    for key in ("message", "response"):                           # message_start, response.completed
        inner = p.get(key)
        if isinstance(inner, dict) and isinstance(inner.get("usage"), dict):
            yield inner["usage"]


def _normalized(u: dict) -> dict:
    if "prompt_tokens" in u:                                      # chat and text completions
        return {"prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
                "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}
    if "input_tokens_details" in u or "total_tokens" in u:        # Responses
        return {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens"),
                "cached_tokens": (u.get("input_tokens_details") or {}).get("cached_tokens")}
    cached = u.get("cache_read_input_tokens")                     # Messages: input_tokens is the uncached part
    prompt = None
    if u.get("input_tokens") is not None:
        prompt = u["input_tokens"] + (cached or 0) + (u.get("cache_creation_input_tokens") or 0)
    return {"prompt_tokens": prompt, "completion_tokens": u.get("output_tokens"), "cached_tokens": cached}


def _merge(old: dict | None, new: dict) -> dict:
    """Later events fill in and correct earlier ones (message_delta's usage after message_start's)."""
    merged = dict(old or {})
    for k, v in new.items():
        if v is not None and (k != "prompt_tokens" or v or not merged.get(k)):
            merged[k] = v
    for k in ("prompt_tokens", "cached_tokens", "completion_tokens"):
        merged.setdefault(k, None)
    return merged


def errors_of(payloads: list[dict]) -> list[dict]:
    """The error events of a stream: Anthropic's and Responses' `error` (and Responses'
    `response.failed`), and a chat stream's `{"error": ...}` chunk."""
    return [p for p in payloads if isinstance(p, dict)
            and (p.get("type") in ("error", "response.failed") or ("type" not in p and "error" in p))]


def is_token(p: dict) -> bool:
    """Whether a stream event carries generated text, reasoning or a call: the first such
    event is the time to first token."""
    kind = p.get("type", "") if isinstance(p, dict) else ""
    if kind == "content_block_delta" or kind.endswith(".delta"):
        return True
    if kind == "response.output_item.added":
        return (p.get("item") or {}).get("type") == "function_call"
    for choice in p.get("choices", ()) if isinstance(p, dict) else ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") or choice.get("text"):
            return True
    return False


class Answer:
    """One answer read as it streams: its bytes, and the time its first token came."""

    def __init__(self, streamed: bool):
        self.streamed, self.t0, self.ttft, self.chunks, self._tail = streamed, time.perf_counter(), None, [], ""

    def feed(self, chunk: bytes) -> None:
        self.chunks.append(chunk)
        if self.streamed and self.ttft is None:
            self._tail += chunk.decode("utf-8", "replace")
            events, _, self._tail = self._tail.rpartition("\n\n")
            if any(is_token(p) for p in sse_payloads(events)):
                self.ttft = time.perf_counter() - self.t0

    def record(self) -> dict:
        text = b"".join(self.chunks).decode("utf-8", "replace")
        if self.streamed:
            payloads = sse_payloads(text)
        else:
            try:
                payloads = [json.loads(text)]
            except ValueError:
                payloads = []
        ttft = self.ttft if self.streamed else time.perf_counter() - self.t0
        return {"usage": usage_of(payloads), "errors": errors_of(payloads) if self.streamed else [],
                "ttft_s": None if ttft is None else round(ttft, 3)}


# ---- recording -----------------------------------------------------------------------

class Recorder:
    """An HTTP proxy on 127.0.0.1:port (0: a free one) in front of `upstream`, appending one
    JSON line a request to `path`. `records` holds the same lines in memory."""

    def __init__(self, upstream: str, path: str | Path | None = None, port: int = 0):
        self.upstream, self.path, self.records, self._lock = upstream.rstrip("/"), path, [], threading.Lock()
        self.http = httpx.Client(timeout=httpx.Timeout(3600, connect=10))
        recorder = self

        class Handler(_ProxyHandler):
            owner = recorder

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def add(self, record: dict) -> None:
        with self._lock:
            self.records.append(record)
            if self.path is not None:
                with open(self.path, "a") as f:
                    f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _ProxyHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    owner: Recorder

    def log_message(self, *args):               # the session file is the log
        pass

    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            parts = []
            while (size := int(self.rfile.readline().split(b";")[0], 16)):
                parts.append(self.rfile.read(size))
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
            return b"".join(parts)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _proxy(self):
        body = self._body()
        path, _, query = self.path.partition("?")
        headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        record = {"method": self.command, "path": path, "query": query,
                  "headers": {k: self.headers[k] for k in KEPT_HEADERS if k in self.headers}, "body": parsed}
        streamed = isinstance(parsed, dict) and bool(parsed.get("stream"))
        answer = Answer(streamed)
        upstream = self.owner.http
        try:
            with upstream.stream(self.command, self.owner.upstream + self.path, content=body,
                                 headers=headers) as r:
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for chunk in r.iter_raw():
                    answer.feed(chunk)
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
                record["status"] = r.status_code
        except httpx.HTTPError as e:
            record["status"] = 502
            self.send_error(502, f"upstream: {e}")
        record.update(answer.record())
        self.owner.add(record)

    do_GET = do_POST = do_PUT = do_DELETE = _proxy


def load(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# ---- replaying -----------------------------------------------------------------------

def replay(url: str, records: list[dict], api_key: str | None = None) -> list[dict]:
    """Each recorded POST sent again to the server at url, in order; one row a request:
    its path, status, usage, error events and time to first token."""
    rows = []
    auth = {"Authorization": f"Bearer {api_key}", "x-api-key": api_key} if api_key else {}
    with httpx.Client(timeout=3600, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for rec in records:
            if rec.get("method") != "POST" or rec.get("body") is None:
                continue
            target = url.rstrip("/") + rec["path"] + (f"?{rec['query']}" if rec.get("query") else "")
            streamed = bool(rec["body"].get("stream"))
            answer = Answer(streamed)
            with http.stream("POST", target, json=rec["body"], headers={**rec.get("headers", {}), **auth}) as r:
                for chunk in r.iter_raw():
                    answer.feed(chunk)
                status = r.status_code
            rows.append({"path": rec["path"], "status": status, **answer.record()})
    return rows


def session_summary(rows: list[dict]) -> dict:
    """Over a session: requests, prompt and cached tokens summed, the times to first token
    summed, and the requests answered with an error (a status of 400 or more, or an error
    event in the stream)."""
    usages = [r["usage"] or {} for r in rows]
    return {"requests": len(rows),
            "prompt_tokens": sum(u.get("prompt_tokens") or 0 for u in usages),
            "cached_tokens": sum(u.get("cached_tokens") or 0 for u in usages),
            "ttft_s_total": round(sum(r["ttft_s"] or 0 for r in rows), 3),
            "failed": [i for i, r in enumerate(rows) if r["status"] >= 400 or r["errors"]]}
