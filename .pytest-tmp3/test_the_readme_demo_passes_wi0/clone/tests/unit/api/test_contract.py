"""contract: the operator-trainer contract's pure parts: a checkpoint step read only from a step directory directly
under the run's URI (ASCII digits, whole match), times as Kubernetes writes them, and the memory tier's folders."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from trainingrun_api import contract

RUN = "s3://bucket/runs/demo"


def test_a_step_directory_directly_under_the_runs_uri_gives_its_step():
    assert contract.checkpoint_step(f"{RUN}/step-00000120", RUN) == 120
    assert contract.checkpoint_step(f"{RUN}/step-00000120/", RUN + "/") == 120
    assert contract.checkpoint_step(f"{RUN}/step-{2**63 - 1:019d}", RUN) == 2**63 - 1


@pytest.mark.parametrize(
    "uri",
    [
        f"{RUN}/step-120",  # fewer than 8 digits
        f"{RUN}/step-00000120\n",
        f"{RUN}/step-0000012٣",  # another script's digit, which int() would read
        f"{RUN}/step-00000120.tmp",
        f"{RUN}/nested/step-00000120",
        "s3://attacker/runs/demo/step-00000120",
        f"{RUN}-other/step-00000120",
        f"{RUN}/step-{'1' * 20}",
    ],
)
def test_anything_else_is_no_checkpoint_of_the_run(uri):
    assert contract.checkpoint_step(uri, RUN) is None


def test_times_are_utc_with_z_and_read_back():
    moment = datetime(2026, 12, 1, 10, 30, 5, 123456, tzinfo=timezone(timedelta(hours=2)))
    assert contract.rfc3339(moment) == "2026-12-01T08:30:05Z"
    assert contract.rfc3339(moment, fraction=True) == "2026-12-01T08:30:05.123456Z"
    assert contract.parse_time("2026-12-01T08:30:05Z") == moment.replace(microsecond=0)


@pytest.mark.parametrize("value", [None, "", "yesterday", "2026-13-01T00:00:00Z"])
def test_an_absent_or_malformed_time_is_none(value):
    assert contract.parse_time(value) is None


def test_the_memory_tier_folder_is_per_run_and_attempt_below_the_root(monkeypatch):
    monkeypatch.delenv(contract.MEMORY_TIER_ROOT_ENV, raising=False)
    assert contract.memory_tier_dir("uid-1", 3) == "/dev/shm/trainingrun-uid-1-attempt-3"
    monkeypatch.setenv(contract.MEMORY_TIER_ROOT_ENV, "/tmp/tests-shm")
    assert contract.memory_tier_dir("uid-1", "*") == "/tmp/tests-shm/trainingrun-uid-1-attempt-*"
    assert contract.memory_tier_dir("uid-1", 1, root="/mnt") == "/mnt/trainingrun-uid-1-attempt-1"


def test_node_memory_is_named_by_the_run_and_its_checkpoint_uri():
    """Issue 78 item 4: scripts of one's own all default to TRAININGRUN_NAME `local`: on main they shared
    /dev/shm/trainingrun-local-attempt-1, and one resumed another's checkpoint."""
    import re

    first, second = contract.memory_tier_key("local", "file:///a"), contract.memory_tier_key("local", "file:///b")
    assert first != second and first == contract.memory_tier_key("local", "file:///a")
    uid = "3f1c2a9e-0000-4000-8000-000000000001"
    assert re.fullmatch(contract.RUN_KEY_PATTERN, contract.memory_tier_key(uid, "s3://bucket/run"))
