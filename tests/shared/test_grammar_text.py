"""shared/grammar.py's Lark text itself, compared exactly (no vocabulary needed): the rule of a
free string value (its bounds, its empty form, null refused unless allowed), enum and const
choices, a nested schema's $defs, required and optional parameters in order, names the format
cannot write refused. What these grammars accept is tested through llguidance in test_grammar.py."""
import json
from types import SimpleNamespace

import pytest

from shared.errors import GrammarError
from shared.grammar import (_choices, _free_string, _nullable, answer_or_calls_lark, check, full_grammar,
                            json_schema_text, reasoning_open, tool_call_lark)

JSON_OPTIONS = '"x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}'
# VALUE_END (shared/tool_parser.py) with its slashes escaped, as a Lark regex holds it
END = (r"\n<\/parameter>\n|(?:<\/parameter>|<\/function>)[ \t\r\n]*(?:<\/function>|<\/tool_call>|<parameter=)"
       r"|<\/tool_call>")
NO_END = r" & ~/(?s:.*)(?:" + END + r")(?s:.+)/"
NO_NULL = r" & ~/\n(?i:null)\n<\/parameter>\n/"


@pytest.mark.parametrize("schema, nullable", [
    ({"type": "null"}, True), ({"type": ["string", "null"]}, True), ({"type": "string"}, False),
    ({"type": ["string"]}, False), ({}, False), ({"type": "nonnull"}, False), ({"type": "NULL"}, False),
])
def test_nullable(schema, nullable):
    """Fault guarded: a type merely containing "null" as text, or a list without it, read as nullable."""
    assert _nullable(schema) is nullable


@pytest.mark.parametrize("schema, choices", [
    ({}, None), ({"enum": "ab"}, None), ({"type": "string"}, None),
    ({"enum": ["a", "b"]}, ["a", "b"]), ({"const": "x"}, ["x"]), ({"enum": ["a"], "const": "b"}, ["b"]),
    ({"enum": ["a", 1, None]}, ["a"]),                                      # not strings
    ({"enum": ["null", "Null", "x"]}, ["x"]),                               # read back as null
    ({"enum": ["NULL", "x"], "type": ["string", "null"]}, ["NULL", "x"]),   # null allowed
    ({"enum": ["a\n</parameter>\n<parameter=b>", "a</function>\n</tool_call>", "ok </parameter> x"]},
     ["ok </parameter> x"]),                                                # the parser would end it early
])
def test_choices(schema, choices):
    assert _choices(schema) == choices


def test_choices_none_writable_is_an_error_naming_them():
    with pytest.raises(GrammarError, match=r"^a string parameter's enum has no string the tool-call format can "
                                           r"hold \(\[1, 'null'\]\)$"):
        _choices({"enum": [1, "null"]})


@pytest.mark.parametrize("schema, rule", [
    ({}, r"S: /\n(?s:.*)\n<\/parameter>\n|\n<\/parameter>\n/" + NO_END + NO_NULL),
    ({"type": ["string", "null"]}, r"S: /\n(?s:.*)\n<\/parameter>\n|\n<\/parameter>\n/" + NO_END),
    ({"maxLength": 5}, r"S: /\n(?s:.{0,5})\n<\/parameter>\n|\n<\/parameter>\n/" + NO_END + NO_NULL),
    ({"minLength": 0}, r"S: /\n(?s:.{0,})\n<\/parameter>\n|\n<\/parameter>\n/" + NO_END + NO_NULL),
    ({"minLength": 1}, r"S: /\n(?s:.{1,})\n<\/parameter>\n/" + NO_END + NO_NULL),      # no empty form
    ({"minLength": 2, "maxLength": 3}, r"S: /\n(?s:.{2,3})\n<\/parameter>\n/" + NO_END + NO_NULL),
    ({"minLength": "2", "maxLength": None}, r"S: /\n(?s:.*)\n<\/parameter>\n|\n<\/parameter>\n/" + NO_END + NO_NULL),
])
def test_free_string_rule(schema, rule):
    """Fault guarded: a bound misread or defaulted wrong, the short empty form allowed under a
    minLength of 1 (or refused at 0), null refused where the schema allows it (or let through)."""
    assert _free_string("S", schema) == rule


