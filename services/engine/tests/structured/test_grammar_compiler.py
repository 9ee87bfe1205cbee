"""The grammar compiler: every kind compiles with the real library, bad ones fail with its
message, and compiled grammars are cached by (kind, text) within a bound."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from conveyor.engine import StructuredOutputsParams
from conveyor.engine.structured.errors import InvalidConstraint

TOKENS = [b"a", b"b", b"c", b"{", b"}", b"0", b"1", b'"', b":", b",", b" ", b""]
EOS = len(TOKENS) - 1


def allowed(matcher) -> set[int]:
    row = np.zeros((len(TOKENS) + 31) // 32, dtype=np.int32)
    matcher.fill_bitmask(row)
    return {t for t in range(len(TOKENS)) if row[t // 32] >> (t % 32) & 1}


def ids(text: str) -> list[int]:
    return [TOKENS.index(ch.encode()) for ch in text]


@pytest.mark.parametrize(("fields", "output"), [
    ({"json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],'
              ' "additionalProperties": false}'}, '{"a": 10}'),
    ({"json_object": True}, '{"b": "c"}'),
    ({"regex": "[ab]+c"}, "abbc"),
    ({"choice": ["ab", "ba"]}, "ba"),
    ({"grammar": 'start: "{" /[01]+/ "}"'}, "{101}"),  # Lark
    ({"grammar": 'root ::= "{" [01]+ "}"'}, "{011}"),  # GBNF
])
def test_each_kind_accepts_a_match_then_allows_only_eos(make_tiny_compiler, fields, output):
    matcher = make_tiny_compiler(TOKENS, EOS).compile(
        StructuredOutputsParams(**fields)).result().new_matcher()
    for token in ids(output):
        assert token in allowed(matcher)
        matcher.accept(token)
    assert matcher.is_complete and allowed(matcher) == {EOS}


@pytest.mark.parametrize(("fields", "message"), [
    ({"regex": "(ab"}, "structured output regex does not compile: .*unclosed group"),
    ({"json": '{"type": "frog"}'}, "structured output json does not compile: .*frog"),
    ({"json": "{not json"}, "structured output json does not compile"),
    ({"grammar": 'root ::= "a" ( "b"'},
     "structured output grammar does not compile: .*Expected '\\)'"),
    ({"grammar": "start: undefined_rule"}, "structured output grammar does not compile"),
])
def test_a_bad_constraint_fails_with_the_librarys_message(make_tiny_compiler, fields, message):
    future = make_tiny_compiler(TOKENS, EOS).compile(StructuredOutputsParams(**fields))
    with pytest.raises(InvalidConstraint, match=f"(?s){message}"):
        future.result()


def test_the_same_constraint_shares_one_compile_and_the_cache_is_bounded(make_tiny_compiler):
    compiler = make_tiny_compiler(TOKENS, EOS, cache_size=2)
    first = compiler.compile(StructuredOutputsParams(regex="a+"))
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    compiler.compile(StructuredOutputsParams(regex="b+"))
    compiler.compile(StructuredOutputsParams(regex="c+"))  # pushes out a+, the oldest
    assert compiler.num_cached == 2
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is not first


def test_builds_run_on_the_pool_below_the_engines_priority(make_tiny_compiler, monkeypatch):
    import llguidance

    from conveyor.engine.structured import grammar_compiler

    seen = []
    real = llguidance.LLMatcher

    def spy(*args, **kwargs):
        niceness = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        seen.append((threading.current_thread(), niceness))
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLMatcher", spy)
    make_tiny_compiler(TOKENS, EOS).compile(StructuredOutputsParams(regex="a")).result()
    [(thread, niceness)] = seen
    assert thread is not threading.current_thread()
    assert thread.name.startswith("grammar-compile")
    if sys.platform == "linux":
        own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
        assert niceness == min(19, own + grammar_compiler.COMPILE_THREAD_NICENESS)


def test_matchers_of_one_grammar_are_independent(make_tiny_compiler):
    compiled = make_tiny_compiler(TOKENS, EOS).compile(StructuredOutputsParams(regex="ab|ba"))
    first, second = compiled.result().new_matcher(), compiled.result().new_matcher()
    first.accept(ids("a")[0])
    assert allowed(first) == set(ids("b")) and allowed(second) == set(ids("ab"))


def test_object_schemas_with_properties_are_closed_as_xgrammar_reads_them():
    from conveyor.engine.structured.llguidance_grammar import closed_objects

    item = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {"type": "object", "properties": {
        "open": {"type": "object", "properties": {}, "additionalProperties": True},
        "list": {"type": "array", "items": item},
        "either": {"anyOf": [item, {"type": "string"}]},
        "fixed": {"const": {"properties": {"x": 1}}}},
        "$defs": {"thing": item}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["open"]["additionalProperties"] is True
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["properties"]["fixed"] == {"const": {"properties": {"x": 1}}}
    assert closed["$defs"]["thing"]["additionalProperties"] is False
    assert closed_objects({"type": "object"}) == {"type": "object"}  # any object stays any
