"""shared/tool_parser.py at the edges of its format, compared exactly: the arguments text as
sent (not only its JSON value), the events a piece gives before the output ends, a closing tag
left out or cut, text between parameters, non-ASCII names and values. Every case is fed whole
and a character at a time, and both must give the same."""
import json

import pytest

from shared.tool_parser import ToolCallParser
from tests.support.deadline import LOOPING_PARSER as LOOPING, deadline

TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "limit": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "größe", "parameters": {"type": "object", "properties": {
        "maß": {"type": "string"}, "opts": {"type": "object"}}}}},
]
HEAD = "<tool_call>\n<function=read_file>\n"


@pytest.fixture(autouse=True)
def _fail_fast_if_the_parser_loops():
    """A parser that makes no progress fails the test in 10 s, naming why, instead of hanging it."""
    with deadline(10, LOOPING):
        yield


def _feed(pieces, tools, reasoning, reasoning_format):
    p = ToolCallParser(tools, reasoning, reasoning_format, call_id=lambda: "call_x")
    events = [e for piece in pieces for e in p.feed(piece)] + p.finish()
    out = {"reasoning": "", "content": "", "args": []}
    for e in events:
        if e[0] == "call":
            out["args"].append("")
        elif e[0] == "args":
            out["args"][e[1]] += e[2]
        else:
            out[e[0]] += e[1]
    assert out["args"] == [c["arguments"] for c in p.calls]
    out["complete"] = [c["complete"] for c in p.calls]
    return out


def parse(text, tools=TOOLS, reasoning=False, reasoning_format="deepseek"):
    whole = _feed([text], tools, reasoning, reasoning_format)
    assert _feed(list(text), tools, reasoning, reasoning_format) == whole
    return whole


def test_arguments_keep_non_ascii_as_written():
    """The arguments text is sent as written, not \\u-escaped (fault: ensure_ascii left on for a
    name, a streamed string, or a typed value; json.loads reads both alike)."""
    r = parse("<tool_call>\n<function=größe>\n<parameter=maß>\nnaïve ☃\n</parameter>\n"
              '<parameter=opts>\n{"k": "é"}\n</parameter>\n</function>\n</tool_call>')
    assert r["args"] == ['{"maß": "naïve ☃", "opts": {"k": "é"}}'] and r["complete"] == [True]


def test_short_and_null_string_values():
    """A string value that never streamed (empty, or `null`-like) is written whole at its end
    (fault: the empty string sent as null, or `nul` taken for null)."""
    for value, sent in (("", '""'), ("nul", '"nul"'), ("NULL", "null"), ("null\n", '"null\\n"'),
                        ("nullx", '"nullx"'), ("\nnull", '"\\nnull"')):
        r = parse(HEAD + f"<parameter=path>\n{value}\n</parameter>\n</function>\n</tool_call>")
        assert r["args"] == ['{"path": %s}' % sent], value


def test_a_left_out_closing_parameter_tag():
    """`</function>` or `</tool_call>` right after a value ends it (fault: the value running on,
    or the parser left in a state it cannot leave, the text after the call lost)."""
    r = parse(HEAD + "<parameter=path>\na.py\n</function>\n</tool_call>\nDone.")
    assert (r["args"], r["content"], r["complete"]) == (['{"path": "a.py"}'], "Done.", [True])
    r = parse(HEAD + "<parameter=path>\na.py\n</tool_call>\nDone.")
    assert (r["args"], r["content"], r["complete"]) == (['{"path": "a.py"}'], "Done.", [True])
    r = parse(HEAD + "<parameter=limit>\n7\n</parameter>\n</tool_call>Done.")   # </function> left out
    assert (r["args"], r["content"], r["complete"]) == (['{"limit": 7}'], "Done.", [True])


def test_closing_tags_inside_a_value_followed_by_text_stay_text():
    """Fault guarded: a `</function>` or `</parameter>` inside a value taken as its end though
    no tag of the call follows it."""
    value = "a</function>b </parameter>x\n</parameter> y"
    r = parse(HEAD + f"<parameter=path>\n{value}\n</parameter>\n</function>\n</tool_call>")
    assert r["args"] == [json.dumps({"path": value})]


def test_a_closing_tag_right_before_the_next_tag():
    """`</parameter>` with no newline before the next `<parameter=` or `</tool_call>` ends the
    value (fault: either follower not recognised while it is still incomplete)."""
    r = parse(HEAD + "<parameter=path>\na.py</parameter><parameter=limit>\n3\n</parameter></tool_call>")
    assert (r["args"], r["complete"]) == (['{"path": "a.py", "limit": 3}'], [True])
    r = parse(HEAD + "<parameter=path>\na.py</parameter></tool_call>ok")
    assert (r["args"], r["content"]) == (['{"path": "a.py"}'], "ok")