TOOL = {"type": "function", "function": {"name": "größe", "parameters": {
    "type": "object", "required": ["mode", "n", "extra"], "$defs": {"N": {"type": "integer"}},
    "definitions": {"M": {"type": "number"}},
    "properties": {"maß": {"type": "string", "maxLength": 5}, "mode": {"enum": ["a", "b"]},
                   "n": {"$ref": "#/$defs/N"}, "m": {"$ref": "#/definitions/M"}, "note": {"type": "string", "const": "é"},
                   "k": {"type": "integer", "enum": [1, 2], "title": "ñ"}, "s": "not a schema"}}}}
PING = {"type": "function", "function": {"name": "ping", "parameters": "not an object"}}


def test_the_lark_of_a_forced_call():
    """The whole grammar of one call, by hand: parameters in the schema's order then the
    required ones it does not list (free strings), optional ones marked `?`, non-ASCII as
    written, a nested schema carrying the root's definitions, a tool without usable
    parameters an empty call (fault guarded: any rule of it written otherwise)."""
    defs = '"$defs": {"N": {"type": "integer"}}, "definitions": {"M": {"type": "number"}}, ' + JSON_OPTIONS
    expected = "\n".join([
        "start: call",
        'call: <tool_call> "\\n" (f0 | f1) </tool_call>',
        r"F0_V0: /\n(?s:.{0,5})\n<\/parameter>\n|\n<\/parameter>\n/" + NO_END + NO_NULL,
        'f0_p0: "<parameter=maß>" F0_V0',
        'f0_v1: "\\n" ("a" | "b") "\\n</parameter>\\n"',
        'f0_p1: "<parameter=mode>" f0_v1',
        'f0_v2: "\\n" %json {"$ref": "#/$defs/N", ' + defs + '} "\\n</parameter>\\n"',
        'f0_p2: "<parameter=n>" f0_v2',
        'f0_v3: "\\n" %json {"$ref": "#/definitions/M", ' + defs + '} "\\n</parameter>\\n"',
        'f0_p3: "<parameter=m>" f0_v3',
        'f0_v4: "\\n" ("é") "\\n</parameter>\\n"',
        'f0_p4: "<parameter=note>" f0_v4',
        'f0_v5: "\\n" %json {"type": "integer", "enum": [1, 2], "title": "ñ", ' + defs + '} "\\n</parameter>\\n"',
        'f0_p5: "<parameter=k>" f0_v5',
        'f0_v6: "\\n" %json {' + defs + '} "\\n</parameter>\\n"',
        'f0_p6: "<parameter=s>" f0_v6',
        r"F0_V7: /\n(?s:.*)\n<\/parameter>\n|\n<\/parameter>\n/" + NO_END + NO_NULL,
        'f0_p7: "<parameter=extra>" F0_V7',
        'f0: "<function=größe>\\n" f0_p0? f0_p1 f0_p2 f0_p3? f0_p4? f0_p5? f0_p6? f0_p7 "</function>\\n"',
        'f1: "<function=ping>\\n"  "</function>\\n"',
    ]) + "\n"
    assert tool_call_lark([TOOL, PING, {"type": "function"}, "junk"], parallel=False) == expected


def test_parallel_calls_and_answer_or_calls():
    """Fault guarded: parallel calls not the default of answer_or_calls_lark, or its answer
    schema dropped or \\u-escaped."""
    assert tool_call_lark([PING]).startswith('start: call ("\\n" call)*\n')
    assert answer_or_calls_lark({"description": "é"}, [PING]) == "\n".join([
        "start: answer | calls",
        'answer: %json {"description": "é", ' + JSON_OPTIONS + "}",
        'calls: call ("\\n" call)*',
        'call: <tool_call> "\\n" (f0) </tool_call>',
        'f0: "<function=ping>\\n"  "</function>\\n"']) + "\n"
    assert json_schema_text({"title": "ü"}) == '{"title": "ü", ' + JSON_OPTIONS + "}"


@pytest.mark.parametrize("bad", ["a<b", "a>b", "a\nb", ""])
def test_a_parameter_name_the_format_cannot_write_is_refused(bad):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "properties": {"ok": {"type": "string"}, bad: {"type": "string"}}}}}]
    with pytest.raises(GrammarError, match=r"^function 'f': parameter name %s cannot be written in the model's "
                                           r"tool-call format$" % repr(bad).replace("\\", "\\\\")):
        tool_call_lark(tools)


