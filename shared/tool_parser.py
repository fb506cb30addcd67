"""What a Qwen3.5/3.6 model writes -> reasoning, content and tool calls, incrementally.

A pure state machine fed the text pieces a generation streams (any split, even inside a tag);
each feed() returns the events that piece decided, finish() those of the end:

    ("reasoning", text)    ("content", text)
    ("call", index, id, name)      a tool call begins (OpenAI's first delta of a call)
    ("args", index, fragment)      the next piece of its `arguments` JSON text

Reasoning. With thinking on, the Qwen templates end the prompt with `<think>\\n`, so the output
starts inside the reasoning and only closes it: `</think>` ends it, and so does a `<tool_call>`
that opens a call to a known function (the model sometimes calls before closing; vLLM and
llama.cpp read it so). Output cut before either is all reasoning. A `<think>` the model opens
itself at the very start (templates that leave it to the model) starts reasoning too.
`reasoning_format="none"` keeps all of it, tags included, in the content.

Tool calls, in the Qwen3-Coder XML format the templates teach:

    <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

- A call starts at `<tool_call>` followed by `<function=NAME>` with NAME one of the tools;
  anything else (`<tool_call>` in prose, an unknown function) stays text of its channel.
- Values are raw text: one newline after `<parameter=ARG>` and one before `</parameter>` are
  the format's; a value may span lines and contain `<`, `<tool_call>`, even `</parameter>`.
  Where a value ends is one rule, VALUE_END below (shared/grammar.py forbids it inside a
  forced string value, so that what the grammar lets the model write parses back as the
  grammar read it): a `</parameter>` between newlines (the format's) ends the value, and
  elsewhere only when what follows, after blanks, is
  `<parameter=`, `</function>` or `</tool_call>`, or the end of the output (as
  vLLM's qwen3_coder tells them apart); so does a `</function>` so followed (the
  `</parameter>` left out), and any `</tool_call>`. A missing newline before `</parameter>`
  is taken (llama.cpp #26763).
- Values are typed by the tool's JSON schema, as vLLM converts them: strings stay raw text and
  stream as they come, JSON-escaped; integers, numbers, booleans, objects and arrays are
  parsed (`True`/`None` as Qwen3.5's template writes them back too) and sent whole when the
  value ends; `null` is null; a value that does not parse as its type stays a string, as does
  a parameter the schema does not name.
- Text between parameters that is no tag is dropped; a call the output ends inside is closed
  (its arguments stay valid JSON; the finish reason says it was cut).
- Text before a call and after it is content; leading and trailing whitespace around the
  reasoning and calls is the format's, not content.
"""
from __future__ import annotations

import ast
import json
import math
import re
import uuid

THINK, END_THINK, TOOL_CALL, END_TOOL_CALL = "<think>", "</think>", "<tool_call>", "</tool_call>"
FUNCTION, END_FUNCTION, PARAMETER, END_PARAMETER = "<function=", "</function>", "<parameter=", "</parameter>"
NAME_MAX = 256
_FUNCTION_RE = re.compile(r"\s*<function=([^<>\n]{1,%d})>" % NAME_MAX)
_PARAMETER_RE = re.compile(r"<parameter=([^<>\n]{1,%d})>" % NAME_MAX)
_NAME_CHARS_RE = re.compile(r"[^<>\n]{0,%d}" % NAME_MAX)
# The rule of where a raw value ends, written once: the parser reads values by it, and the
# forced-call grammar (shared/grammar.py) keeps it out of a string value. `VALUE_END` is the
# regex (Python's and llguidance's syntax alike) of a closing tag that ends the value before
# it: `</parameter>` or `</function>` followed, after blanks, by a tag that goes on with the
# call, or `</tool_call>` (as text or its token). The end of the output after the first two
# ends a value too (the parser's `final`); a grammar's value is never last.
BLANKS = r"[ \t\r\n]*"
_FOLLOW = r"(?:</function>|</tool_call>|<parameter=)"
VALUE_END = r"\n</parameter>\n|(?:</parameter>|</function>)%s%s|</tool_call>" % (BLANKS, _FOLLOW)
_FOLLOW_RE = re.compile(BLANKS + _FOLLOW)
REASONING_FORMATS = ("deepseek", "none")


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_schemas(tools) -> dict[str, dict]:
    """Function name -> its parameters' properties (None: the schema lists none), from OpenAI tools."""
    out = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
            props = params.get("properties")
            out[fn["name"]] = props if isinstance(props, dict) and props else None
    return out


