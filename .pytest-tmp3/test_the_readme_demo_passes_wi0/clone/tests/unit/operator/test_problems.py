"""problems: pydantic's errors worded for a person: the field path as written in YAML, what is wrong and the fix;
the nearest field for a misspelt one (or where it belongs when it is one level too high), and never a value pasted
under spec.secrets."""

from __future__ import annotations

import pytest

from run_documents import put
from trainingrun_operator import validation
from trainingrun_operator.problems import Problem


def problems(body, *changes) -> list[str]:
    for change in changes:
        change(body)
    with pytest.raises(validation.InvalidTrainingRun) as raised:
        validation.parse(body)
    return [str(p) for p in raised.value.problems]


def test_a_misspelt_field_gets_the_nearest_name(minimal_body):
    assert problems(minimal_body, put("spec.replicas", {"mx": 2})) == [
        "spec.replicas.mx: unknown field; did you mean 'max'?"
    ]


def test_a_snake_case_field_gets_its_camel_case_name(minimal_body):
    found = problems(minimal_body, put("spec.trainer", {"max_steps": 10}))
    assert found == ["spec.trainer.max_steps: unknown field; did you mean 'maxSteps'?"]


def test_a_field_one_level_too_high_is_pointed_to_where_it_belongs(minimal_body):
    (found,) = problems(minimal_body, put("spec.interval", {"steps": 5}))
    assert found.startswith("spec.interval: unknown field here; did you mean ") and "spec.checkpoint.interval" in found


def test_a_wrong_type_says_what_to_write(minimal_body):
    assert problems(minimal_body, put("spec.trainer.maxSteps", "ten")) == [
        "spec.trainer.maxSteps: must be an integer, got 'ten'; write it as an integer"
    ]


def test_a_bound_names_the_limit(minimal_body):
    (found,) = problems(minimal_body, put("spec.trainer.maxSteps", 0))
    assert found == "spec.trainer.maxSteps: must be >= 1, got 0; set a value >= 1"


def test_a_literal_suggests_the_closest_allowed_value(minimal_body):
    (found,) = problems(minimal_body, put("spec.trainer.precision", "bf16-mixd"))
    assert found == "spec.trainer.precision: 'bf16-mixd' is not allowed; did you mean 'bf16-mixed'?"


def test_a_quantity_gets_examples(minimal_body):
    (found,) = problems(minimal_body, put("spec.resources.memory", "12 GB"))
    assert "is not a Kubernetes quantity" in found and "'512Mi'" in found


def test_a_value_pasted_under_secrets_is_never_echoed(minimal_body):
    pasted = "AKIAIOSFODNN7EXAMPLEwJalrXUtnFEMI"
    found = problems(minimal_body, put("spec.secrets.gcsKeyFile", {"secretName": pasted, "key": "k"}))
    assert found and all(pasted not in p for p in found)
    assert any("<value not shown>" in p for p in found)


def test_list_items_are_shown_by_index_and_each_problem_once(minimal_body):
    env = [{"name": "OK", "value": "1"}, {"name": "1BAD", "value": "2"}]
    found = problems(minimal_body, put("spec.env", env))
    assert len(found) == len(set(found)) and found[0].startswith(
        "spec.env[1].name: '1BAD' does not have the expected form"
    )


def test_a_problem_without_a_path_is_its_message():
    assert str(Problem("", "expected a mapping")) == "expected a mapping"
    assert str(Problem("spec.x", "bad")) == "spec.x: bad"
