"""`trainingrun validate` == a real API server.

Every document of the valid and invalid tables (tests/run_documents.py) and the property test's random
documents go to kube-apiserver v1.36 as a create with `dryRun=All` and `fieldValidation=Strict` (what
`kubectl apply` does, without storing anything), with the generated CRD and Kubeflow's v1.9 PyTorchJob CRD
installed. For every document validate accepts, everything the builders render (ConfigMap, ServiceAccount,
Role, RoleBinding, PyTorchJob, and a Pod made from the Worker template, where Kubernetes checks labels,
tolerations, affinity, env, volumes and resources) is accepted too, and so is every JobSet (JobSet's v0.9.1 CRD:
its schema and CEL rules, and the real controller's webhooks) with its rendezvous Service, a Pod of it and the Job
JobSet's controller would make of it.
"""

import copy

import pytest
from hypothesis import HealthCheck, given, settings

from kube_cluster import collection, refusal
from run_documents import CASES, GAP_CASES, VALID_CASES, documents
from trainingrun_operator import jobset, kube_shapes, pytorchjob, validation

DRY_RUN = "?dryRun=All&fieldValidation=Strict"

#: Documents validate refuses that the API server stores, and why refusing them is right.
STRICTER_THAN_THE_SERVER = {
    "pod-label-reserved": "the operator's own label would overwrite it on every pod (the user's value is lost)",
    "pod-annotations-too-big": "the TrainingRun stores it; every pod of the run is refused (pod_change shows it)",
    "toleration-key": "the CRD has no CEL rule for it (cost); every pod of the run is refused (pod_change shows it)",
    "affinity-in-without-values": "the CRD types affinity but not its operator rules; the pods are refused",
    "integer-past-int64-in-init-args": "initArgs keeps unknown fields: the server stores the number as a float, "
    "so the model would get 1.8446744073709552e+19 instead",
    "init-args-credentials": "initArgs keeps unknown fields, which the CRD cannot see into: the credentials would sit "
    "in the run's ConfigMap and reach its trackers",
    "init-args-over-64kib": "initArgs keeps unknown fields, whose size the CRD cannot check (no CEL over them): the "
    "operator's limit keeps every pod's config annotation under 256 KiB (test_hostile_runs_real.py for depth)",
    "config-annotation-over-256kib": "the TrainingRun stores it; every pod of the run is refused for its annotations "
    "(test_a_config_too_big_for_its_pods_annotations_is_refused_as_the_server_would shows the limit)",
}


def deliberately_stricter(problem):
    """A refusal of a kind STRICTER_THAN_THE_SERVER gives its reason for (random documents make such values too)."""
    return ".initArgs" in problem.path and "outside the 64-bit integers" in problem.message


def dry_run(plane, obj, namespace):
    """(HTTP status, the server's message) for creating `obj` with dryRun=All and strict field validation."""
    code, answer = plane.request("POST", collection(obj, namespace) + DRY_RUN, obj)
    return code, refusal(answer) if code >= 400 else ""


def server_body(body, namespace):
    body = copy.deepcopy(body)
    body["metadata"] = {k: v for k, v in body["metadata"].items() if k not in ("uid", "namespace")}
    body["metadata"]["namespace"] = namespace
    return body


def pod_from(job, namespace):
    if job["kind"] == "JobSet":
        template = job["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    else:
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {**copy.deepcopy(template["metadata"]), "name": "worker-0", "namespace": namespace},
        "spec": copy.deepcopy(template["spec"]),
    }


#: Each backend's children of an attempt.
BACKENDS = {"PyTorchJob": pytorchjob.children, "JobSet": jobset.children}


def children_refusals(plane, run, namespace, backend="PyTorchJob"):
    """Every rendered child of attempt 2 (with a resume point) that the API server refuses, with its message.
    The run's pods name a ServiceAccount: admission needs it to exist, as it would once the operator made it."""
    objects = BACKENDS[backend](run, attempt=2, resume_from=run.spec.checkpoint.uri + "/step-00000100")
    job = objects[-1]
    made = [pod_from(job, namespace)]
    if job["kind"] == "JobSet":  # the Job its controller makes of the replicated job: Kubernetes' own Job checks
        replicated = job["spec"]["replicatedJobs"][0]
        made.append({"apiVersion": "batch/v1", "kind": "Job", **copy.deepcopy(replicated["template"])})
        made[-1]["metadata"] = {**made[-1]["metadata"], "name": f"{job['metadata']['name']}-{replicated['name']}-0"}
    refused = []
    for obj in objects + made:
        obj = copy.deepcopy(obj)
        obj["metadata"]["namespace"] = namespace
        obj["metadata"].pop("ownerReferences", None)  # the run does not exist (dry run): no owner to point at
        code, message = dry_run(plane, obj, namespace)
        if code == 409 and obj["kind"] == "ServiceAccount":
            continue  # made for real by with_service_accounts: Pod admission looks it up
        if code >= 300:
            refused.append(f"{obj['kind']}: {code} {message}")
    return refused


