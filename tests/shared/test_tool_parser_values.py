"""shared/tool_parser.py's value rules, one case each: how a parameter's text becomes its JSON
value (convert), which reading its schema asks for (param_kind), which tools' schemas are read
(tool_schemas), and the call ids. The parser's streaming is tested in test_tool_parser.py."""
import json
import re

import pytest

from shared.tool_parser import convert, new_call_id, param_kind, tool_schemas


@pytest.mark.parametrize("raw, kind, value", [
    # null in any case and Python's None are null, whatever the type (fault: one spelling missed)
    ("null", "integer", None), ("NULL", "number", None), (" None\n", "boolean", None), ("none", "object", None),
    # integers by int(): what JSON refuses but int() reads, and what int() refuses (fault: the
    # integer rule skipped, json.loads reading "4.0" as 4.0 and refusing "+5")
    ("+5", "integer", 5), ("007", "integer", 7), ("4.0", "integer", "4.0"), ("many", "integer", "many"),
    # numbers by float(), an integer only when written without a point or exponent (fault: the
    # number rule skipped, json.loads refusing "+2.5"; an upper-case exponent not seen)
    ("+2.5", "number", 2.5), (".5", "number", 0.5), ("3", "number", 3), ("1e400", "number", "1e400"),
    ("Infinity", "number", "Infinity"), ("nan", "number", "nan"),
    # booleans in any case; anything else stays the text (fault: None instead of the text)
    ("TRUE", "boolean", True), ("False", "boolean", False), ("yes", "boolean", "yes"),
    # Python literals only where an object or array is asked for (fault: literal_eval for any kind)
    ("{'a': 1}", "object", {"a": 1}), ("['x', 'y']", "array", ["x", "y"]), ("{'a': 1}", "any", "{'a': 1}"),
    ("{'a': 1}", "string", "{'a': 1}"),
    # the wrong container stays the text (fault: the object or the array check dropped)
    ("[1]", "object", "[1]"), ('{"a": 1}', "array", '{"a": 1}'), ('{"a": 1}', "any", {"a": 1}), ("[1]", "any", [1]),
    # what JSON cannot write stays the text (fault: the json.dumps check dropped or allowing NaN)
    ("NaN", "any", "NaN"), ("[1e400]", "array", "[1e400]"), ("{(1, 2): 3}", "object", "{(1, 2): 3}"),
    ("{'a': {1, 2}}", "object", "{'a': {1, 2}}"),
])
def test_convert(raw, kind, value):
    out = convert(raw, kind)
    assert out == value and type(out) is type(value), (raw, kind, out)


@pytest.mark.parametrize("raw, text", [("1E3", "1000.0"), ("1e3", "1000.0"), ("2.0", "2.0"), ("-4", "-4")])
def test_a_number_is_written_as_it_was_written(raw, text):
    """Fault guarded: `1E3` (upper-case exponent) sent as the integer 1000."""
    assert json.dumps(convert(raw, "number")) == text


@pytest.mark.parametrize("schema, known, kind", [
    ({"type": "integer"}, True, "integer"),
    ({"type": "integer"}, False, "string"),                  # a parameter the schema does not name
    (None, True, "string"), ("integer", True, "string"),     # no schema object: raw text
    ({"type": ["string", "null"]}, True, "string"),
    ({"type": ["integer", "null"]}, True, "integer"),       # null is read by convert itself
    ({"type": ["integer", "number"]}, True, "any"),
    ({"type": ["string", "integer"]}, True, "string"),     # a string allowed: raw text
    ({"enum": ["a", "b"]}, True, "string"), ({"enum": ["a", 1]}, True, "any"), ({"enum": "ab"}, True, "any"),
    ({"type": "integer", "enum": ["a"]}, True, "integer"),  # an enum counts only without a type
    ({}, True, "any"), ({"type": "null"}, True, "any"), ({"type": 5}, True, "any"),
])
def test_param_kind(schema, known, kind):
    assert param_kind(schema, known) == kind


def test_tool_schemas_reads_function_tools_only():
    """Fault guarded: a tool with no usable properties read as having some (or dropped), or a
    malformed tool read as a function."""
    props = {"x": {"type": "string"}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": props}}},
             {"function": {"name": "b"}}, {"function": {"name": "c", "parameters": {"properties": {}}}},
             {"function": {"name": "d", "parameters": "bad"}}, {"function": {"name": "e", "parameters":
                                                                            {"properties": ["x"]}}},
             {"function": {"name": 5}}, "str", {"function": "x"}, {"type": "function"}]
    assert tool_schemas(tools) == {"a": props, "b": None, "c": None, "d": None, "e": None}
    assert tool_schemas(None) == {} and tool_schemas([]) == {}


def test_call_ids_are_openai_shaped_and_unique():
    """Fault guarded: an id of another length than OpenAI's call_ + 24 hex digits."""
    ids = [new_call_id() for _ in range(50)]
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids) and len(set(ids)) == 50
