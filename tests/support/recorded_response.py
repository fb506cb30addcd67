"""A response object of the HTTP front end fed recorded model text, no model and no daemon:
the bytes it would send, for the tests of each API's rendering."""
from __future__ import annotations

import asyncio

from frontend.upstream import RequestStream
from shared import protocol as P

# A thinking model's reply, as its tokens' text: reasoning, then a tool call in Qwen3.5's format
# (split mid-tag and mid-UTF-8 word as a tokenizer splits it).
RECORDED = ["The user", " wants a.py.", "\n", "</think>", "\n\n", "Reading", " it.", "\n\n", "<tool_call>", "\n<",
            "function=read", "_file>\n<parameter=", "path>\nsrc/ü", "nï.py\n</parameter>\n<parameter=limit>\n",
            "20\n</parameter>\n</function>\n", "</tool_call>"]

# A call whose values have each JSON type (the schema's), and its arguments as every API must send
# them: an integer stays `3`, a number written `4` stays `4` (vLLM's rule), `True` is true.
TYPED_SCHEMA = {"type": "object", "properties": {
    "n": {"type": "integer"}, "ratio": {"type": "number"}, "whole": {"type": "number"}, "on": {"type": "boolean"},
    "tags": {"type": "array"}, "note": {"type": ["string", "null"]}}}
TYPED_CALL = ["x\n</think>\n\n<tool_call>\n<function=configure>\n<parameter=n>\n3\n</parameter>\n",
              "<parameter=ratio>\n2.50\n</parameter>\n<parameter=whole>\n4\n</parameter>\n<parameter=on>\nTrue",
              "\n</parameter>\n<parameter=tags>\n[1, 2.0]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n",
              "</function>\n</tool_call>"]
TYPED_ARGUMENTS = '{"n": 3, "ratio": 2.5, "whole": 4, "on": true, "tags": [1, 2.0], "note": null}'


class NoUpstream:
    """The upstream a response cancels through when its client leaves: nothing is open."""

    def cancel(self, rid, on_done=None):
        return False


def answer(make, pieces, request_id: str = "r", finish: str = "stop", **done) -> bytes:
    """The bytes of the HTTP body that make(stream) sends for `pieces` of model text, then a
    Done with `finish` and the `done` fields."""
    async def go():
        stream, sent = RequestStream(request_id), []
        for i, text in enumerate(pieces):
            stream.push(P.Token(request_id=request_id, token=i, text=text))
        stream.push(P.Done(request_id=request_id, finish_reason=finish, completion_tokens=len(pieces), **done))
        response = make(stream)

        async def receive():
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)
        await response(None, receive, send)
        return b"".join(m.get("body", b"") for m in sent[1:])
    return asyncio.run(asyncio.wait_for(go(), 20))
