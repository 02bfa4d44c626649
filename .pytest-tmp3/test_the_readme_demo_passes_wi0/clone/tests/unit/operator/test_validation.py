"""validation: a file's YAML read strictly and within bounds (a key twice, nesting too deep, an alias bomb: each a
problem naming the line or the fix, never a hang or all memory), read as the cluster reads it (YAML 1.2 floats, nulls
pruned where the API server prunes them, integers within int64), and problems of every document of a file at once."""

from __future__ import annotations

import pytest
import yaml

from trainingrun_operator import validation
from trainingrun_operator.validation import MAX_DEPTH, MAX_EXPANDED_NODES, InvalidTrainingRun, load_file, load_runs


def problems_of(path) -> list[str]:
    with pytest.raises(InvalidTrainingRun) as raised:
        load_runs(str(path))
    return [str(p) for p in raised.value.problems]


def test_a_key_given_twice_is_named_with_its_line(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("kind: TrainingRun\nspec:\n  trainer: {}\n  trainer: {}\n")
    (problem,) = problems_of(path)
    assert "key 'trainer' is given twice in one mapping; keep one" in problem and "line 4" in problem


def test_nesting_past_the_limit_is_refused(tmp_path):
    path = tmp_path / "deep.yaml"
    path.write_text("a: " + "[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5) + "\n")
    (problem,) = problems_of(path)
    assert f"nests deeper than {MAX_DEPTH} levels" in problem


def test_an_alias_bomb_is_refused_before_it_is_built(tmp_path):
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]  # 10**9 nodes expanded
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join(lines) + "\n")
    (problem,) = problems_of(path)
    assert f"at most {MAX_EXPANDED_NODES} are read" in problem


@pytest.mark.parametrize("content", ["a: &a [*a]\n", "spec: &s {trainer: {model: *s}}\n", "a: &a {b: [1, {c: *a}]}\n"])
def test_a_value_that_holds_itself_through_an_alias_is_refused_not_walked_forever(tmp_path, content):
    # It crashed `trainingrun validate` with a RecursionError (a value PyYAML builds inside itself).
    path = tmp_path / "loop.yaml"
    path.write_text(content)
    (problem,) = problems_of(path)
    assert "holds itself through an alias" in problem and "line 1" in problem


@pytest.mark.parametrize(
    "content, words",
    [
        (b"\xff\xfe not utf-8", "is not UTF-8 text"),
        (b"a: [unclosed", "is not valid YAML at line"),
        (b"---\n", "holds no YAML document"),
    ],
)
def test_unreadable_files_are_one_problem_each(tmp_path, content, words):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(InvalidTrainingRun, match=words):
        load_file(str(path))
    with pytest.raises(InvalidTrainingRun, match="cannot read"):
        load_file(str(tmp_path / "absent.yaml"))


def test_floats_read_as_yaml_12_and_kubernetes_read_them():
    assert yaml.load("lr: 1e-8", Loader=validation._StrictLoader) == {"lr": 1e-8}  # YAML 1.1: the string "1e-8"


def test_integers_past_int64_are_named_by_path(minimal_body):
    minimal_body["spec"]["trainer"] = {"maxSteps": 2**63}
    with pytest.raises(InvalidTrainingRun) as raised:
        validation.parse(minimal_body)
    assert any(
        p.path == "spec.trainer.maxSteps" and "outside the 64-bit integers" in p.message for p in raised.value.problems
    )


def test_a_null_where_the_api_server_prunes_it_takes_the_default(minimal_body):
    default = validation.parse(minimal_body).spec.trainer.max_steps
    minimal_body["spec"]["trainer"] = {"maxSteps": None}
    assert validation.parse(minimal_body).spec.trainer.max_steps == default


def test_a_document_that_is_no_mapping_says_what_the_file_must_be():
    with pytest.raises(InvalidTrainingRun, match="expected a TrainingRun mapping, got list"):
        validation.parse([1, 2])


def test_each_documents_problems_are_named_by_document(tmp_path, minimal_body):
    good = yaml.safe_dump(minimal_body)
    bad = yaml.safe_dump({**minimal_body, "spec": {"checkpoint": minimal_body["spec"]["checkpoint"], "replcas": {}}})
    path = tmp_path / "two.yaml"
    path.write_text(good + "---\n" + bad + "---\n" + bad)
    found = problems_of(path)
    assert [p.split(":")[0] for p in found] == ["document 2", "document 3"]
    assert all("did you mean 'replicas'" in p for p in found)