@pytest.fixture(scope="module")
def namespace(kube_cluster_with_crds):
    return kube_cluster_with_crds.create_namespace("validate-agrees")


def with_service_accounts(plane, run, namespace):
    """The ServiceAccount the pods run as, really created (Pod admission looks it up)."""
    if run.spec.service_account_name:
        plane.kubectl("-n", namespace, "create", "serviceaccount", run.spec.service_account_name, check=False)


@pytest.mark.parametrize("change,crd_path", [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_invalid_documents_are_refused_by_the_server_too(
    kube_cluster_with_crds, namespace, minimal_body, change, crd_path
):
    change(minimal_body)
    with pytest.raises(validation.InvalidTrainingRun):
        validation.check(minimal_body)
    code, message = dry_run(kube_cluster_with_crds, server_body(minimal_body, namespace), namespace)
    assert code in (400, 422), f"the server accepted ({code}) what validate refuses"
    if crd_path:
        assert crd_path in message, message


@pytest.mark.parametrize("case", GAP_CASES, ids=[c[0] for c in GAP_CASES])
def test_what_the_cluster_refuses_validate_refuses(kube_cluster_with_crds, namespace, minimal_body, case):
    case_id, change, expected, crd_path, pod_change = case
    plane = kube_cluster_with_crds
    change(minimal_body)
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.check(minimal_body)
    assert any(expected in str(p) for p in caught.value.problems)
    code, message = dry_run(plane, server_body(minimal_body, namespace), namespace)
    if code >= 400:
        assert code in (400, 422), message
        if crd_path:
            assert crd_path in message, message
    else:
        assert case_id in STRICTER_THAN_THE_SERVER, f"the server stores it ({code}) and no reason is given"
    for secret in ("wJalrSECRET", "s3cr3tpass"):
        assert secret not in message  # the server's own messages do not repeat URI credentials either
    if pod_change is not None:
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "probe", "namespace": namespace},
            "spec": {"containers": [{"name": "c", "image": "trainer"}]},
        }
        pod_change(pod)
        code, message = dry_run(plane, pod, namespace)
        assert code == 422, f"a Pod with the same value was accepted ({code})"


@pytest.mark.parametrize(
    "value,valid",
    [
        ("Team_A", False),
        ("team.a", False),
        ("-team", False),
        ("a" * 64, False),
        ("team-a1", True),
        ("0-team", True),
        ("a" * 63, True),
    ],
)
def test_validate_refuses_a_namespace_exactly_when_the_server_can_never_have_it(
    kube_cluster_with_crds, minimal_body, value, valid
):
    plane = kube_cluster_with_crds
    minimal_body["metadata"]["namespace"] = value
    if valid:
        validation.check(minimal_body)
    else:
        with pytest.raises(validation.InvalidTrainingRun) as caught:
            validation.check(minimal_body)
        assert [p.path for p in caught.value.problems] == ["metadata.namespace"]
    namespace = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": value}}
    code, message = plane.request("POST", "/api/v1/namespaces" + DRY_RUN, namespace)
    assert (code == 201) == valid, f"{code} {message}"
    if not valid:  # kubectl apply sends the run to its namespace, which cannot exist
        run = {**minimal_body, "metadata": {"name": "demo", "namespace": value}}
        code, message = dry_run(plane, run, value)
        assert code in (400, 404, 422), f"{code} {message}"


