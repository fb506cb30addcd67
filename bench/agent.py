"""`fermoe bench agent MODEL`: a recorded coding-agent episode replayed through the HTTP
API, and how much of each turn's prompt the server found cached.

The episode (bench/data/agent_episode.json, written by bench/make_agent_episode.py) holds a
~3k-token system prompt, 8 tools, two user requests and the calls the agent makes with
their results. Each of its 12 generations is one streamed chat request with every message
so far; the served model's own text and reasoning come back in the next request as an
agent sends them (`reasoning_content`), followed by the recorded calls and their results.
So from the second turn on the prompt is the previous prompt, the previous generation, and
what the agent appended: a server that keeps its state across turns prefills only that.

`--session FILE` replays a session recorded from a real client instead (a JSON line a
request, as bench/agent_session.py's recorder writes them: `fermoe bench agent --record FILE
--upstream URL` puts the recorder in front of a server, and the client is pointed at it):
each request is sent again as the client sent it, in order, and the keys are then those of
SESSION_KEYS below.

Per turn: prompt tokens, cached tokens (`usage.prompt_tokens_details.cached_tokens`, or
llama-server's `timings.cache_n`), the tokens appended since the previous generation, and
the time to first token. `--llama-server URL` replays the same episode against a running
llama-server (same model file) in the same run.

JSON keys ("<server>": fermoe, and llama_server with --llama-server):
  model                   the GGUF path or built-in name given
  episode                 the episode file's name
  max_tokens              tokens generated a turn (--tokens)
  <server>                one replay of the episode against that server
  <server>.url            llama_server only: the URL given
  <server>.turns[]        one object a generation, in order
  <server>.turns[].prompt_tokens  the request's prompt tokens, as the server counts them
  <server>.turns[].cached_tokens  of them, those it found cached (null: it did not say)
  <server>.turns[].completion_tokens  tokens it generated
  <server>.turns[].ttft_s  s: from sending to the first content, reasoning or call
  <server>.turns[].appended_tokens  from the second turn on: the prompt tokens beyond the previous
                          prompt and its generation (what the agent appended)
  <server>.summary        over all turns
  <server>.summary.turns  generations
  <server>.summary.prompt_tokens  their prompt tokens, summed
  <server>.summary.cached_tokens  their cached tokens, summed
  <server>.summary.reprefilled_beyond_appended  from the second turn on, a list: the prompt
                          tokens prefilled beyond what was appended (0: only the new part was)
  <server>.summary.ttft_s_total  s: the turns' times to first token, summed

SESSION_KEYS, with --session FILE:
  model                   the GGUF path or built-in name given
  session                 the session file's name
  <server>.requests[]     one object a recorded request, in order
  <server>.requests[].path  its route (/v1/messages, /v1/responses, /v1/chat/completions)
  <server>.requests[].status  the HTTP status
  <server>.requests[].usage  {prompt_tokens, cached_tokens, completion_tokens} (null: none said)
  <server>.requests[].errors  the error events of its stream
  <server>.requests[].ttft_s  s: to the first generated token (streamed), or to the whole answer
  <server>.requests[].recorded  the usage and time to first token when it was recorded
  <server>.summary        requests, prompt_tokens, cached_tokens and ttft_s_total summed, and
                          `failed`: the indexes of the requests answered with an error
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

EPISODE = Path(__file__).resolve().parent / "data" / "agent_episode.json"


def _stream(http: httpx.Client, url: str, body: dict) -> dict:
    """One streamed chat request: its text, reasoning, first-token time and token counts."""
    t0, first, text, reasoning, usage, timings = time.perf_counter(), None, [], [], {}, {}
    with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {})
                if first is None and (delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls")):
                    first = time.perf_counter() - t0
                text.append(delta.get("content") or "")
                reasoning.append(delta.get("reasoning_content") or "")
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is None:
        cached = timings.get("cache_n")           # llama-server's count of prompt tokens it reused
    return {"text": "".join(text), "reasoning": "".join(reasoning), "ttft_s": first,
            "prompt_tokens": usage.get("prompt_tokens"), "completion_tokens": usage.get("completion_tokens"),
            "cached_tokens": cached}


def replay(url: str, episode: dict, max_tokens: int = 32, api_key: str | None = None,
           request: dict | None = None) -> list[dict]:
    """The episode's generations against the server at url, one row per turn; `request`:
    more fields for every request."""
    messages = [{"role": "system", "content": episode["system"]}]
    rows, previous = [], None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # a fresh connection a request: a server may close an idle one just as it is reused
    with httpx.Client(timeout=3600, headers=headers, limits=httpx.Limits(max_keepalive_connections=0)) as http:
        for i, turn in enumerate(episode["turns"]):
            if "user" in turn:
                messages.append({"role": "user", "content": turn["user"]})
            for call_id, result in zip(_ids(i - 1, episode), turn.get("results", [])):
                messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
            out = _stream(http, url, {"model": "agent", "messages": messages, "tools": episode["tools"],
                                      "max_tokens": max_tokens, "temperature": 0, "seed": 0, "stream": True,
                                      "stream_options": {"include_usage": True},
                                      "chat_template_kwargs": {"preserve_thinking": True}, **(request or {})})
            row = {k: out[k] for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}
            row["ttft_s"] = round(out["ttft_s"], 3) if out["ttft_s"] is not None else None
            if previous is not None and None not in (row["prompt_tokens"], previous["prompt_tokens"],
                                                     previous["completion_tokens"]):
                row["appended_tokens"] = row["prompt_tokens"] - previous["prompt_tokens"] - previous["completion_tokens"]
            rows.append(row)
            previous = row
            assistant = {"role": "assistant", "content": out["text"]}
            if out["reasoning"]:
                assistant["reasoning_content"] = out["reasoning"]
            if turn["calls"]:
                assistant["tool_calls"] = [{"id": cid, "type": "function", "function": {
                    "name": c["name"], "arguments": json.dumps(c["arguments"])}} for cid, c in zip(_ids(i, episode),
                                                                                                   turn["calls"])]
            messages.append(assistant)
    return rows


def _ids(i: int, episode: dict) -> list[str]:
    return [f"call_{i}_{j}" for j in range(len(episode["turns"][i]["calls"]))] if i >= 0 else []


def summary(rows: list[dict]) -> dict:
    """From the second turn on: the prompt tokens prefilled again beyond what was appended
    since the previous generation (0: nothing but the new part was prefilled)."""
    later = [r for r in rows[1:] if r.get("cached_tokens") is not None and "appended_tokens" in r]
    return {"turns": len(rows), "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in rows),
            "cached_tokens": sum(r["cached_tokens"] or 0 for r in rows),
            "reprefilled_beyond_appended": [r["prompt_tokens"] - r["cached_tokens"] - r["appended_tokens"]
                                            for r in later],
            "ttft_s_total": round(sum(r["ttft_s"] or 0 for r in rows), 3)}


def run(model: str, max_tokens: int = 32, llama_server: str | None = None, extra: list[str] = (),
        episode_path: Path = EPISODE) -> dict:
    from coordinator.launcher import stop_coordinator

    from .http import start_http_coordinator
    episode = json.loads(Path(episode_path).read_text())
    out = {"model": model, "episode": Path(episode_path).name, "max_tokens": max_tokens}
    with tempfile.TemporaryFile("w+") as log:
        daemon, _, url = start_http_coordinator(model, list(extra), log)
        try:
            rows = replay(url, episode, max_tokens)
        finally:
            stop_coordinator(daemon)
    out["fermoe"] = {"turns": rows, "summary": summary(rows)}
    if llama_server:
        rows = replay(llama_server.rstrip("/"), episode, max_tokens)
        out["llama_server"] = {"url": llama_server, "turns": rows, "summary": summary(rows)}
    return out


def run_session(model: str, session: Path, llama_server: str | None = None, extra: list[str] = ()) -> dict:
    from coordinator.launcher import stop_coordinator

    from .agent_session import load, replay as replay_session, session_summary
    from .http import start_http_coordinator
    records = [r for r in load(session) if r.get("method") == "POST" and r.get("body") is not None]
    out = {"model": model, "session": Path(session).name}

    def replayed(url: str) -> dict:
        rows = replay_session(url, records)
        for row, rec in zip(rows, records):
            row["recorded"] = {"usage": rec.get("usage"), "ttft_s": rec.get("ttft_s")}
        return {"requests": rows, "summary": session_summary(rows)}
    with tempfile.TemporaryFile("w+") as log:
        daemon, _, url = start_http_coordinator(model, list(extra), log)
        try:
            out["fermoe"] = replayed(url)
        finally:
            stop_coordinator(daemon)
    if llama_server:
        out["llama_server"] = {"url": llama_server, **replayed(llama_server.rstrip("/"))}
    return out


def record(upstream: str, path: Path, port: int) -> int:
    """The recorder in front of `upstream` until interrupted; a line on stderr says where."""
    from .agent_session import Recorder
    with Recorder(upstream, path, port) as recorder:
        print(f"recording requests to {upstream} into {path}: point the client at {recorder.url} "
              f"(Ctrl-C stops)", file=sys.stderr)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            pass
    print(json.dumps({"session": str(path), "requests": len(recorder.records)}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="fermoe bench agent")
    p.add_argument("model", nargs="?", help="the GGUF path or built-in name to serve (not with --record)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated a turn (default 32)")
    p.add_argument("--llama-server", default=None, metavar="URL",
                   help="also replay the episode against this running llama-server (the same model file)")
    p.add_argument("--episode", default=str(EPISODE), metavar="FILE",
                   help="the episode (default: the recorded one; bench/make_agent_episode.py --small writes one "
                        "that fits a 4k context)")
    p.add_argument("--session", default=None, metavar="FILE",
                   help="replay a session recorded from a real client (--record) instead of the episode")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="record a client's session: a proxy in front of --upstream, appending to FILE")
    p.add_argument("--upstream", default=None, metavar="URL", help="with --record: the server the proxy forwards to")
    p.add_argument("--port", type=int, default=0, help="with --record: the proxy's port on 127.0.0.1 (default: free)")
    args, daemon_options = p.parse_known_args(argv)      # the rest goes to the coordinator
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    if args.record:
        if not args.upstream:
            p.error("--record needs --upstream URL (the server to record)")
        return record(args.upstream, Path(args.record), args.port)
    if args.model is None:
        p.error("the model to serve is missing")
    if args.session:
        if not Path(args.session).is_file():
            p.error(f"--session {args.session}: no such file")
        print(json.dumps(run_session(args.model, Path(args.session), args.llama_server, daemon_options), indent=2))
        return 0
    print(json.dumps(run(args.model, args.tokens, args.llama_server, daemon_options, args.episode), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