def _is_prefix(text: str, *tags: str) -> bool:
    return any(len(text) < len(t) and t.startswith(text) for t in tags)


class ToolCallParser:
    def __init__(self, tools=None, reasoning: bool = False, reasoning_format: str = "deepseek",
                 call_id=new_call_id):
        self.schemas = tool_schemas(tools)          # empty: calls are not parsed (no tools, tool_choice none)
        self.split = reasoning_format != "none"
        self.call_id = call_id
        self.state = "reasoning" if reasoning else "text"
        self.at_start = not reasoning               # a <think> the model opens itself, first thing
        self.buf = ""
        self.events: list[tuple] = []
        self.pending_ws = {"reasoning": "", "content": ""}
        self.lead = {"reasoning": reasoning, "content": False}
        self.calls: list[dict] = []                 # {"id", "name", "arguments", "complete"}
        self.head_from = "text"
        self.fn: str | None = None
        self.param: tuple[str, str] | None = None   # (name, kind) of the open value
        self.value = ""                             # held part of the open value
        self.value_sent = False                     # a string value's opening quote is out
        self.value_start = False
        self.n_params = 0

    # ---- the interface ---------------------------------------------------------------------
    def feed(self, text: str) -> list[tuple]:
        self.buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[tuple]:
        self._run(final=True)
        if self.state == "value":
            self._close_value()
        if self.state in ("body", "value"):
            self._close_call(complete=False)
        for channel in ("reasoning", "content"):
            if self.pending_ws[channel] and channel == "content":
                self._out(channel, self.pending_ws[channel])
            self.pending_ws[channel] = ""
        return self._take()

    def _take(self) -> list[tuple]:
        events, self.events = self.events, []
        return events

    # ---- emission ------------------------------------------------------------------------------
    def _out(self, channel: str, text: str) -> None:
        if self.events and self.events[-1][0] == channel:
            self.events[-1] = (channel, self.events[-1][1] + text)
        else:
            self.events.append((channel, text))

    def _text(self, channel: str, text: str) -> None:
        """Text of a channel; whitespace at its edges is held until text follows it."""
        if not self.split:
            channel = "content"
        if self.lead[channel]:
            text = text.lstrip()
            if not text:
                return
            self.lead[channel] = False
        text = self.pending_ws[channel] + text
        body = text.rstrip()
        self.pending_ws[channel] = text[len(body):]
        if body:
            self._out(channel, body)

    def _args(self, fragment: str) -> None:
        index = len(self.calls) - 1
        self.calls[index]["arguments"] += fragment
        if self.events and self.events[-1][0] == "args" and self.events[-1][1] == index:
            self.events[-1] = ("args", index, self.events[-1][2] + fragment)
        else:
            self.events.append(("args", index, fragment))

    # ---- the machine -------------------------------------------------------------------------
    def _run(self, final: bool) -> None:
        step = {"reasoning": self._prose, "text": self._prose, "head": self._head, "body": self._body,
                "value": self._value, "tail": self._tail}
        while self.buf and step[self.state](final):
            pass

    def _prose(self, final: bool) -> bool:
        """Reasoning or content: up to the next tag that changes state."""
        channel = "reasoning" if self.state == "reasoning" else "content"
        if self.at_start:
            lead = self.buf.lstrip()
            if not final and (not lead or _is_prefix(lead, THINK)):
                return False
            self.at_start = False
            if lead.startswith(THINK):
                self.buf = lead[len(THINK):]
                self.state, self.lead["reasoning"] = "reasoning", True
                if not self.split:
                    self._text("content", THINK)
                return True
        tags = ([END_THINK] if self.state == "reasoning" else []) + ([TOOL_CALL] if self.schemas else [])
        hits = [(self.buf.find(t), t) for t in tags if t in self.buf]
        if not hits:
            keep = 0 if final else max((k for t in tags for k in range(1, len(t)) if self.buf.endswith(t[:k])),
                                       default=0)
            self._text(channel, self.buf[:len(self.buf) - keep])
            self.buf = self.buf[len(self.buf) - keep:]
            return False
        at, tag = min(hits)
        self._text(channel, self.buf[:at])
        self.buf = self.buf[at + len(tag):]
        if tag == END_THINK:
            if self.split:
                self.pending_ws["reasoning"] = ""
            else:
                self._text("content", END_THINK)
            self.state, self.lead["content"] = "text", self.split
        else:
            self.head_from, self.state = self.state, "head"
        return True

    def _head(self, final: bool) -> bool:
        """After <tool_call>: a call only if <function=KNOWN> follows."""
        m = _FUNCTION_RE.match(self.buf)
        if m and m.group(1).strip() in self.schemas:
            self.buf = self.buf[m.end():]
            self.pending_ws["reasoning" if self.split and self.head_from == "reasoning" else "content"] = ""
            self.calls.append({"id": self.call_id(), "name": m.group(1).strip(), "arguments": "", "complete": False})
            self.events.append(("call", len(self.calls) - 1, self.calls[-1]["id"], self.calls[-1]["name"]))
            self.fn, self.n_params, self.state = self.calls[-1]["name"], 0, "body"
            self._args("{")
            return True
        lead = self.buf.lstrip()
        pending = (not m and not final and
                   (_is_prefix(lead, FUNCTION) or
                    (lead.startswith(FUNCTION) and _NAME_CHARS_RE.fullmatch(lead[len(FUNCTION):]))))
        if pending:
            return False
        self.state = self.head_from                 # not a call: the tag was text
        self._text("reasoning" if self.state == "reasoning" else "content", TOOL_CALL)
        return True

    def _body(self, final: bool) -> bool:
        """Inside <function=...>: parameters, then </function>."""
        lead = self.buf.lstrip()
        if not lead:
            self.buf = ""
            return False
        m = _PARAMETER_RE.match(lead)
        if m:
            self.buf = lead[m.end():]
            self._open_value(m.group(1).strip())
            return True
        for tag, state in ((END_FUNCTION, "tail"), (END_TOOL_CALL, "text")):
            if lead.startswith(tag):
                self.buf = lead[len(tag):]
                self._close_call(complete=True)
                self.state = state
                return True
        if not final and (_is_prefix(lead, PARAMETER, END_FUNCTION, END_TOOL_CALL) or
                          (lead.startswith(PARAMETER) and _NAME_CHARS_RE.fullmatch(lead[len(PARAMETER):]))):
            self.buf = lead
            return False
        cut = lead.find("<", 1)                     # not a tag: dropped, up to the next one
        self.buf = lead[cut:] if cut > 0 else ""
        return bool(self.buf)

    def _tail(self, final: bool) -> bool:
        lead = self.buf.lstrip()
        if not final and (not lead or _is_prefix(lead, END_TOOL_CALL)):
            return False
        self.buf = lead[len(END_TOOL_CALL):] if lead.startswith(END_TOOL_CALL) else self.buf
        self.state = "text"
        return True

    def _value(self, final: bool) -> bool:
        if self.value_start:
            self.value_start = False
            if self.buf.startswith("\n"):
                self.buf = self.buf[1:]
                self.after_newline = True
                return True
        at = self.buf.find("<")
        if at < 0:
            self._value_text(self.buf)
            self.buf = ""
            return False
        self._value_text(self.buf[:at])
        self.buf = rest = self.buf[at:]
        if rest.startswith(END_PARAMETER):
            after = rest[len(END_PARAMETER):]
            closes = True if self.after_newline and after.startswith("\n") else self._closes(after, final)
            if closes is None:
                return False
            if closes:
                self.buf = rest[len(END_PARAMETER):]
                self._close_value()
                self.state = "body"
                return True
            self._value_text(END_PARAMETER)
            self.buf = rest[len(END_PARAMETER):]
            return True
        if rest.startswith(END_FUNCTION) or rest.startswith(END_TOOL_CALL):   # </parameter> left out
            tag = END_FUNCTION if rest.startswith(END_FUNCTION) else END_TOOL_CALL
            closes = self._closes(rest, final) if tag == END_TOOL_CALL else self._closes(rest[len(tag):], final)
            if closes is None:
                return False
            if closes:
                self._close_value()
                self.state = "body"
                return True
            self._value_text(tag)
            self.buf = rest[len(tag):]
            return True
        if _is_prefix(rest, END_PARAMETER, END_FUNCTION, END_TOOL_CALL):
            if final:               # the output ends inside the closing tag
                self.buf = ""
            return False
        self._value_text("<")
        self.buf = rest[1:]
        return True

    def _closes(self, after: str, final: bool) -> bool | None:
        """Whether a closing tag followed by `after` really closes the value (VALUE_END; None:
        not known yet)."""
        if _FOLLOW_RE.match(after):
            return True
        lead = after.lstrip(" \t\r\n")
        if not lead or _is_prefix(lead, END_FUNCTION, END_TOOL_CALL, PARAMETER):
            return True if final else None
        return False

    # ---- values --------------------------------------------------------------------------------
    def _open_value(self, name: str) -> None:
        kind = param_kind((self.schemas.get(self.fn) or {}).get(name), name in (self.schemas.get(self.fn) or {}))
        self._args((", " if self.n_params else "") + json.dumps(name, ensure_ascii=False) + ": ")
        self.n_params += 1
        self.param, self.value, self.value_sent, self.value_start = (name, kind), "", False, True
        self.after_newline = False                  # the raw text before a closing tag ends with a newline
        self.state = "value"

    def _value_text(self, text: str) -> None:
        if not text:
            return
        self.after_newline = text.endswith("\n")
        self.value += text
        if self.param[1] != "string":
            return
        # a string streams as it comes, less a trailing newline (the format's, if </parameter> follows)
        # and while it could still be `null`
        if not self.value_sent:
            if _is_prefix(self.value.rstrip("\n").lower(), "null") or self.value.rstrip("\n").lower() == "null":
                return
            self._args('"')
            self.value_sent = True
        body = self.value[:-1] if self.value.endswith("\n") else self.value
        if body:
            self._args(json.dumps(body, ensure_ascii=False)[1:-1])
        self.value = self.value[len(body):]

    def _close_value(self) -> None:
        name, kind = self.param
        raw = self.value[:-1] if self.value.endswith("\n") else self.value
        if kind == "string":
            if self.value_sent:
                self._args(json.dumps(raw, ensure_ascii=False)[1:-1] + '"')
            else:
                self._args("null" if raw.lower() == "null" else json.dumps(raw, ensure_ascii=False))
        else:
            self._args(json.dumps(convert(raw, kind), ensure_ascii=False))
        self.param, self.value = None, ""

    def _close_call(self, complete: bool) -> None:
        self._args("}")
        self.calls[-1]["complete"] = complete
        self.fn = None
        self.lead["content"] = self.split


