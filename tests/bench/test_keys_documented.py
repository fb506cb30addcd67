"""Each benchmark's docstring lists the keys of the JSON it prints (tests/support/bench_keys.py
reads the list; the tests that run a benchmark hold its JSON to it). Here: every list parses,
and the checker finds what is missing in maps, lists, shared and delegated objects."""
from __future__ import annotations

import importlib
import types

import pytest

from tests.support.bench_keys import assert_keys_documented, documented_keys, undocumented_keys

DOCUMENTED = ["agent", "decode", "gpu_kernels", "grammar_cost", "host_memory", "http", "kernels", "prefill", "restart", "serve",
              "soak", "tool_calls", "vision"]

FAKE = types.ModuleType("fake_bench", """A benchmark.

JSON keys:
  model                   the model
  rows[]                  one object a row
  rows[].ms               ms: a time
  by_name.<name>          s: a map
  rate                    TFLOP/s, with ms
  rate.ms                 ms
  other                   keys as rate: the same
  memory                  the keys of bench.host_memory
  reply                   what the model said (free-form)
""")


@pytest.mark.parametrize("name", DOCUMENTED)
def test_every_benchmark_lists_its_keys(name):
    keys = documented_keys(importlib.import_module(f"bench.{name}"))
    assert all(text for text in keys.values())


def test_a_key_without_a_line_is_found_wherever_it_is():
    good = {"model": "m", "rows": [{"ms": 1}], "by_name": {"a.b": 1, "c": 2}, "rate": {"ms": 1}, "other": {"ms": 2},
            "memory": {"peak_gib": 1, "peak_by_process_gib": {"x": 1}, "peak_by_mapping_gib": {"other": 0}},
            "reply": {"anything": [{"goes": 1}]}}
    assert_keys_documented(good, FAKE)
    bad = {"model": "m", "new": 1, "rows": [{"ms": 1}, {"ms": 1, "us": 2}], "rate": {"ms": 1, "s": 1},
           "other": {"tflops": 1}, "memory": {"peak_gib": 1, "total": 2}}
    assert undocumented_keys(bad, FAKE) == ["new", "rows[].us", "rate.s", "other.tflops", "memory: total"]
    assert undocumented_keys([{"ms": 1, "x": 2}], FAKE, prefix="rows") == ["rows[].x"]
    with pytest.raises(AssertionError, match="does not document: new, rate.s"):
        assert_keys_documented({"new": 1, "rate": {"s": 1}}, FAKE)


@pytest.mark.parametrize("doc, problem", [
    ("No list here.", "expected one 'JSON keys' section"),
    ("JSON keys:\n  a   one\n  a   two\n", "key 'a' documented twice"),
    ("JSON keys:\n  a\n", "key 'a' has no unit or meaning"),
    ("JSON keys:\n a  one\n", "indented two spaces"),
])
def test_a_malformed_list_is_refused(doc, problem):
    with pytest.raises(AssertionError, match=problem):
        documented_keys(types.ModuleType("bad_bench", doc))
