"""The offline API's constraint type: exactly one kind, checked on construction; its cache key."""

from __future__ import annotations

import pytest

from conveyor.engine import SamplingParams, StructuredOutputsParams
from conveyor.engine.sampling_params import InvalidSamplingParams


@pytest.mark.parametrize(("fields", "message"), [
    ({}, "exactly one of json, json_object, regex, choice, grammar, got none"),
    ({"regex": "a", "grammar": "start: a"}, "got regex, grammar"),
    ({"choice": []}, "at least one option"),
    ({"choice": "yes"}, "at least one option"),
    ({"choice": ["yes", ""]}, "non-empty strings, got ''"),
    ({"json_object": False}, "json_object must be true"),
])
def test_a_constraint_that_cannot_mean_anything_is_refused(fields, message):
    with pytest.raises(InvalidSamplingParams, match=message):
        StructuredOutputsParams(**fields)


def test_the_cache_key_is_kind_and_text():
    assert StructuredOutputsParams(json={"type": "object"}).key == ("json", '{"type": "object"}')
    assert StructuredOutputsParams(choice=("a", "b")).key == ("choice", '["a", "b"]')
    assert StructuredOutputsParams(json_object=True).key == ("json_object", "")
    assert StructuredOutputsParams(regex="[0-9]+").key == ("regex", "[0-9]+")


def test_sampling_params_carry_it():
    constraint = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(structured_outputs=constraint).structured_outputs is constraint
