"""jobset: one attempt as a JobSet that JobSet's CRD accepts, with what Kubeflow's controller would have given a
PyTorchJob's pods (torchrun's settings, worker 0 hosting the rendezvous) and failures handed to the operator."""

import copy

import jsonschema
import kubernetes_validate
import pytest

from conftest import EXAMPLES
from trainingrun_api import contract, exit_codes
from trainingrun_operator import builders, jobset, naming, pytorchjob, validation

K8S_VERSION = "1.30.0"


def env_of(obj: dict) -> dict:
    container = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def schema_problems(obj: dict, schema: dict) -> list[str]:
    return [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(obj)]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_every_example_renders_a_jobset_its_crd_and_kubernetes_accept(example, jobset_schema):
    for run in validation.load_runs(str(example)):
        run = run.model_copy(update={"metadata": run.metadata.model_copy(update={"uid": "u-1"})})
        objects = jobset.children(run, attempt=2, resume_from="s3://bkt/ckpt/step-100")
        assert objects[-1]["kind"] == "JobSet"
        assert schema_problems(objects[-1], jobset_schema) == []
        job = objects[-1]["spec"]["replicatedJobs"][0]["template"]
        kubernetes_validate.validate(
            {"apiVersion": "batch/v1", "kind": "Job", **job, "metadata": {"name": "j"}}, K8S_VERSION, strict=True
        )
        for support in objects[:-1]:
            kubernetes_validate.validate(support, K8S_VERSION, strict=True)


