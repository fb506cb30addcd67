"""shared/tool_parser.py on outputs written the way Qwen3.5/3.6 write them (thinking on: the
prompt ends `<think>\\n`, so the output only closes it), fed whole, a character at a time and
in random pieces: every split must give the same result, and arguments must stream.
The peers' known bug classes (llama-server's and vLLM's parsers) are named where tested."""
import json
import random

import pytest

from shared.tool_parser import ToolCallParser, convert
from tests.support.deadline import LOOPING_PARSER as LOOPING, deadline

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "configure", "parameters": {"type": "object", "properties": {
        "n": {"type": "integer"}, "ratio": {"type": "number"}, "on": {"type": "boolean"},
        "opts": {"type": "object"}, "tags": {"type": "array"}, "note": {"type": ["string", "null"]},
        "maybe": {"type": ["integer", "null"]}, "mode": {"enum": ["fast", "slow"]}}}}},
    {"type": "function", "function": {"name": "ping"}},
]


@pytest.fixture(autouse=True)
def _fail_fast_if_the_parser_loops():
    """A parser that makes no progress fails the test in 10 s, naming why, instead of hanging it."""
    with deadline(10, LOOPING):
        yield


def call(name, **params):
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def run(pieces, tools=TOOLS, reasoning=True, reasoning_format="deepseek"):
    ids = iter(range(100))
    p = ToolCallParser(tools, reasoning, reasoning_format, call_id=lambda: f"call_{next(ids)}")
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    return events, p


def result(events, parser):
    out = {"reasoning": "", "content": "", "calls": []}
    for e in events:
        if e[0] in ("reasoning", "content"):
            out[e[0]] += e[1]
        elif e[0] == "call":
            assert e[1] == len(out["calls"]), "calls are numbered in order"
            out["calls"].append({"id": e[2], "name": e[3], "arguments": ""})
        else:
            assert out["calls"] and e[1] == len(out["calls"]) - 1, "arguments come after their call's start"
            out["calls"][e[1]]["arguments"] += e[2]
    for c, whole in zip(out["calls"], parser.calls):
        assert c["arguments"] == whole["arguments"]
        c["arguments"] = json.loads(c["arguments"])      # always valid JSON, even when cut
        c["complete"] = whole["complete"]
    return out


def parse(text, **kw):
    """The result, checked to be the same whatever the split."""
    whole = result(*run([text], **kw))
    assert result(*run(list(text), **kw)) == whole
    rng = random.Random(len(text))
    for _ in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        assert result(*run(pieces, **kw)) == whole, pieces
    return whole


def test_reasoning_then_answer():
    r = parse("The user greets me.\nI answer briefly.\n</think>\n\nHello! 👋 How can I help?")
    assert r == {"reasoning": "The user greets me.\nI answer briefly.", "content": "Hello! 👋 How can I help?",
                 "calls": []}


def test_output_cut_inside_the_reasoning_is_all_reasoning():
    assert parse("Let me think about 漢字 and")["reasoning"] == "Let me think about 漢字 and"


def test_a_call_after_the_reasoning_with_text_before_it():
    r = parse("I need the file.\n</think>\n\nI'll read it first.\n\n" + call("read_file", path="src/app.py", limit=20))
    assert (r["reasoning"], r["content"]) == ("I need the file.", "I'll read it first.")
    assert r["calls"] == [{"id": "call_0", "name": "read_file", "arguments": {"path": "src/app.py", "limit": 20},
                           "complete": True}]


def test_a_call_opened_inside_the_reasoning_ends_it():       # vLLM #39056, llama.cpp #17932
    r = parse("The user wants a.py, so I call read_file.\n" + call("read_file", path="a.py"))
    assert r["reasoning"] == "The user wants a.py, so I call read_file." and r["content"] == ""
    assert [c["arguments"] for c in r["calls"]] == [{"path": "a.py"}]


def test_text_right_before_the_tag():                         # llama.cpp #20260
    r = parse("ok</think>Sure" + call("ping"), reasoning=True)
    assert (r["content"], r["calls"][0]["arguments"]) == ("Sure", {})


def test_several_calls_in_one_turn_and_text_after_them():
    text = ("Reading both.\n</think>\n\n" + call("read_file", path="a.py") + "\n" + call("read_file", path="b.py")
            + "\n\nDone.")
    r = parse(text)
    assert [c["arguments"]["path"] for c in r["calls"]] == ["a.py", "b.py"]
    assert [c["id"] for c in r["calls"]] == ["call_0", "call_1"] and r["content"] == "Done."


def test_values_are_typed_by_the_schema():
    r = parse("x</think>" + call("configure", n="42", ratio="0.5", on="True", opts='{"a": [1, 2]}',
                                  tags="['x', 'y']", note="null", maybe="None", mode="fast"))
    assert r["calls"][0]["arguments"] == {"n": 42, "ratio": 0.5, "on": True, "opts": {"a": [1, 2]},
                                          "tags": ["x", "y"], "note": None, "maybe": None, "mode": "fast"}
    # what does not parse as its type stays the text; a parameter the schema does not name is a string
    r = parse("x</think>" + call("configure", n="many", ratio="1e400", extra="7"))
    assert r["calls"][0]["arguments"] == {"n": "many", "ratio": "1e400", "extra": "7"}


