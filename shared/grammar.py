"""Grammars for constrained decoding, written for llguidance (the library llama.cpp and vLLM
use): what a request's tool_choice or response_format demands, as text llguidance compiles.

A request's constraint (protocol.Constraint) is one of
- "json_schema": the output is a JSON value of that schema (response_format);
- "lark": llguidance's Lark dialect (the forced tool calls below are written in it);
- "regex": the whole output matches the regex.

`full_grammar` puts it after the reasoning: when the prompt leaves a `<think>` block open
(Qwen3.5/3.6 with thinking on end the prompt `<think>\\n`), any text may come first, up to the
`</think>` token; only then does the constraint apply, as vLLM applies response_format only
after the reasoning ends. `</think>`, `<tool_call>` are written `<name>` in the Lark, which
llguidance reads as the vocabulary's special token of that spelling: the model emits them as
single tokens, and a quoted "<tool_call>" would match only the byte spelling. Whitespace is
allowed between the reasoning (or the start) and the constrained part.

JSON is compiled with fixed separators (", " and ": ", as Python and the chat templates'
tojson write it) and no free whitespace: a model cannot loop on blanks inside a value.

Forced tool calls use the model's own Qwen3-Coder XML format, exactly as the chat template
teaches it and shared/tool_parser.py reads it:

    <tool_call>\\n<function=NAME>\\n<parameter=ARG>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>

A parameter whose schema type is string (shared.tool_parser.param_kind) is raw text between
the format's newlines, `\\n</parameter>\\n` after it (its enum/const as alternatives,
minLength/maxLength as bounds); any other is JSON of its own schema (`%json`). Where a string
value ends is the parser's rule, shared.tool_parser.VALUE_END, not a second one: the value is
one greedy lexeme that may hold no VALUE_END (llguidance's `& ~`), so it may contain
`</parameter>` followed by other text, and it ends only at the `\\n</parameter>\\n` that the
next `<parameter=` or `</function>` follows, where the parser ends it too. A value the parser
would read as null (`null`, any case) is refused unless the schema allows null. Parameters
come in the schema's order (the order the template renders them back in, the arguments'
order): required ones always, optional ones may be left out. Parallel calls are joined by a
newline, as the template joins them.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

from .errors import GrammarError
from .tool_parser import VALUE_END, param_kind

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# before the answer: the blank lines a model writes after </think>, bounded, so that a weak
# model cannot spend its whole budget on whitespace before the constrained part
WS = r"/[ \t\r\n]{0,4}/"
REASONING = r"/(?s:.*)/"
KINDS = ("json_schema", "lark", "regex", "gbnf")


def _lit(text: str) -> str:
    """A Lark string literal of `text`."""
    return json.dumps(text, ensure_ascii=False)


def _schema(schema, defs: dict | None = None) -> dict:
    """A JSON schema with the JSON options, and the root's definitions for a nested part's $refs."""
    out = dict(schema) if isinstance(schema, dict) else {}
    for key, value in (defs or {}).items():
        out.setdefault(key, value)
    out["x-guidance"] = {**JSON_OPTIONS, **(out.get("x-guidance") or {})}
    return out


def json_schema_text(schema) -> str:
    return json.dumps(_schema(schema), ensure_ascii=False)


# ---- forced tool calls ------------------------------------------------------------------------
def _nullable(schema: dict) -> bool:
    t = schema.get("type")
    return t == "null" or isinstance(t, list) and "null" in t


def _choices(schema: dict) -> list[str] | None:
    """A string parameter's enum/const as the strings the format can hold (None: free text)."""
    choices = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if "const" in schema:
        choices = [schema["const"]]
    if choices is None:
        return None
    strings = [c for c in choices if isinstance(c, str) and not re.search(f"(?:{VALUE_END})(?s:.+)", f"\n{c}\n</parameter>\n")
               and (c.lower() != "null" or _nullable(schema))]
    if not strings:
        raise GrammarError(f"a string parameter's enum has no string the tool-call format can hold ({choices!r})")
    return strings


def _free_string(rule: str, schema: dict) -> str:
    """A lexeme of a free string value: its newlines and the `</parameter>` that ends it,
    holding no VALUE_END but that last one, so that llguidance (which ends a greedy lexeme
    where it cannot go on) ends it there: where the parser ends it."""
    lo, hi = schema.get("minLength"), schema.get("maxLength")
    bounds = "*"
    if isinstance(lo, int) or isinstance(hi, int):
        bounds = "{%d,%s}" % (lo if isinstance(lo, int) else 0, hi if isinstance(hi, int) else "")
    end = VALUE_END.replace("/", "\\/")
    null = "" if _nullable(schema) else " & ~/\\n(?i:null)\\n<\\/parameter>\\n/"
    # an empty value may also come as `\n</parameter>` (one newline: the parser reads it as "",
    # and models write it so), not only as the template's `\n\n</parameter>`
    empty = "|\\n<\\/parameter>\\n" if not isinstance(lo, int) or lo <= 0 else ""
    return f"{rule}: /\\n(?s:.{bounds})\\n<\\/parameter>\\n{empty}/ & ~/(?s:.*)(?:{end})(?s:.+)/{null}"


