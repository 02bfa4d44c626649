"""The one table of exit codes (trainingrun_api/exit_codes.py), as the operator and `trainingrun local` use it."""

import pytest

from trainingrun_api import exit_codes
from trainingrun_api.exit_codes import FAILURE, PERMANENT, PREEMPTION, SUCCEEDED, classify
from trainingrun_operator import children


@pytest.mark.parametrize(
    "code, stopping, meaning",
    [
        (0, False, SUCCEEDED),
        (1, False, PERMANENT),  # an uncaught exception
        (exit_codes.CONFIG_ERROR, False, PERMANENT),
        (exit_codes.DIVERGED, False, PERMANENT),
        (exit_codes.CHECKPOINT_REFUSED, False, PERMANENT),
        (127, False, PERMANENT),
        (127, True, PERMANENT),  # a verdict stays one while the pod goes away
        (130, False, FAILURE),  # SIGINT nobody asked for
        (130, True, PREEMPTION),  # ... or the run being stopped
        (137, False, FAILURE),  # the OOM killer
        (137, True, PREEMPTION),  # SIGKILL after the grace period of a deleted pod
        (exit_codes.PREEMPTED, False, PREEMPTION),  # 143: stopped after the emergency checkpoint
        (exit_codes.RETRYABLE, False, FAILURE),  # 138: storage down at start, a peer gone
        (139, False, FAILURE),  # SIGSEGV
        (255, False, FAILURE),
    ],
)
def test_every_exit_code_has_one_meaning(code, stopping, meaning):
    assert classify(code, stopping=stopping) == meaning


def pod(code, deleting=False):
    meta = (
        {"name": "demo-a1-worker-0", "deletionTimestamp": "2026-11-24T00:00:00Z"}
        if deleting
        else {"name": "demo-a1-worker-0"}
    )
    return {
        "metadata": meta,
        "status": {
            "containerStatuses": [{"name": "pytorch", "state": {"terminated": {"exitCode": code, "reason": "Error"}}}]
        },
    }


@pytest.mark.parametrize(
    "code, deleting", [(1, False), (130, False), (130, True), (137, False), (137, True), (143, False), (138, False)]
)
def test_the_operator_reads_pod_exit_codes_with_the_same_table(code, deleting):
    job = {"metadata": {"name": "demo-a1"}, "status": {}}
    assert children.classify_failure(job, [pod(code, deleting)]).cause == classify(code, stopping=deleting)