def test_output_cut_inside_or_right_after_a_closing_tag():
    """An output that ends inside a closing tag, or right after one, ends the value there
    (fault: the partial tag kept as the value's text, or the tag not taken at the end)."""
    for tail in ("</parameter>", "</parameter> \n", "</parameter></fun", "</parameter>\n<param", "</func",
                 "</tool_c", "</parameter>\n</tool_c", "\n</par"):
        r = parse(HEAD + "<parameter=path>\na.py" + tail)
        assert (r["args"], r["complete"]) == (['{"path": "a.py"}'], [False]), tail
    # only the format's blanks may come between (VALUE_END's): another character is text
    for tail, value in (("</parameter>\x0b", "a.py</parameter>\x0b"), ("</parameter>X", "a.py</parameter>X")):
        r = parse(HEAD + "<parameter=path>\na.py" + tail)
        assert r["args"] == [json.dumps({"path": value})], tail


def test_text_between_parameters_is_dropped():
    """Fault guarded: the next parameter dropped with the junk before it (one character of it,
    or several), or the junk kept."""
    r = parse(HEAD + "x<parameter=path>\na\n</parameter>\njunk <b> text\n<parameter=limit>\n2\n</parameter>\n"
              "y</function>\n</tool_call>")
    assert (r["args"], r["complete"]) == (['{"path": "a", "limit": 2}'], [True])
    r = parse(HEAD + "<parameter=path>\na\n</parameter>\nno tag after")      # cut in junk
    assert (r["args"], r["complete"]) == (['{"path": "a"}'], [False])


def test_text_after_a_call_streams_before_the_output_ends():
    """Fault guarded: what follows a call held until finish()."""
    p = ToolCallParser(TOOLS, call_id=lambda: "call_x")
    events = p.feed(HEAD + "</function>\n</tool_call>\n\nDone. And")
    assert events == [("call", 0, "call_x", "read_file"), ("args", 0, "{}"), ("content", "Done. And")]
    assert p.feed(" more") == [("content", " more")] and p.finish() == []


def test_reasoning_streams_and_the_content_after_it():
    """Reasoning goes out as it comes; `</think>` split across pieces is held, not sent as text
    (fault: a partial tag sent, or all text held until the end)."""
    p = ToolCallParser(TOOLS, reasoning=True)
    assert p.feed("Plan: a < b. </th") == [("reasoning", "Plan: a < b.")]
    assert p.feed("ink>\n\nHi <tool") == [("content", "Hi")]
    assert p.feed("_call> is a tag.") == [("content", " <tool_call> is a tag.")]
    assert p.finish() == []


def test_whitespace_before_a_call_is_the_formats():
    """The blank lines between text and a call are not content, in either channel (fault: the
    held whitespace of the wrong channel dropped)."""
    call = HEAD + "</function>\n</tool_call>"
    assert parse("Thinking.\n\n" + call, reasoning=True)["reasoning"] == "Thinking."
    r = parse("Thinking.\n</think>\n\nText.\n\n" + call + "\n\n", reasoning=True)
    assert (r["reasoning"], r["content"]) == ("Thinking.", "Text.")
    r = parse("Text.\n\n" + call + "\n\nAfter.  ")
    assert r["content"] == "Text.After.  "


def test_reasoning_format_none_keeps_the_tags_as_content():
    """Fault guarded: `<think>` or `</think>` dropped, or sent to another channel, when the
    reasoning is not split out."""
    r = parse("<think>\nhmm\n</think>\n\nHi", reasoning_format="none")
    assert (r["reasoning"], r["content"]) == ("", "<think>\nhmm\n</think>\n\nHi")
    r = parse("hmm\n</think>Hi " + HEAD + "</function>\n</tool_call>", reasoning=True, reasoning_format="none")
    assert (r["reasoning"], r["content"], r["args"]) == ("", "hmm\n</think>Hi", ["{}"])


def test_defaults_are_plain_content_and_split_reasoning():
    """Fault guarded: the constructor's defaults (no reasoning open, "deepseek" format) changed."""
    p = ToolCallParser(TOOLS)
    assert p.feed("<think>a</think>b") + p.finish() == [("reasoning", "a"), ("content", "b")]
    p = ToolCallParser(TOOLS)
    assert p.feed("a</think>b") + p.finish() == [("content", "a</think>b")]


def test_a_think_the_model_opens_is_seen_only_first():
    """`<think>` is held while it could still be the model's opening tag, then read (fault: the
    start not waited for, or a later `<think>` taken)."""
    p = ToolCallParser(TOOLS)
    assert p.feed("\n <thi") == [] and p.feed("nk>x") == [("reasoning", "x")]
    p = ToolCallParser(TOOLS)
    assert p.feed("\n ") == [] and p.feed("a <think>") == [("content", "\n a <think>")]
    assert parse(" <th") == {"reasoning": "", "content": " <th", "args": [], "complete": []}
    assert parse("x<think>y</think>")["content"] == "x<think>y</think>"