def test_a_config_too_big_for_its_pods_annotations_is_refused_as_the_server_would(
    kube_cluster_with_crds, namespace, minimal_body
):
    """Pods carry the trainer config in an annotation. The server takes an object's annotations up to 256 KiB, keys
    and values together (the same check for every kind: a ConfigMap here, which needs no ServiceAccount), and the
    operator refuses a run whose config would not fit, naming spec.trainer, before any pod is tried."""
    limit = kube_shapes.MAX_ANNOTATIONS_BYTES
    carrier = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "big", "namespace": namespace, "annotations": {"a": "x" * limit}},
    }
    code, message = dry_run(kube_cluster_with_crds, carrier, namespace)
    assert code == 422 and str(limit) in message, message
    carrier["metadata"]["annotations"]["a"] = "x" * (limit - 1)
    assert dry_run(kube_cluster_with_crds, carrier, namespace)[0] == 201

    minimal_body["spec"]["image"] = "registry.example/team/trainer:1"
    tables = {"table": "x" * 60_000}  # each free-form field under its own 64 KiB limit, the config over 256 KiB
    minimal_body["spec"]["trainer"] = {
        "model": {"classPath": "team.models.Big", "initArgs": tables},
        "data": {"dataset": {"classPath": "team.data.Big", "initArgs": tables}},
        "eval": {"intervalSteps": 10, "dataset": {"classPath": "team.data.Big", "initArgs": tables}},
    }
    minimal_body["spec"]["podAnnotations"] = {"example.com/notes": "x" * 90_000}
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.check(minimal_body)
    problem = next(p for p in caught.value.problems if p.path == "spec.trainer")
    assert f"at most {limit}" in str(problem) and "initArgs" in str(problem)
    minimal_body["spec"]["podAnnotations"] = {}
    validation.check(minimal_body)  # without the notes it fits


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("change", [c[1] for c in VALID_CASES], ids=[c[0] for c in VALID_CASES])
def test_valid_documents_and_their_children_are_accepted(
    kube_cluster_with_crds, namespace, minimal_body, change, backend, request
):
    plane = kube_cluster_with_crds
    if backend == "JobSet":
        request.getfixturevalue("jobset_controller")  # its webhooks admit the JobSet and its pods
    change(minimal_body)
    run = validation.check(minimal_body)
    code, message = dry_run(plane, server_body(minimal_body, namespace), namespace)
    assert code == 201, message
    run.metadata.namespace = namespace
    with_service_accounts(plane, run, namespace)
    assert children_refusals(plane, run, namespace, backend) == []


def test_a_users_value_for_an_operator_default_wins_without_a_duplicate(minimal_body):
    minimal_body["spec"]["env"] = [{"name": "PYTHONUNBUFFERED", "value": "0"}, {"name": "HOME", "value": "/data"}]
    job = pytorchjob.pytorch_job(validation.check(minimal_body), 1)
    env = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    names = [e["name"] for e in env]
    assert len(names) == len(set(names))
    assert {"name": "PYTHONUNBUFFERED", "value": "0"} in env and {"name": "HOME", "value": "/data"} in env


# ---------------------------------------------------------------- random documents


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(body=documents())
def test_random_documents_get_the_same_verdict(kube_cluster_with_crds, namespace, body):
    plane = kube_cluster_with_crds
    code, message = dry_run(plane, server_body(body, namespace), namespace)
    try:
        # The server cannot know the trainer's built-in classes; validate (and the operator) refuse a wrong one too.
        run = validation.check(body, builtin_classes=False)
    except validation.InvalidTrainingRun as error:
        assert code >= 400 or all(deliberately_stricter(p) for p in error.problems), (
            f"validate refuses ({error}) but the server accepts"
        )
        return
    assert all(p.path.startswith("spec.trainer.") for p in validation.component_problems(run.spec.trainer))
    assert code == 201, f"validate accepts but the server refuses: {message}"
    run.metadata.namespace = namespace
    with_service_accounts(plane, run, namespace)
    assert children_refusals(plane, run, namespace) == []


@pytest.mark.parametrize(
    "before,after",
    [("PyTorchJob", "JobSet"), (None, "JobSet"), ("JobSet", None)],
    ids=["changed", "added", "removed"],
)
def test_spec_backend_cannot_change_once_the_run_exists(kube_cluster_with_crds, namespace, minimal_body, before, after):
    """The CRD's transition rule (the emulator in tests/crd_server.py skips those): a run's attempts are all of one
    kind, so spec.backend is set at creation or never; other spec changes still go through."""
    plane = kube_cluster_with_crds
    body = server_body(minimal_body, namespace)
    body["metadata"]["name"] = f"backend-{before or 'none'}-{after or 'none'}".lower()
    if before:
        body["spec"]["backend"] = before
    path = collection(body, namespace)
    code, answer = plane.request("POST", path, body)
    assert code == 201, answer
    changed = copy.deepcopy(answer)
    changed["spec"].pop("backend", None)
    if after:
        changed["spec"]["backend"] = after
    code, answer = plane.request("PUT", f"{path}/{body['metadata']['name']}", changed)
    assert code == 422, answer
    assert "spec.backend cannot change after the run is created" in refusal(answer)
    kept = copy.deepcopy(changed)
    kept["spec"].pop("backend", None)
    if before:
        kept["spec"]["backend"] = before
    kept["spec"]["suspend"] = True
    code, answer = plane.request("PUT", f"{path}/{body['metadata']['name']}", kept)
    assert code == 200, answer