def param_kind(schema, known: bool) -> str:
    """How a parameter's value is read: "string" (raw text), a JSON type, or "any" (JSON if it parses)."""
    if not known or not isinstance(schema, dict):
        return "string"
    t = schema.get("type")
    types = t if isinstance(t, list) else [t] if isinstance(t, str) else []
    if "string" in types or (not types and isinstance(schema.get("enum"), list)
                             and all(isinstance(e, str) for e in schema["enum"])):
        return "string"
    types = [x for x in types if x != "null"]
    return types[0] if len(types) == 1 else "any"


def convert(raw: str, kind: str):
    """A non-string value's text as its schema type says (vLLM's qwen3_coder rules); failing that, the text."""
    v = raw.strip()
    if v.lower() in ("null", "none"):
        return None
    try:
        if kind == "integer":
            return int(v)
        if kind == "number":
            f = float(v)
            if not math.isfinite(f):
                return raw
            return int(f) if f.is_integer() and not re.search(r"[.eE]", v) else f
        if kind == "boolean":
            return {"true": True, "false": False}.get(v.lower(), raw)
    except ValueError:
        return raw
    try:
        value = json.loads(v)
    except json.JSONDecodeError:
        try:
            value = ast.literal_eval(v) if kind in ("object", "array") else raw
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return raw
    if kind == "object" and not isinstance(value, dict) or kind == "array" and not isinstance(value, list):
        return raw
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return raw
    return value
