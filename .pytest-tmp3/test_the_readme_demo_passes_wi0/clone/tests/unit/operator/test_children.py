"""children.classify_failure: why an attempt failed, from its job and its pods' terminations (exit codes, OOM, eviction,
preemption), the permanent failure's termination message, and a failure without pods."""

import pytest
from test_reconcile import ended, job, pod

from trainingrun_operator import children

# ---------------------------------------------------------------- classification


@pytest.mark.parametrize(
    "pod_status,metadata,cause",
    [
        (
            {"conditions": [{"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI"}]},
            {},
            "preemption",
        ),
        ({"reason": "Evicted", "message": "The node was low on resource: memory."}, {}, "preemption"),
        (ended(143), {}, "preemption"),
        (ended(137, "Error"), {"deletionTimestamp": "2026-11-21T11:59:59Z"}, "preemption"),
        (ended(137, "OOMKilled"), {}, "failure"),
        (ended(138), {}, "failure"),
        (ended(2, message="spec.trainer.model: no such class"), {}, "permanent"),
        (ended(3, key="lastState"), {}, "permanent"),
    ],
)
def test_failure_causes(pod_status, metadata, cause):
    failure = children.classify_failure(job(1, "Failed"), [pod(1, pod_status, **metadata)])
    assert failure.cause == cause and failure.from_pods


def test_permanent_failure_carries_the_termination_message():
    failure = children.classify_failure(job(1, "Failed"), [pod(1, ended(2, message="bad classPath\n"))])
    assert failure.detail == "pod demo-a1-worker-0 exited with 2: bad classPath" and failure.exit_code == 2


def test_failure_without_pods_says_so():
    failed = job(1, "Failed")
    failed["status"]["conditions"][0]["message"] = "PyTorchJob demo-a1 is failed because 1 Worker replica(s) failed."
    failure = children.classify_failure(failed, [])
    assert failure.cause == "failure" and not failure.from_pods and "1 Worker replica(s) failed" in failure.detail
