"""Constrained decoding (shared/grammar.py, shared/token_mask.py): the grammars of forced tool
calls and JSON schemas accept what the model's own format allows and nothing else, after the
reasoning; the Decoder samples only what they allow; a CPU worker masks each sequence of a
batch with its own grammar in one forward pass; bad grammars are errors, not crashes."""
from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from shared import protocol as P
from shared.generate import Decoder
from shared.errors import GrammarError
from shared.grammar import answer_or_calls_lark, compile_constraint, full_grammar, json_schema_text, tool_call_lark
from shared.model import Model
from shared.sampling import SamplingParams
from shared.token_mask import TokenMask, ll_tokenizer
from shared.tool_parser import ToolCallParser

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["c", "f"]},
    "alerts": {"type": "boolean"}}, "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
ANSWER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}, "tag": {"enum": ["x", "y"]}},
          "required": ["n", "ok", "tag"], "additionalProperties": False}
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nSão <Paulo>\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=alerts>\ntrue\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def tok(tiny_q4_path):
    return Model(str(tiny_q4_path)).tokenizer


def accepts(tok, grammar: str, text: str) -> bool:
    """Whether the grammar lets the model write `text` (as the tokenizer splits it), to its end."""
    mask = TokenMask(ll_tokenizer(tok), grammar)
    for t in tok.encode(text):
        if not mask.allowed()[t]:
            return False
        mask.consume(t)
    return mask.accepting


def calls_of(text: str, reasoning: bool = False) -> list[tuple[str, dict]]:
    parser = ToolCallParser(TOOLS, reasoning)
    events = parser.feed(text) + parser.finish()
    names = [e[3] for e in events if e[0] == "call"]
    args = "".join(e[2] for e in events if e[0] == "args")
    return list(zip(names, [json.loads(a + "}") for a in args.split("}") if a]))


def test_a_forced_call_in_the_models_format_is_accepted_and_parses(tok):
    forced = tool_call_lark(TOOLS, parallel=False)
    assert accepts(tok, full_grammar("lark", forced, False), CALL)
    assert accepts(tok, full_grammar("lark", forced, True), "Let me look.\n</think>\n\n" + CALL)
    assert calls_of(CALL) == [("get_weather", {"city": "São <Paulo>", "days": 3, "alerts": True})]
    assert accepts(tok, full_grammar("lark", forced, False), "<tool_call>\n<function=ping>\n</function>\n</tool_call>")


@pytest.mark.parametrize("text", [
    "Sure!" + CALL,                                               # content instead of the call
    CALL.replace("<parameter=days>\n3\n</parameter>\n", ""),      # a required parameter left out
    CALL.replace("\n3\n", "\n9\n"),                               # days above its maximum
    CALL.replace("São <Paulo>", "Llanfairpwllgwyngyll"),          # longer than maxLength
    CALL.replace("get_weather", "get_wether"),                    # no such function
    CALL.replace("\ntrue\n", "\nyes\n"),                          # not a boolean
    CALL + "\n" + CALL,                                           # a second call, not parallel
])
def test_a_call_outside_the_schema_is_refused(tok, text):
    assert not accepts(tok, full_grammar("lark", tool_call_lark(TOOLS, parallel=False), False), text)


def test_parallel_calls_and_the_reasoning_before_them(tok):
    forced = tool_call_lark(TOOLS, parallel=True)
    assert accepts(tok, full_grammar("lark", forced, False), CALL + "\n" + CALL)
    assert not accepts(tok, full_grammar("lark", forced, False), "thinking aloud</think>" + CALL)
    assert not accepts(tok, full_grammar("lark", forced, True), CALL)          # the reasoning must end first


def test_json_schema_after_the_reasoning(tok):
    grammar = full_grammar("json_schema", json_schema_text(ANSWER), True)
    assert accepts(tok, grammar, 'hmm {not json} </think>\n\n{"n": 42, "ok": true, "tag": "x"}')
    assert not accepts(tok, grammar, 'hmm</think>{"n": 42, "ok": true, "tag": "z"}')
    assert not accepts(tok, grammar, 'hmm</think>{"n": 42, "ok": true}')


def test_with_tool_choice_auto_a_response_format_answer_or_a_call(tok):
    grammar = full_grammar("lark", answer_or_calls_lark(ANSWER, TOOLS, parallel=False), False)
    assert accepts(tok, grammar, '{"n": 1, "ok": false, "tag": "y"}') and accepts(tok, grammar, CALL)
    assert not accepts(tok, grammar, "Plain words.")


def test_the_reasoning_is_open_only_when_the_prompt_leaves_it_open(tok):
    schema = P.Constraint(kind="json_schema", text=json_schema_text(ANSWER))
    think, end = tok.token_to_id["<think>"], tok.token_to_id["</think>"]
    opened = compile_constraint(schema, tok.encode("Q") + [think, 10], tok, tok.n_vocab)
    closed = compile_constraint(schema, tok.encode("Q") + [think, 10, end, 10], tok, tok.n_vocab)
    assert "</think>" in opened and "</think>" not in closed


@pytest.mark.parametrize("kind, text, word", [
    ("json_schema", '{"type": "objekt"}', "objekt"),
    ("json_schema", "[1, 2]", "object"),
    ("json_schema", "{oops", "not JSON"),
    ("lark", "start: <no_such_token>", "no_such_token"),
    ("lark", "start: undefined_rule", "undefined_rule"),
    ("regex", "(unclosed", "unclosed"),
    ("yaml", "a: 1", "kind"),
])
def test_a_bad_constraint_is_a_grammar_error_naming_it(tok, kind, text, word):
    with pytest.raises(GrammarError, match="(?s).*" + word.replace("(", r"\(")):
        compile_constraint(P.Constraint(kind=kind, text=text), [1], tok, tok.n_vocab)


