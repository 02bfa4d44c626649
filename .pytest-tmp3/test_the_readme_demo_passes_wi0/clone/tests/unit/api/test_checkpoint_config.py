"""checkpoint_config: the checkpoint's URI, resume point and intervals checked in words that name the field and the
fix and never repeat a credential; the auto interval's bounds only with `steps: auto`; the deprecated writerProcess
taken with a line saying to remove it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from trainingrun_api.checkpoint_config import (
    CheckpointConfig,
    CheckpointInterval,
    StorageInterval,
    checkpoint_uri_problem,
)


@pytest.mark.parametrize("uri", ["gs://bucket/runs/a", "s3://my.bucket-1/x", "file:///tmp/ckpt"])
def test_uris_of_the_three_storages_pass(uri):
    assert checkpoint_uri_problem(uri) is None and CheckpointConfig(uri=uri).uri == uri


@pytest.mark.parametrize(
    "uri, words",
    [
        ("s3://AKIA:pw@bucket/x", "holds credentials"),
        ("gs://bucket/a b", "contains whitespace"),
        ("http://bucket/x", "has scheme 'http'; use gs://bucket/path"),
        ("bucket/x", "has no scheme"),
        ("s3://B/x", "no valid bucket name"),
        ("file://relative/x", "relative file:// URI"),
    ],
)
def test_each_bad_uri_says_what_to_write(uri, words):
    problem = checkpoint_uri_problem(uri)
    assert words in problem
    if "@" in uri:
        assert "pw" not in problem


def test_resume_from_must_be_a_step_directory_on_the_same_storage():
    CheckpointConfig(uri="s3://bkt/run", resume_from="s3://bkt/other/step-00000100")
    with pytest.raises(ValidationError, match="must be a checkpoint's step directory"):
        CheckpointConfig(uri="s3://bkt/run", resume_from="s3://bkt/other/latest")
    with pytest.raises(ValidationError, match="on the same storage as checkpoint.uri"):
        CheckpointConfig(uri="s3://bkt/run", resume_from="gs://bkt/other/step-00000100")


def test_an_endpoint_is_for_s3_only_and_never_holds_credentials():
    CheckpointConfig(uri="s3://bkt/run", endpoint_url="http://minio:9000")
    with pytest.raises(ValidationError, match="only used with s3:// URIs"):
        CheckpointConfig(uri="gs://bkt/run", endpoint_url="http://minio:9000")
    with pytest.raises(ValidationError) as raised:
        CheckpointConfig(uri="s3://bkt/run", endpoint_url="http://user:pw@minio:9000")
    assert "pw@" not in raised.value.errors()[0]["msg"]


@pytest.mark.parametrize("steps", [0, -5, True, "500", 2.5, "often"])
def test_steps_is_a_whole_number_from_1_or_auto(steps):
    with pytest.raises(ValidationError, match="neither a whole number of steps from 1 nor 'auto'"):
        CheckpointInterval.from_wire({"steps": steps})


def test_an_interval_needs_a_limit_and_auto_bounds_need_auto():
    assert CheckpointInterval.from_wire({}).auto  # the default
    with pytest.raises(ValidationError, match="neither steps nor seconds is set"):
        CheckpointInterval.from_wire({"steps": None})
    with pytest.raises(ValidationError, match="minSteps applies only with steps: auto"):
        CheckpointInterval.from_wire({"steps": 100, "minSteps": 10})
    with pytest.raises(ValidationError, match="minSteps 50 is above maxSteps 20"):
        CheckpointInterval.from_wire({"steps": "auto", "minSteps": 50, "maxSteps": 20})
    assert CheckpointInterval.from_wire({"steps": "auto", "minSteps": 5}).auto
    with pytest.raises(ValidationError, match="or remove storageInterval"):
        StorageInterval.from_wire({})


def test_the_deprecated_writer_process_is_taken_with_a_line_to_remove_it():
    assert CheckpointConfig(uri="s3://bkt/run").deprecated_fields() == []
    (line,) = CheckpointConfig.from_wire({"uri": "s3://bkt/run", "writerProcess": True}).deprecated_fields()
    assert line.startswith("spec.checkpoint.writerProcess is deprecated and ignored") and "remove the field" in line