def test_typed_values_are_written_as_their_json_type():
    """The arguments text itself, whatever the split. Fault guarded: an integer or a number
    written without a point sent as `42.0`, which the dict comparisons above pass (42 == 42.0)."""
    text = "x</think>" + call("configure", n="42", ratio="0.5", on="True", tags="[1, 2.0]", maybe="7", note="null")
    expected = '{"n": 42, "ratio": 0.5, "on": true, "tags": [1, 2.0], "maybe": 7, "note": null}'
    for pieces in ([text], list(text)):
        events, p = run(pieces)
        assert p.calls[0]["arguments"] == "".join(e[2] for e in events if e[0] == "args") == expected
    numbers = {"3": "3", "3.0": "3.0", "-2": "-2", "1e3": "1000.0", "2.50": "2.5"}   # a number as it was written
    for raw, sent in numbers.items():
        events, p = run(["x</think>" + call("configure", ratio=raw)])
        assert p.calls[0]["arguments"] == '{"ratio": %s}' % sent, raw


def test_strings_stay_raw_across_lines_with_tags_and_unicode_inside():
    code = ('def f(a, b):\n    """Return a < b, ünïcödé 🎉."""\n    s = "<tool_call>\\n<function=x>"\n'
            '    return "</parameter>" if a < b else \'</parameter>\'\n\n    # </function> too\n')
    r = parse("Writing.\n</think>\n\n" + call("write_file", path="f.py", content=code))
    assert r["calls"][0]["arguments"] == {"path": "f.py", "content": code}


def test_a_closing_tag_inside_a_value_followed_by_text_is_text():
    value = "a </parameter>\nnot the end\n</parameter> still not"
    r = parse("x</think>" + call("write_file", content=value, path="p"))
    assert r["calls"][0]["arguments"] == {"content": value, "path": "p"}


def test_a_missing_newline_before_the_closing_tag():          # llama.cpp #26763
    text = ("x</think><tool_call>\n<function=read_file>\n<parameter=path>\na.py</parameter>\n</function>\n"
            "</tool_call>\n" + call("read_file", path="b.py"))
    assert [c["arguments"] for c in parse(text)["calls"]] == [{"path": "a.py"}, {"path": "b.py"}]


def test_a_call_cut_by_the_length_limit_is_closed_and_marked():
    text = "x</think>" + call("write_file", path="a.py", content="line one\nline two")
    for cut, content in ((-30, "line one\nline two"), (-40, "line one\nline t"), (-80, None)):
        r = parse(text[:cut])
        assert r["calls"][0]["arguments"] == {"path": "a.py", **({"content": content} if content else {})}
        assert r["calls"][0]["complete"] is False
    cut = parse("x</think>" + call("configure", n="12")[:-30])        # inside an integer value
    assert cut["calls"][0]["arguments"] == {"n": 12} and not cut["calls"][0]["complete"]


@pytest.mark.parametrize("text, content", [
    ("x</think>" + call("rm_rf", path="/"), call("rm_rf", path="/")),                       # an unknown function
    ("x</think>Use <tool_call> tags.", "Use <tool_call> tags."),                           # the tag in prose
    ('x</think><tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>',          # Hermes JSON, not ours
     '<tool_call>\n{"name": "read_file", "arguments": {}}\n</tool_call>'),
    ("x</think><tool_call>\n<function=read_", "<tool_call>\n<function=read_"),              # cut before its name ends
])
def test_what_only_looks_like_a_call_stays_content(text, content):
    r = parse(text)
    assert (r["content"], r["calls"]) == (content, [])


def test_an_unknown_call_inside_the_reasoning_stays_reasoning():
    r = parse("maybe <tool_call>\n<function=nope>\n</function>\n</tool_call> no\n</think>\n\nAnswer.")
    assert r["reasoning"].startswith("maybe <tool_call>\n<function=nope>") and r["content"] == "Answer."


def test_without_tools_nothing_is_a_call():
    text = "x</think>" + call("read_file", path="a.py")
    assert parse(text, tools=None) == {"reasoning": "x", "content": call("read_file", path="a.py"), "calls": []}


def test_reasoning_format_none_keeps_everything_in_the_content():
    text = "Thinking.\n</think>\n\nAnswer."
    assert parse(text, reasoning_format="none") == {"reasoning": "", "content": text, "calls": []}


def test_a_think_block_the_model_opens_itself():
    assert parse("\n<think>\nhmm\n</think>\n\nHi", reasoning=False) == {"reasoning": "hmm", "content": "Hi",
                                                                       "calls": []}
    assert parse("  plain text <think> later", reasoning=False)["content"] == "  plain text <think> later"


def test_plain_content_passes_through_whole():
    text = "  Return the value.\n\n  Raises ValueError if <x> is bad.\n"
    assert parse(text, reasoning=False) == {"reasoning": "", "content": text, "calls": []}


def test_the_call_streams_id_and_name_first_then_string_values_as_they_come():   # vLLM #30439
    p = ToolCallParser(TOOLS, reasoning=True, call_id=lambda: "call_x")
    assert p.feed("ok\n</think>\n\n<tool_call>\n<function=write_file>\n") == [
        ("reasoning", "ok"), ("call", 0, "call_x", "write_file"), ("args", 0, "{")]
    assert p.feed("<parameter=content>\nfirst line\nsecond") == [("args", 0, '"content": "first line\\nsecond')]
    assert p.feed(" line\n") == [("args", 0, " line")]             # its newline could be the format's: held
    assert p.feed("more") == [("args", 0, "\\nmore")]
    tail = p.feed("\n</parameter>\n</function>\n</tool_call>") + p.finish()
    assert tail == [("args", 0, '"}')] and json.loads(p.calls[0]["arguments"]) == {
        "content": "first line\nsecond line\nmore"}


def test_conversion_rules():
    assert convert("3", "integer") == 3 and convert("3.0", "number") == 3.0 and convert("3", "number") == 3
    assert convert("false", "boolean") is False and convert("nan", "number") == "nan"
    assert convert('{"a": 1}', "any") == {"a": 1} and convert("not json", "any") == "not json"
    assert convert("[1,", "array") == "[1,"