def test_required_names_that_are_not_strings_are_ignored():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": {}, "required": [5, None]}}}]
    assert tool_call_lark(tools, parallel=False).endswith('f0: "<function=f>\\n"  "</function>\\n"\n')


class _Tok(SimpleNamespace):
    pass


@pytest.mark.parametrize("ids, tokens, open_", [
    ({"<think>": 5, "</think>": 6}, [1, 5, 2], True),
    ({"<think>": 5, "</think>": 6}, [5, 2, 6, 3], False),
    ({"<think>": 5, "</think>": 6}, [6, 5], True),
    ({"<think>": 5, "</think>": 6}, [1, 2], False),
    ({"<think>": 5, "</think>": 6}, [], False),
    ({"<think>": 5}, [5], False),                      # a vocabulary without </think>
    ({"</think>": 6}, [6], False),
])
def test_reasoning_open(ids, tokens, open_):
    """Fault guarded: a prompt read as leaving the reasoning open when its vocabulary lacks one
    of the tags, or when the last tag closes it."""
    assert reasoning_open(tokens, _Tok(token_to_id=ids)) is open_


def test_what_llguidance_cannot_read_is_a_grammar_error_naming_the_exception():
    with pytest.raises(GrammarError, match=r"^(TypeError|ValueError): "):
        check(json.dumps({"grammars": [{"lark_grammar": "start: /a/"}]}), lltokenizer="not a tokenizer")


def test_a_schemas_own_json_options_win_and_a_non_object_gets_the_defaults():
    """Fault guarded: the schema's own x-guidance ignored, or a schema that is no object not
    replaced by {}."""
    assert json_schema_text({"x-guidance": {"whitespace_flexible": True}}) == (
        '{"x-guidance": {"whitespace_flexible": true, "item_separator": ", ", "key_separator": ": "}}')
    assert json_schema_text(None) == "{" + JSON_OPTIONS + "}"


def test_tool_lists_the_format_cannot_call_are_refused_naming_why():
    with pytest.raises(GrammarError, match="^no function tool to call$"):
        tool_call_lark([{"type": "retrieval"}])
    for bad in ("a<b", "a>b", "a\nb", "", 5, None):
        with pytest.raises(GrammarError, match=r"^function name %s cannot be written in the model's tool-call "
                                               r"format$" % repr(bad).replace("\\", "\\\\")):
            tool_call_lark([{"type": "function", "function": {"name": bad}}])
    # letters the refused ones are made of elsewhere are fine (fault: a character set widened)
    ok = [{"type": "function", "function": {"name": "Xn", "parameters": {"properties": {"Xp": {"type": "integer"}}}}}]
    assert '"<function=Xn>\\n"' in tool_call_lark(ok) and '"<parameter=Xp>"' in tool_call_lark(ok)


def test_answer_or_calls_passes_parallel_on():
    assert "\ncalls: call\n" in answer_or_calls_lark({}, [PING], parallel=False)


@pytest.mark.parametrize("kind, text, body", [
    ("json_schema", '{"type": "integer"}', {"name": "body", "json_schema": {"type": "integer", "x-guidance": {
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}}),
    ("json_schema", "true", {"name": "body", "json_schema": True}),
    ("lark", 'start: "é"', {"name": "body", "lark_grammar": 'start: "é"'}),
    ("regex", "a+", {"name": "body", "lark_grammar": "start: /a+/"}),
    ("gbnf", 'root ::= "a" | "b"', {"name": "body", "lark_grammar": '%llguidance {}\n\nstart: "a"\n     | "b"\n\n'}),
])
def test_full_grammar_without_reasoning(kind, text, body):
    """The body exactly, non-ASCII as written (fault: a kind's body misnamed or its text
    changed, a boolean schema given JSON options, GBNF not translated)."""
    out = full_grammar(kind, text, False)
    assert json.loads(out) == {"grammars": [{"lark_grammar": "start: @body"}, body]} and "\\u" not in out


@pytest.mark.parametrize("kind, text, message", [
    ("json_schema", "[1]", "^a JSON schema is an object, not list$"),
    ("gbnf", "root ::= (", "^the GBNF grammar does not parse: Failed to convert the grammar from GBNF to Lark"),
    ("yaml", "a: 1", "^grammar kind 'yaml': expected one of json_schema, lark, regex, gbnf$"),
])
def test_full_grammar_errors_name_the_problem(kind, text, message):
    with pytest.raises(GrammarError, match=message):
        full_grammar(kind, text, False)
