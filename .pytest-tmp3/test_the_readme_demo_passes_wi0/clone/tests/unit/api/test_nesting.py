"""nesting.py: how deep JSON text and values nest, read without recursing; cutting what is deeper."""

from __future__ import annotations

import orjson

from trainingrun_api import nesting


def nested_json(depth: int) -> bytes:
    return b'{"a":' * depth + b'{"leaf":1}' + b"}" * depth


def test_text_depth_skips_brackets_in_strings_and_stops_early():
    assert nesting.text_depth(b'{"a": "[[[[[[[[\\"{{{{", "b": [1]}') == 2
    assert nesting.text_depth(b"[]") == 1 and nesting.text_depth(b'"[["') == 0
    assert nesting.text_depth(nested_json(10_000), stop_above=5) == 6


def test_a_string_left_open_ends_the_scan_in_linear_time():
    """A quote that never closes, followed by many escaped quotes: tried once, not once per quote (a scan that tried
    each would take hours here, and this test would not end)."""
    raw = b'"' + b'\\"' * 500_000 + b"[[["
    assert nesting.text_depth(raw) == 0
    assert nesting.cut_deeper_than(raw, 1, b"0") == (raw, 0)


def test_cutting_keeps_everything_beside_the_deep_value_and_brackets_in_strings():
    raw = b'{"a":[1,"]]]{{{\\"[",' + nested_json(50) + b'],"b":"x"}'
    cut, cuts = nesting.cut_deeper_than(raw, 4, b'"<cut>"')
    value = orjson.loads(cut)
    assert cuts == 1 and value["b"] == "x" and value["a"][:2] == [1, ']]]{{{"[']
    assert nesting.deeper_than(value, 4) is None and nesting.deeper_than(value, 3) == ["a", 2, "a"]


def test_deeper_than_walks_a_value_far_past_the_recursion_limit():
    value: dict = {"leaf": 1}
    for _ in range(5_000):
        value = {"a": value}
    path = nesting.deeper_than({"spec": [value]}, 3)
    assert path == ["spec", 0, "a"]
    assert nesting.deeper_than({"spec": [{"a": 1}]}, 3) is None


def test_dotted_paths():
    assert nesting.dotted(["spec", "trainer", "loggers", 0, "kind"]) == "spec.trainer.loggers[0].kind"
    assert nesting.dotted(["a"] * 10, most=3) == "a.a.a..."