def test_a_multi_pod_attempt_gets_torchruns_settings_and_worker_0_hosts_the_rendezvous(minimal_body):
    body = copy.deepcopy(minimal_body)
    body["spec"]["replicas"] = {"min": 2, "max": 4}
    body["spec"]["nprocPerNode"] = 8
    run = validation.parse(body)
    service, attempt = jobset.children(run, attempt=3)
    env = env_of(attempt)
    assert env["PET_NNODES"] == "2:4" and env["PET_NPROC_PER_NODE"] == "8"
    assert env["PET_RDZV_BACKEND"] == "c10d" and env["PET_RDZV_ID"] == f"{run.metadata.uid}-a3"
    assert env["PET_RDZV_ENDPOINT"] == f"{service['metadata']['name']}:{contract.RENDEZVOUS_PORT}"
    # Worker 0 by its stable hostname (the Job names the pod with a random suffix), and the Service selects it.
    assert env[contract.RENDEZVOUS_HOST_POD] == "demo-a3-worker-0-0" == jobset.worker_hostname("demo", 3, 0)
    assert service["spec"]["selector"][jobset.COMPLETION_INDEX_LABEL] == "0"
    assert service["spec"]["selector"][naming.LABEL_ATTEMPT] == "3"
    job = attempt["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert (job["parallelism"], job["completions"], job["completionMode"]) == (4, 4, "Indexed")
    assert attempt["spec"]["network"]["enableDNSHostnames"] is True
    # The pod the backends share, with its labels: the Service finds the attempt's pods by them.
    assert (
        job["template"]["spec"]["containers"][0]["image"]
        == builders.pod_template(run, 3, builders.Settings(), None)["spec"]["containers"][0]["image"]
    )
    assert job["template"]["metadata"]["labels"][naming.LABEL_ATTEMPT] == "3"


def test_failures_go_to_the_operators_attempts_never_jobsets_own_restarts(minimal_body):
    body = copy.deepcopy(minimal_body)
    body["spec"]["recovery"] = {"maxRestartsPerAttempt": 5}
    attempt = jobset.jobset(validation.parse(body), attempt=1)
    assert attempt["spec"]["failurePolicy"] == {"maxRestarts": 0}
    job = attempt["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 5 and job["template"]["spec"]["restartPolicy"] == "Never"
    fail, ignore = job["podFailurePolicy"]["rules"]
    # Exactly the exit codes the operator reads as permanent fail the Job at once; the rest are retried in it.
    assert [code for code in range(256) if code in fail["onExitCodes"]["values"]] == [
        code for code in range(256) if exit_codes.classify(code) == exit_codes.PERMANENT
    ]
    assert fail["action"] == "FailJob" and fail["onExitCodes"]["containerName"] == naming.CONTAINER_NAME
    assert ignore == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}


def test_one_pod_runs_standalone_with_no_service(minimal_body):
    objects = jobset.children(validation.parse(minimal_body), attempt=1)
    assert [o["kind"] for o in objects] == ["JobSet"]
    env = env_of(objects[0])
    assert env["PET_STANDALONE"] == "1" and "PET_RDZV_ENDPOINT" not in env and env["PET_MAX_RESTARTS"] == "3"


def test_queue_suspend_and_signing_annotations_as_on_a_pytorchjob(minimal_body):
    body = copy.deepcopy(minimal_body)
    body["spec"]["queueName"] = "team-a"
    body["spec"]["suspend"] = True
    run = validation.parse(body)
    attempt = jobset.jobset(run, attempt=2, resume_from="s3://bucket/runs/demo/step-00000100")
    job = pytorchjob.pytorch_job(run, attempt=2, resume_from="s3://bucket/runs/demo/step-00000100")
    assert attempt["metadata"] == job["metadata"]  # name, labels (Kueue's queue), owner, annotations
    assert attempt["spec"]["suspend"] is True
    # Kueue admits the JobSet as one workload: its Job carries the run's labels but the queue's.
    job_labels = attempt["spec"]["replicatedJobs"][0]["template"]["metadata"]["labels"]
    assert naming.KUEUE_QUEUE_LABEL not in job_labels and job_labels[naming.LABEL_RUN] == run.metadata.name


# ---------------------------------------------------------------- reading its state


def with_status(**status):
    return {"kind": "JobSet", "metadata": {"name": "demo-a1"}, "status": status}


def condition(type_, status="True"):
    return {"type": type_, "status": status, "lastTransitionTime": "2026-12-06T10:00:00Z"}


def running_pod(**metadata):
    return {"metadata": {"name": "demo-a1-worker-0-0-x", **metadata}, "status": {"phase": "Running"}}


@pytest.mark.parametrize(
    "status,pods,state",
    [
        ({"conditions": [condition("Completed")]}, [], "Succeeded"),
        ({"conditions": [condition("Failed")]}, [running_pod()], "Failed"),
        ({"conditions": [condition("Suspended")]}, [], "Suspended"),
        ({"conditions": [condition("Suspended", "False")]}, [running_pod()], "Running"),
        ({"replicatedJobsStatus": [{"name": "worker", "ready": 1}]}, [], "Running"),
        ({"replicatedJobsStatus": [{"name": "worker", "ready": 0, "active": 1}]}, [], "Created"),
        ({}, [running_pod(deletionTimestamp="2026-12-06T10:00:00Z")], "Created"),  # a pod going away runs no more
        ({}, [], "Created"),
    ],
)
def test_a_jobsets_state_reads_as_kubeflows_words(status, pods, state):
    """reconcile reads every backend's state in Kubeflow's words; JobSet says Completed, and has no Running."""
    assert jobset.state(with_status(**status), pods) == state


def job_part(failed):
    return {"metadata": {"name": "demo-a1-worker-0"}, "status": {"failed": failed}}


def test_pods_replaced_are_the_jobs_failed_pods_not_counted_yet():
    assert jobset.pods_replaced(with_status(), [job_part(0)], {}) is None
    more, marks, said = jobset.pods_replaced(with_status(), [job_part(2)], {"attemptPodsFailed": 1})
    assert (more, marks) == (1, {"attemptPodsFailed": 2}) and "Job demo-a1-worker-0" in said
    assert jobset.pods_replaced(with_status(), [job_part(2)], {"attemptPodsFailed": 2}) is None
    assert jobset.pods_replaced(with_status(), [], {}) is None  # the Job not seen yet
    # A failing Job stops its last pods (counted failed too) and replaces none: the attempt ends, nothing in place.
    failing = {"metadata": {"name": "demo-a1-worker-0"}, "status": {"failed": 3, "active": 1, "conditions": []}}
    failing["status"]["conditions"] = [{"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded"}]
    kept = jobset.slim_part(failing)
    assert kept["status"]["conditions"] == [{"type": "FailureTarget", "status": "True"}]
    assert jobset.pods_replaced(with_status(), [kept], {"attemptPodsFailed": 1}) is None


def test_the_operator_keeps_what_it_reads_of_a_jobset_and_no_more(minimal_body):
    attempt = jobset.jobset(validation.parse(minimal_body), 1)
    attempt["status"] = {
        "conditions": [condition("Completed")],
        "replicatedJobsStatus": [{"name": "worker", "ready": 1, "active": 1, "succeeded": 0, "failed": 0}],
        "restarts": 0,
        "terminalState": "Completed",
    }
    kept = jobset.slim(attempt)
    assert kept["spec"] == {"suspend": False}
    assert jobset.state({**kept, "metadata": attempt["metadata"]}, []) == "Succeeded"
    assert kept["status"]["replicatedJobsStatus"][0]["ready"] == 1 and "terminalState" not in kept["status"]
    assert jobset.suspend_patch() == {"spec": {"suspend": True}}
