"""local.ledger: a local run keeps its uid and earlier wall time between invocations; another checkpoint URI is
another run with its own folder; a run.json torn, hand-edited or hostile starts a new run instead of failing."""

import json
import math

import pytest

from trainingrun_operator.local.ledger import RunLedger, run_directory


def test_a_rerun_with_the_same_uri_is_the_same_run_and_keeps_its_time(tmp_path):
    first = RunLedger.load(tmp_path / "demo", "file:///ckpt/demo")
    first.wall_seconds = 12.3456
    first.save()
    again = RunLedger.load(tmp_path / "demo", "file:///ckpt/demo")
    assert (again.uid, again.wall_seconds) == (first.uid, 12.346)
    other = RunLedger.load(tmp_path / "demo", "file:///ckpt/elsewhere")
    assert other.uid != first.uid and other.wall_seconds == 0.0


def test_another_uri_gets_a_folder_of_its_own_and_the_first_keeps_the_name(tmp_path):
    assert run_directory(tmp_path, "demo", "file:///a") == tmp_path / "demo"  # nothing there yet
    RunLedger.load(tmp_path / "demo", "file:///a").save()
    assert run_directory(tmp_path, "demo", "file:///a") == tmp_path / "demo"
    moved = run_directory(tmp_path, "demo", "file:///b")
    assert moved.parent == tmp_path / "demo" and moved.name.startswith("uri-") and len(moved.name) == 16
    assert run_directory(tmp_path, "demo", "file:///b") == moved  # the same folder every time


@pytest.mark.parametrize(
    "written",
    [
        "{torn",
        "[1, 2]",  # JSON, not an object
        '"a string"',
        json.dumps({"uid": 7, "checkpointUri": "file:///a"}),
        json.dumps({"uid": "u", "checkpointUri": "file:///a", "wallSeconds": "lots"}),
        json.dumps({"uid": "u", "checkpointUri": "file:///a", "wallSeconds": -5}),
        json.dumps({"uid": "u", "checkpointUri": "file:///a", "wallSeconds": 1e400}),
        json.dumps({"uid": "u", "checkpointUri": "file:///a", "wallSeconds": [1]}),
    ],
)
def test_a_run_json_that_is_not_one_of_ours_is_a_new_run_not_a_crash(tmp_path, written):
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "run.json").write_text(written)
    ledger = RunLedger.load(tmp_path / "demo", "file:///a", uid="fresh")
    assert math.isfinite(ledger.wall_seconds) and ledger.wall_seconds >= 0
    if ledger.uid != "fresh":  # kept as the same run only with a usable uid, and then never a bad time
        assert ledger.uid == "u" and ledger.wall_seconds == 0.0
    assert run_directory(tmp_path, "demo", "file:///a") in (
        tmp_path / "demo",
        tmp_path / "demo" / ledger.path.parent.name,
    )


def test_a_rerun_keeps_the_productive_time_too_and_a_bad_one_is_zero(tmp_path):
    first = RunLedger.load(tmp_path / "demo", "file:///ckpt/demo")
    first.productive_seconds = 7.25
    first.save()
    assert RunLedger.load(tmp_path / "demo", "file:///ckpt/demo").productive_seconds == 7.25
    (tmp_path / "demo" / "run.json").write_text(
        json.dumps({"uid": first.uid, "checkpointUri": "file:///ckpt/demo", "productiveSeconds": "lots"})
    )
    assert RunLedger.load(tmp_path / "demo", "file:///ckpt/demo").productive_seconds == 0.0
