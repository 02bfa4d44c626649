"""backends.py: which backends an operator runs (its setting and the CRDs served at start) and which one a run uses."""

import pytest

from trainingrun_operator import backends
from trainingrun_operator.settings import Settings

BOTH = ("PyTorchJob", "JobSet")


@pytest.mark.parametrize(
    "setting,served,default,usable",
    [
        ("auto", BOTH, "PyTorchJob", BOTH),  # a Kubeflow cluster runs as before JobSet existed
        ("auto", ("JobSet",), "JobSet", ("JobSet",)),  # a cluster with JobSet (or Trainer v2) and no Kubeflow v1
        ("auto", ("PyTorchJob",), "PyTorchJob", ("PyTorchJob",)),
        ("auto", (), "PyTorchJob", ("PyTorchJob",)),  # nothing served: readiness names what to install
        ("JobSet", BOTH, "JobSet", ("JobSet",)),  # the chart granted JobSet verbs only
        ("PyTorchJob", (), "PyTorchJob", ("PyTorchJob",)),
    ],
)
def test_the_setting_and_what_is_served_choose_the_backends(setting, served, default, usable):
    choice = backends.choose(Settings(backend=setting), served)
    assert choice.default.kind == default and tuple(b.kind for b in choice.usable) == usable


def test_a_run_keeps_the_backend_its_first_attempt_had():
    choice = backends.choose(Settings(), BOTH)
    assert choice.of(None, {}) is backends.PYTORCHJOB
    assert choice.of("JobSet", {}) is backends.JOBSET
    assert choice.of(None, {"backend": "JobSet", "jobName": "demo-a1"}) is backends.JOBSET
    # A run from before status recorded it ran PyTorchJobs, whatever the default is now.
    assert backends.choose(Settings(backend="JobSet"), ()).of(None, {"jobName": "demo-a1"}) is backends.PYTORCHJOB


def test_a_backend_the_operator_does_not_run_is_named_with_the_way_out():
    choice = backends.choose(Settings(backend="auto"), ("PyTorchJob",))
    assert choice.problem(backends.PYTORCHJOB) is None
    problem = choice.problem(backends.JOBSET)
    assert problem.startswith("spec.backend JobSet: this operator runs PyTorchJob only")
    assert "set spec.backend to PyTorchJob" in problem and "install JobSet" in problem


def test_every_backend_builds_an_attempt_whose_job_is_last_and_of_its_kind(minimal_body):
    from trainingrun_operator import validation

    run = validation.parse(minimal_body)
    for backend in backends.BACKENDS.values():
        job = backend.children(run, 2)[-1]
        assert (job["apiVersion"], job["kind"]) == (backend.api_version, backend.kind)
        assert job["metadata"]["name"] == "demo-a2"
    assert set(backends.JOB_KINDS) == set(BOTH)


def test_settings_refuse_an_unknown_backend():
    with pytest.raises(ValueError, match="TRAININGRUN_BACKEND='Volcano' must be one of auto, PyTorchJob, JobSet"):
        Settings.from_env({"TRAININGRUN_BACKEND": "Volcano"})
    assert Settings.from_env({"TRAININGRUN_BACKEND": "JobSet"}).backend == "JobSet"
    assert Settings.from_env({}).backend == "auto"
