"""`fermoe bench decode --json-schema FILE`: the same decode with and without the schema's token
mask in one run, batched too; a bad schema file is a clear error."""
from __future__ import annotations

import json

import pytest

import bench.decode
import bench.grammar_cost
from bench.decode import run
from tests.support.bench_keys import assert_keys_documented
from tests.support.serving_harness import fermoe
from tests.shared.test_grammar import ANSWER


def test_decode_with_and_without_the_mask_in_one_run(tiny_q4_path, tmp_path):
    schema = tmp_path / "answer.json"
    schema.write_text(json.dumps(ANSWER))
    out = run(str(tiny_q4_path), threads=1, prompt_tokens=8, decode_tokens=80, batch=2, json_schema=str(schema))
    got = out["json_schema"]
    assert got["file"] == str(schema) and got["steps"] == 80
    assert got["decode_tok_s_free"] > 0 and got["decode_tok_s_constrained"] > 0 and got["mask_ms_per_token"] > 0
    assert got["slowdown"] == pytest.approx(got["decode_tok_s_free"] / got["decode_tok_s_constrained"] - 1, abs=0.01)
    assert got["values_completed"] >= 1           # ANSWER is short: values end and begin again
    assert_keys_documented(got, bench.grammar_cost)
    assert_keys_documented(out, bench.decode)
    assert "json_schema" not in run(str(tiny_q4_path), threads=1, prompt_tokens=8, decode_tokens=2)


@pytest.mark.parametrize("text, word", [('{"type": "objekt"}', "objekt"), ("[1]", "object"), ("{", "--json-schema")])
def test_a_bad_schema_file_is_a_clear_error(tmp_path, text, word):
    schema = tmp_path / "bad.json"
    schema.write_text(text)
    r = fermoe("bench", "decode", "tiny", "-t", 1, "--prompt", 4, "--tokens", 2, "--json-schema", schema, check=False)
    assert r.returncode == 2 and word in r.stderr and "Traceback" not in r.stderr, r.stderr