def _function_rules(i: int, fn: dict) -> tuple[str, list[str]]:
    params = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = [r for r in params.get("required") or [] if isinstance(r, str)]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    names = list(props) + [r for r in required if r not in props]
    body, rules = [], []
    for j, name in enumerate(names):
        if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
            raise GrammarError(f"function {fn.get('name')!r}: parameter name {name!r} cannot be written in the "
                               "model's tool-call format")
        schema = props.get(name, {})
        schema = schema if isinstance(schema, dict) else {}
        value = f"f{i}_v{j}"
        strings = _choices(schema) if param_kind(schema, name in props) == "string" else None
        if param_kind(schema, name in props) == "string" and strings is None:
            value = value.upper()                   # a lexeme
            rules.append(_free_string(value, schema))
        else:
            what = (f"({' | '.join(_lit(c) for c in strings)})" if strings is not None
                    else f"%json {json.dumps(_schema(schema, defs), ensure_ascii=False)}")
            rules.append(f"{value}: \"\\n\" {what} {_lit(chr(10) + '</parameter>' + chr(10))}")
        rules.append(f"f{i}_p{j}: {_lit(f'<parameter={name}>')} {value}")
        body.append(f"f{i}_p{j}" + ("" if name in required else "?"))
    head = _lit(f"<function={fn['name']}>\n")
    rules.append(f"f{i}: {head} {' '.join(body)} {_lit('</function>' + chr(10))}")
    return f"f{i}", rules


def tool_call_lark(tools: list[dict], parallel: bool = True, start: str = "start") -> str:
    """A Lark grammar of one tool call (several, if `parallel`) to one of `tools` (OpenAI
    function tools), in the model's XML format; its rule `start` is the whole."""
    fns = [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if not fns:
        raise GrammarError("no function tool to call")
    alts, rules = [], []
    for i, fn in enumerate(fns):
        name = fn.get("name")
        if not isinstance(name, str) or not name or any(c in name for c in "<>\n"):
            raise GrammarError(f"function name {name!r} cannot be written in the model's tool-call format")
        alt, more = _function_rules(i, fn)
        alts.append(alt)
        rules += more
    repeat = ' ("\\n" call)*' if parallel else ""
    return "\n".join([f"{start}: call{repeat}",
                      f"call: <tool_call> \"\\n\" ({' | '.join(alts)}) </tool_call>", *rules]) + "\n"


def answer_or_calls_lark(schema, tools: list[dict], parallel: bool = True) -> str:
    """Lark: either a JSON value of `schema` (response_format) or tool calls (tool_choice auto)."""
    return (f"start: answer | calls\nanswer: %json {json_schema_text(schema)}\n"
            + tool_call_lark(tools, parallel, start="calls"))


# ---- the whole grammar ---------------------------------------------------------------------------
def full_grammar(kind: str, text: str, reasoning: bool) -> str:
    """llguidance's grammar (its JSON form) for a constraint, after the reasoning if `reasoning`."""
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema is an object, not {type(schema).__name__}")
        body = {"name": "body", "json_schema": _schema(schema) if isinstance(schema, dict) else schema}
    elif kind == "lark":
        body = {"name": "body", "lark_grammar": text}
    elif kind == "regex":
        import llguidance
        body = {"name": "body", "lark_grammar": f"start: /{llguidance.regex_to_lark(text)}/"}
    elif kind == "gbnf":                            # llama.cpp's grammars, as llguidance translates them
        import llguidance
        try:
            body = {"name": "body", "lark_grammar": llguidance.grammar_from("gbnf", text)}
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"the GBNF grammar does not parse: {e}") from None
    else:
        raise GrammarError(f"grammar kind {kind!r}: expected one of {', '.join(KINDS)}")
    # without reasoning the output is the body exactly, as llama.cpp applies a grammar
    top = f"start: {REASONING} </think> {WS} @body" if reasoning else "start: @body"
    return json.dumps({"grammars": [{"lark_grammar": top}, body]}, ensure_ascii=False)


def reasoning_open(tokens: list[int], tokenizer) -> bool:
    """Whether the prompt leaves a <think> block open (its last <think> token after its last
    </think>): the output then starts as reasoning, which the constraint lets through."""
    open_id, close_id = (tokenizer.token_to_id.get(t) for t in ("<think>", "</think>"))
    if open_id is None or close_id is None:
        return False
    for t in reversed(tokens):
        if t == open_id:
            return True
        if t == close_id:
            return False
    return False


def compile_constraint(constraint, tokens: list[int], tokenizer, n_vocab: int) -> str:
    """The grammar a worker masks a request's tokens with: `constraint` (protocol.Constraint)
    after the reasoning `tokens` (the prompt) leave open, checked against the vocabulary."""
    from .token_mask import ll_tokenizer
    grammar = full_grammar(constraint.kind, constraint.text, reasoning_open(tokens, tokenizer))
    check(grammar, ll_tokenizer(tokenizer, n_vocab))
    return grammar


def check(grammar: str, lltokenizer=None) -> None:
    """Raise GrammarError unless llguidance compiles `grammar` (with the model's vocabulary when
    given: the special tokens it names must be in it)."""
    import llguidance
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar, lltokenizer)
    except Exception as e:          # what llguidance could not even read is the request's fault too
        error = f"{type(e).__name__}: {e}"
    if error:
        raise GrammarError(error.strip())


@lru_cache(maxsize=256)
def checked_schema(text: str) -> None:
    """A JSON schema alone (no vocabulary needed): what the HTTP front end checks before queueing."""
    check(full_grammar("json_schema", text, reasoning=False))