def test_a_tool_call_tag_without_tools_streams_as_text():
    """Without tools `<tool_call>` is not waited for (fault: a partial `<tool_call>` held)."""
    p = ToolCallParser(None)
    assert p.feed("a <tool_c") == [("content", "a <tool_c")]
    p = ToolCallParser(TOOLS)
    assert p.feed("a <tool_c") == [("content", "a")]


def test_a_head_that_is_not_a_call_is_text_of_its_channel():
    """Fault guarded: the `<tool_call>` tag or the text after it lost, or sent to the wrong
    channel, when no known function follows."""
    r = parse("hmm <tool_call>\n<function=nope>\n</think>ok", reasoning=True)
    assert (r["reasoning"], r["content"]) == ("hmm <tool_call>\n<function=nope>", "ok")
    r = parse("<tool_call>\nplain", reasoning=False)
    assert r["content"] == "<tool_call>\nplain"
    r = parse("<tool_call>\n<function=read_file", reasoning=False)             # cut in the name
    assert r["content"] == "<tool_call>\n<function=read_file"


def test_the_short_empty_form_ends_at_its_newline():
    """`<parameter=ARG>\\n</parameter>\\n` is an empty value even when junk follows (fault: the
    newline after the opening tag not counted as the one before `</parameter>`)."""
    r = parse(HEAD + "<parameter=path>\n</parameter>\njunk\n<parameter=limit>\n1\n</parameter>\n</function>")
    assert r["args"] == ['{"path": "", "limit": 1}']


def test_a_value_that_could_still_be_null_is_held():
    """A string value is held while it reads as the start of `null` (less the format's newlines)
    and sent once it cannot (fault: other blanks stripped, or the wrong end stripped)."""
    for piece, sent in (("\nnul\n", []), ("\nNUL", []), ("\nnul ", [("args", 0, '"nul ')]),
                        ("\nnull ", [("args", 0, '"null ')]), ("\nx\n", [("args", 0, '"x')]),
                        ("\nnulX", [("args", 0, '"nulX')]), ("\nnullX", [("args", 0, '"nullX')])):
        p = ToolCallParser(TOOLS)
        p.feed(HEAD + "<parameter=path>")
        assert p.feed(piece) == sent, piece


def test_text_after_a_call_closed_without_its_tool_call_tag():
    """Fault guarded: the text after `</function>` cut as if `</tool_call>` had been there."""
    assert parse(HEAD + "</function>\nHello there")["content"] == "Hello there"


def test_junk_before_a_parameter_does_not_hold_it_back():
    """Fault guarded: junk between parameters held until the output ends, and the parameters
    after it with it."""
    p = ToolCallParser(TOOLS, call_id=lambda: "call_x")
    assert p.feed(HEAD + "junk\n<parameter=path>\na") == [
        ("call", 0, "call_x", "read_file"), ("args", 0, '{"path": "a')]


def test_output_cut_inside_a_tag_of_the_prose_is_text():
    """A partial `</think>` or `<tool_call>` the output ends with is text (fault: held and lost)."""
    assert parse("a </thi", reasoning=True)["reasoning"] == "a </thi"
    assert parse("x <tool_c")["content"] == "x <tool_c"


def test_a_call_cut_right_after_its_function_closed_is_complete():
    """`</function>` at the very end (the `</parameter>` left out) ends the value and the call
    (fault: the end of the output not read as what follows the tag)."""
    r = parse(HEAD + "<parameter=path>\na.py</function>")
    assert (r["args"], r["complete"]) == (['{"path": "a.py"}'], [True])


def test_a_typed_value_without_its_newline():
    """Fault guarded: the last character of a value cut off though no newline ends it."""
    r = parse(HEAD + "<parameter=limit>\n42</parameter>\n</function>")
    assert r["args"] == ['{"limit": 42}']


def test_a_closing_tag_right_after_the_opening_one_is_no_format_newline():
    """`<parameter=ARG></parameter>\n` has no newline before the tag: VALUE_END's
    `\n</parameter>\n` is not there (fault: the value start counted as after a newline)."""
    r = parse(HEAD + "<parameter=path></parameter>\nx\n</parameter>\n</function>")
    assert r["args"] == ['{"path": "</parameter>\\nx"}']


def test_everything_a_piece_decides_goes_out_with_it():
    """A value closed by a left-out or a false closing tag does not hold back what follows in
    the same piece (fault: the step that closed it, or kept the tag as text, ending the loop)."""
    p = ToolCallParser(TOOLS, call_id=lambda: "call_x")
    assert p.feed(HEAD + "<parameter=path>\na\n</function>\n</tool_call>Done. And") == [
        ("call", 0, "call_x", "read_file"), ("args", 0, '{"path": "a"}'), ("content", "Done. And")]
    p = ToolCallParser(TOOLS, call_id=lambda: "call_x")
    assert p.feed(HEAD + "<parameter=path>\na</function>b\n</parameter>\n</function>\n</tool_call>Done") == [
        ("call", 0, "call_x", "read_file"), ("args", 0, '{"path": "a</function>b"}'), ("content", "Done")]
