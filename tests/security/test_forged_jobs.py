"""Which PyTorchJob is a run's own (indexes.run_owns_job): one the operator signed, or, made before this operator
process started, the one the run's status already named. An owner reference alone, which anyone who may create
PyTorchJobs in the namespace can copy from the run, is not enough (tests/real_api/test_operator_real.py shows the
operator refusing a planted job on a real API server)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from trainingrun_operator import naming, pytorchjob, validation
from trainingrun_operator.backends import PYTORCHJOB
from trainingrun_operator.indexes import run_owns_job, slim_job
from trainingrun_operator.settings import Settings

KEY = b"k" * 32
STARTED = datetime(2026, 11, 26, 12, 0, tzinfo=timezone.utc)
RUN = validation.parse(
    {
        "apiVersion": "trainingrun.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "demo", "namespace": "ns", "uid": "run-uid"},
        "spec": {"checkpoint": {"uri": "s3://bucket/demo"}},
    }
)


def job(attempt: int, key: bytes = KEY, created: datetime = STARTED + timedelta(seconds=5), uid: str = "") -> dict:
    """A slim PyTorchJob of the run as the API server holds it: uid and creation time given, signed for that uid
    (as plans.JobSigner signs it after the creation) unless `key` is empty."""
    body = pytorchjob.pytorch_job(RUN, attempt, Settings(signing_key=key))
    meta = body["metadata"]
    meta["uid"] = uid or f"job-uid-{attempt}"
    meta["creationTimestamp"] = created.strftime("%Y-%m-%dT%H:%M:%SZ")
    if key:
        meta["annotations"][naming.ANNOTATION_SIGNATURE] = naming.job_signature(
            key, "run-uid", meta["name"], meta["uid"]
        )
    return slim_job(body, PYTORCHJOB)


def status(attempt: int, started: datetime = STARTED - timedelta(minutes=5)) -> dict:
    return {"jobName": f"demo-a{attempt}", "attemptStartTime": started.strftime("%Y-%m-%dT%H:%M:%SZ")}


def owns(body: dict, key: bytes = KEY, state: dict | None = None, made=()) -> bool:
    return run_owns_job(body, "run-uid", state or status(1), key, STARTED, made)


def test_a_job_the_operator_signed_is_the_runs():
    assert owns(job(2), state=status(1))


def test_an_owner_reference_alone_is_not_enough():
    planted = job(2, key=b"")  # builders without a key: no signature, the run's owner reference all the same
    assert planted["metadata"]["ownerReferences"][0]["uid"] == "run-uid"
    assert not owns(planted)


def test_a_signature_made_with_another_key_or_for_another_job_is_not_enough():
    assert not owns(job(2, key=b"x" * 32))
    copied = job(2)
    copied["metadata"]["annotations"][naming.ANNOTATION_SIGNATURE] = job(3)["metadata"]["annotations"][
        naming.ANNOTATION_SIGNATURE
    ]
    assert not owns(copied)


def test_a_job_the_status_named_before_this_process_started_is_the_runs_unsigned():
    """Made by the operator before an upgrade (no signature) or before a restart with another key."""
    earlier = job(1, key=b"", created=STARTED - timedelta(minutes=4))
    assert owns(earlier, state=status(1))
    assert not owns(earlier, state=status(2))  # not the job status names
    assert not owns(job(1, key=b"", created=STARTED + timedelta(seconds=1)), state=status(1))  # made since
    # an attempt this process started: its job must be signed, whatever its name
    assert not owns(earlier, state=status(1, started=STARTED + timedelta(seconds=1)))


def test_another_runs_job_is_never_the_runs():
    assert not run_owns_job(job(1), "other-uid", status(1), KEY, STARTED)


def test_without_a_key_the_owner_reference_decides():
    assert run_owns_job(job(2, key=b""), "run-uid", {}, b"", STARTED)


def test_a_signature_copied_onto_a_planted_job_of_the_same_name_is_not_enough():
    """On main the signature bound the run's uid and the job's name only: copied from the run's job onto a job
    planted under that name (once the run's was deleted), with another spec, it made the planted job the run's."""
    mine = job(2, uid="the-runs-job")
    planted = job(2, key=b"", uid="planted-job")
    planted["metadata"]["annotations"][naming.ANNOTATION_SIGNATURE] = mine["metadata"]["annotations"][
        naming.ANNOTATION_SIGNATURE
    ]
    assert owns(mine) and not owns(planted)


def test_signatures_of_operators_before_the_uid_are_never_taken():
    import hashlib
    import hmac

    legacy = job(2, key=b"")
    legacy["metadata"]["annotations"][naming.ANNOTATION_SIGNATURE] = hmac.new(
        KEY, b"run-uid/demo-a2", hashlib.sha256
    ).hexdigest()[:32]
    assert not owns(legacy)


def test_a_job_this_process_made_is_the_runs_before_its_signature_shows():
    unsigned = job(2, key=b"", uid="made-here")
    assert owns(unsigned, made={"made-here"}) and not owns(unsigned, made={"other"})
    planted = job(2, key=b"", uid="made-here")
    planted["metadata"]["ownerReferences"][0]["uid"] = "another-run"
    assert not owns(planted, made={"made-here"})  # the uid alone is not enough: the run must control it