class RandomEngine:
    """Logits from a seeded generator: what a model knowing nothing would say."""

    def __init__(self, n_vocab: int, seed: int):
        self.n_vocab, self.rng = n_vocab, np.random.default_rng(seed)

    def forward(self, tokens, state, all_logits=False):
        return self.rng.normal(0, 3, (len(tokens), self.n_vocab)).astype(np.float32)


class _State:
    room = 10 ** 6


@pytest.mark.parametrize("seed", range(4))
def test_the_decoder_samples_only_what_the_grammar_allows(tok, seed):
    grammars = [(full_grammar("json_schema", json_schema_text(ANSWER), False), "json"),
                (full_grammar("lark", tool_call_lark(TOOLS[:1], parallel=False), False), "call")]
    for grammar, what in grammars:
        engine = RandomEngine(tok.n_vocab, seed)
        mask = TokenMask(ll_tokenizer(tok), grammar)
        dec = Decoder(engine, _State(), engine.forward([0], None)[-1], [0], SamplingParams(seed=seed), 300,
                      tok.eos_ids, mask=mask)
        out = []
        while dec.finish_reason is None:
            out.append(dec.step())
        assert dec.finish_reason == "stop" and out[-1] in tok.eos_ids, tok.decode(out)
        text = tok.decode(out[:-1])
        if what == "json":
            jsonschema.validate(json.loads(text), ANSWER)
        else:
            ((name, args),) = calls_of(text)
            assert name == "get_weather"
            jsonschema.validate(args, WEATHER)


def test_a_matcher_in_error_raises_instead_of_sampling_nothing(tok):
    mask = TokenMask(ll_tokenizer(tok), full_grammar("json_schema", json_schema_text(ANSWER), False))
    with pytest.raises(GrammarError):
        mask.consume(tok.encode("x")[0])         # JSON cannot start with x
    with pytest.raises(GrammarError):
        mask.apply(np.zeros(tok.n_vocab, np.float32))


def _rendered(name: str, args: dict) -> str:
    """A call as the Qwen-style template renders it back (shared/chat_template.py)."""
    body = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
                   for k, v in args.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


TEXT = {"type": "object", "properties": {"text": {"type": "string"}, "n": {"type": "integer", "minimum": 1,
                                                                          "maximum": 7}},
        "required": ["text", "n"]}


@pytest.mark.parametrize("seed", range(6))
def test_grammar_and_parser_read_a_rendered_call_alike(tok, seed):
    """Issue 38 part 3: one rule (shared.tool_parser.VALUE_END) ends a value for both. The
    template's rendering of a valid call is accepted and parses back to the same call; a value
    holding `</parameter>` followed by other text is one value to both; one the grammar refuses
    (where the parser would end the value early) is never forced."""
    rng = np.random.default_rng(seed)
    pieces = ["a", " ", "\n", "<", "</parameter>", "</parameter> x", "<b>", "é", "</function", "\n\n"]
    text = "".join(rng.choice(pieces) for _ in range(int(rng.integers(0, 8))))
    args = {"text": text, "n": int(rng.integers(1, 8))}
    tools = [{"type": "function", "function": {"name": "note", "parameters": TEXT}}]
    grammar = full_grammar("lark", tool_call_lark(tools, parallel=False), False)
    parser = ToolCallParser(tools)
    events = parser.feed(_rendered("note", args)) + parser.finish()
    parsed = json.loads("".join(e[2] for e in events if e[0] == "args"))
    ok = accepts(tok, grammar, _rendered("note", args))
    assert ok == (parsed == args), (text, parsed, ok)


@pytest.mark.parametrize("value, same", [
    ("a </parameter>\nnot the end\n</parameter> still not", True),
    ("x</parameter>y", True),
    ("", True),
    ("</parameter>\n</function>", False),        # the parser ends the value there: never forced
    ("a\n</parameter>\nb", False),
])
def test_a_value_with_a_closing_tag_inside(tok, value, same):
    tools = [{"type": "function", "function": {"name": "note", "parameters": TEXT}}]
    grammar = full_grammar("lark", tool_call_lark(tools, parallel=False), False)
    text = _rendered("note", {"text": value, "n": 3})
    parser = ToolCallParser(tools)
    events = parser.feed(text) + parser.finish()
    parsed = json.loads("".join(e[2] for e in events if e[0] == "args"))
    assert accepts(tok, grammar, text) == same
    assert (parsed == {"text": value, "n": 3}) == same



def test_an_empty_value_in_its_short_form_is_taken_and_read_as_empty(tok):
    """Models write an empty string value as `<parameter=ARG>\\n</parameter>` (one newline, not
    the template's two): the grammar takes that form and the parser reads "" from it, so a
    forced call whose model wanted an empty city goes on to the next required parameter
    (fault guarded: the city ran on over the next parameters until the token limit)."""
    tools = [{"type": "function", "function": {"name": "note", "parameters": TEXT}}]
    grammar = full_grammar("lark", tool_call_lark(tools, parallel=False), False)
    text = _rendered("note", {"text": "", "n": 3}).replace("<parameter=text>\n\n</parameter>", "<parameter=text>\n</parameter>")
    assert "<parameter=text>\n</parameter>" in text and accepts(tok, grammar, text)
    parser = ToolCallParser(tools)
    events = parser.feed(text) + parser.finish()
    assert json.loads("".join(e[2] for e in events if e[0] == "args")) == {"text": "", "n": 3}
