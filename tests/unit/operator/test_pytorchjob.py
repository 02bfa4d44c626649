"""pytorchjob.py: how a Kubeflow PyTorchJob's state reads (its builder is tested in test_builders.py, beside the pod
template every backend shares)."""

import pytest

from trainingrun_operator import pytorchjob


def job(*true, message=None, since="2026-12-06T10:00:00Z"):
    conditions = [{"type": t, "status": "True", "lastTransitionTime": since, "message": message} for t in true]
    return {"kind": "PyTorchJob", "metadata": {"name": "demo-a1"}, "status": {"conditions": conditions}}


@pytest.mark.parametrize(
    "true,state",
    [
        (["Created", "Running", "Succeeded"], "Succeeded"),
        (["Created", "Running", "Failed"], "Failed"),
        (["Created", "Suspended"], "Suspended"),
        (["Created", "Running"], "Running"),
        (["Created", "Restarting"], "Restarting"),
        (["Created"], "Created"),
        ([], None),
    ],
)
def test_the_strongest_true_condition_is_the_state(true, state):
    assert pytorchjob.state(job(*true), []) == state


def test_each_restarting_transition_is_one_replacement_counted_once():
    restarting = job("Restarting", message="PyTorchJob demo-a1 is restarting because 1 Worker replica(s) failed.")
    more, marks, said = pytorchjob.pods_replaced(restarting, [], {})
    assert (more, marks) == (1, {"lastInPlaceTime": "2026-12-06T10:00:00Z"}) and "1 Worker replica(s)" in said
    assert pytorchjob.pods_replaced(restarting, [], marks) is None  # the same transition
    assert pytorchjob.pods_replaced(job("Running"), [], marks) is None
    later = job("Restarting", since="2026-12-06T10:05:00Z")
    assert pytorchjob.pods_replaced(later, [], marks)[1] == {"lastInPlaceTime": "2026-12-06T10:05:00Z"}


def test_suspending_and_what_is_kept(minimal_body):
    from trainingrun_operator import validation

    built = pytorchjob.pytorch_job(validation.parse(minimal_body), 1)
    built["status"] = {"conditions": [{"type": "Running", "status": "True"}], "replicaStatuses": {"Worker": {}}}
    assert pytorchjob.slim(built) == {
        "spec": {"runPolicy": {"suspend": False}},
        "status": {"conditions": [{"type": "Running", "status": "True"}]},
    }
    assert pytorchjob.suspend_patch() == {"spec": {"runPolicy": {"suspend": True}}}
