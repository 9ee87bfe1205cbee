"""The structured-outputs benchmark's parts on the bundled model's tokenizer (no model): compile
times come out cold above cached, the compile load compiles new grammars until stopped, and the
benchmark's schema is a valid JSON Schema."""

from __future__ import annotations

import os

import jsonschema
import pytest

from bench.structured_outputs import PERSON, compile_load, compile_times, slow_schema

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def compiler_factory():
    from conveyor.common.models import load_tokenizer, resolve_model
    from conveyor.engine.structured.grammar_compiler import GrammarCompiler, grammar_tokenizer

    tokenizer = grammar_tokenizer(load_tokenizer(resolve_model("smollm2-135m-instruct")),
                                  49152, (2,))
    made = []
    yield lambda: made.append(GrammarCompiler(tokenizer, 1, 4)) or made[-1]
    for compiler in made:
        compiler.close()


def test_the_schemas_are_json_schemas():
    jsonschema.Draft202012Validator.check_schema(PERSON)
    jsonschema.Draft202012Validator.check_schema(slow_schema(1))


def test_cold_compiles_cost_more_than_cached_ones(compiler_factory):
    from conveyor.engine import StructuredOutputsParams

    times = compile_times(compiler_factory(), StructuredOutputsParams, rounds=3)
    assert times["cold_ms"] > times["cached_ms"] > 0


def test_the_compile_load_compiles_new_grammars_until_stopped(compiler_factory):
    import time

    from conveyor.engine import StructuredOutputsParams

    compiler = compiler_factory()
    with compile_load(compiler, StructuredOutputsParams) as load:
        deadline = time.monotonic() + 60
        while load.count < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert load.count >= 2 and compiler.num_cached == min(load.count, 4)
