"""The operator against a real API server, as the chart installs it.

The operator runs as its own process (`trainingrun operator`) authenticated with a token of the chart's
ServiceAccount (`kubectl create token`), so the chart's RBAC is what is tested: a missing rule is a 403
here. The test plays the Kubeflow Training Operator (PyTorchJob status through its status subresource, a
worker pod owned by the job, as Kubeflow creates it) and the kubelet (the pod's status). What a real
server adds over kmock: uids, generations and resourceVersions it sets itself, the status subresource,
RBAC with its escalation check, quota admission, and the garbage collector that removes a deleted
run's children.
"""

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
import yaml

from conftest import REPO
from trainingrun_operator import naming, pytorchjob, validation

RUNS = "trainingruns.trainingrun.dev"
JOBS = "pytorchjobs.kubeflow.org"
RELEASE, RELEASE_NAMESPACE = "tr-real", "trainingrun-real"
HELM = REPO / ".tools/bin/helm"


def wait_for(check, timeout=30.0, what=""):
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or check}")
        time.sleep(0.1)


class RealCluster:
    """kubectl-like reads and writes as the cluster admin (the user, Kubeflow and the kubelet in one)."""

    def __init__(self, plane, namespace):
        self.plane, self.namespace = plane, namespace

    def get(self, kind, name):
        result = self.plane.kubectl("-n", self.namespace, "get", kind, name, "-o", "json", check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    def status(self, name="demo"):
        return (self.get(RUNS, name) or {}).get("status") or {}

    def condition(self, type_, name="demo"):
        return next((c for c in self.status(name).get("conditions", []) if c["type"] == type_), None)

    def events(self, reason=None):
        items = json.loads(self.plane.kubectl("-n", self.namespace, "get", "events", "-o", "json").stdout)["items"]
        return [e for e in items if reason is None or e["reason"] == reason]

    def patch_status(self, kind, name, status):
        self.plane.kubectl(
            "-n",
            self.namespace,
            "patch",
            kind,
            name,
            "--subresource=status",
            "--type=merge",
            "-p",
            json.dumps({"status": status}),
        )

    def job_condition(self, job_name, *types):
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.patch_status(
            JOBS,
            job_name,
            {
                "conditions": [
                    {
                        "type": t,
                        "status": "True",
                        "reason": f"PyTorchJob{t}",
                        "message": "",
                        "lastUpdateTime": now,
                        "lastTransitionTime": now,
                    }
                    for t in types
                ]
            },
        )

    def worker_pod(self, job_name, index=0):
        """A worker pod as Kubeflow creates it: the template's labels, owned by the job."""
        job = self.get(JOBS, job_name)
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        name = f"{job_name}-worker-{index}"
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {**template["metadata"]["labels"], "training.kubeflow.org/job-name": job_name},
                "ownerReferences": [
                    {
                        "apiVersion": "kubeflow.org/v1",
                        "kind": "PyTorchJob",
                        "name": job_name,
                        "uid": job["metadata"]["uid"],
                        "controller": True,
                        "blockOwnerDeletion": True,
                    }
                ],
            },
            "spec": template["spec"],
        }
        self.plane.kubectl("create", "-f", "-", input=json.dumps(pod))
        return name

    def container_terminated(self, pod_name, exit_code, reason):
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.patch_status(
            "pod",
            pod_name,
            {
                "phase": "Failed",
                "containerStatuses": [
                    {
                        "name": "pytorch",
                        "image": "trainer",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": {
                            "terminated": {"exitCode": exit_code, "reason": reason, "startedAt": now, "finishedAt": now}
                        },
                    }
                ],
            },
        )

    def warning(self, kind, name, reason, message):
        """A Warning Event, as Kubeflow (on the job) or the kubelet (on a pod) records one."""
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{name}.{uuid.uuid4().hex[:10]}", "namespace": self.namespace},
            "involvedObject": {"kind": kind, "name": name, "namespace": self.namespace},
            "type": "Warning",
            "reason": reason,
            "message": message,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
            "source": {"component": "test"},
        }
        self.plane.kubectl("create", "-f", "-", input=json.dumps(event))

    def env_of(self, job_name):
        container = self.get(JOBS, job_name)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][
            0
        ]
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def rendered_chart(*options: str, release: str = RELEASE, namespace: str = RELEASE_NAMESPACE) -> list[dict]:
    """The chart's objects as `helm template` renders them for a release, with these options (-f, --set)."""
    assert HELM.exists(), f"{HELM} missing: run scripts/install-helm.sh"
    command = [str(HELM), "template", release, str(REPO / "charts/trainingrun-operator"), "--namespace", namespace]
    rendered = subprocess.run([*command, *options], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(rendered) if d]


@pytest.fixture(scope="module")
def operator_kubeconfig(kube_cluster_with_crds, tmp_path_factory):
    """The chart's identity for the operator (default values: cluster-wide), and a kubeconfig holding only its
    token, as the operator's pod would have."""
    plane = kube_cluster_with_crds
    # Everything but the Deployment: this test runs the operator itself, with the Deployment's identity.
    documents = [d for d in rendered_chart() if d["kind"] != "Deployment"]
    plane.kubectl("create", "namespace", RELEASE_NAMESPACE, check=False)
    plane.apply(documents)
    account = next(d for d in documents if d["kind"] == "ServiceAccount")["metadata"]["name"]
    token = plane.token(RELEASE_NAMESPACE, account)
    return plane.token_kubeconfig(tmp_path_factory.mktemp("operator") / "kubeconfig", token)


@pytest.fixture
def operator_process(operator_kubeconfig, tmp_path):
    yield from running_operator(operator_kubeconfig, tmp_path)


def running_operator(kubeconfig, tmp_path, **extra_env):
    """`trainingrun operator` as its own process with the chart's identity; yields its log file."""
    log = tmp_path / "operator.log"
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "TRAININGRUN_RECONCILE_INTERVAL_SECONDS": "0.5",
        "TRAININGRUN_CRD_CHECK_SECONDS": "1",
        "TRAININGRUN_CHILD_REJECTED_BACKOFF_SECONDS": "1",
        "TRAININGRUN_PENDING_EVENTS_AFTER_SECONDS": "1",
        "TRAININGRUN_OPERATOR_METRICS_PORT": "0",
        "TRAININGRUN_OPERATOR_HEALTH_PORT": "0",
        **extra_env,
    }
    with open(log, "w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainingrun_operator"], env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_for(
            lambda: "PyTorchJob CRD (kubeflow.org/v1) is served" in log.read_text() or process.poll() is not None,
            timeout=60,
            what="the operator to see the PyTorchJob CRD",
        )
        assert process.poll() is None, log.read_text()[-3000:]
        yield log
    finally:
        process.terminate()
        process.wait(timeout=30)
        text = log.read_text()
        # The chart's RBAC allowed every call: RBAC's refusal names the user ("forbidden: User ... cannot ...").
        assert 'forbidden: User "system:serviceaccount' not in text, text[-3000:]


@pytest.fixture
def cluster(kube_cluster_with_crds, kube_namespace):
    return RealCluster(kube_cluster_with_crds, kube_namespace)


def training_run(namespace, **spec):
    body = {
        "apiVersion": "trainingrun.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": "demo", "namespace": namespace},
        "spec": {"checkpoint": {"uri": "s3://bucket/demo"}, "recovery": {"backoffSeconds": 0}, **spec},
    }
    return json.dumps(body)


def test_lifecycle_with_the_charts_identity(cluster, operator_process):
    plane, ns = cluster.plane, cluster.namespace
    plane.kubectl("create", "-f", "-", input=training_run(ns, replicas={"min": 2, "max": 2}))
    run = cluster.get(RUNS, "demo")
    wait_for(lambda: cluster.get(JOBS, "demo-a1"), what="attempt 1's PyTorchJob")
    status = wait_for(lambda: cluster.status().get("phase") == "Pending" and cluster.status())
    assert status["attempt"] == 1 and status["jobName"] == "demo-a1"
    assert status["observedGeneration"] == run["metadata"]["generation"]  # the server's, not the test's
    children = [("service", "demo-rendezvous"), (JOBS, "demo-a1")]  # the config rides in its pods' annotations
    assert plane.kubectl("-n", ns, "get", "configmap", "demo-config", check=False).returncode != 0
    rendezvous = cluster.get("service", "demo-rendezvous")
    assert rendezvous["spec"]["selector"][naming.LABEL_ATTEMPT] == "1" and rendezvous["spec"]["clusterIP"]
    for kind, name in children:
        owner = cluster.get(kind, name)["metadata"]["ownerReferences"][0]
        assert owner["uid"] == run["metadata"]["uid"] and owner["controller"] is True, (kind, name)

    cluster.job_condition("demo-a1", "Created", "Running")
    wait_for(lambda: cluster.status().get("phase") == "Running", what="phase Running")
    assert_kubeflows_sdk_reads_the_job(plane, ns, "demo-a1", workers=2)
    # progress and a committed checkpoint in status (the report endpoint writes them: test_reports_real.py)
    checkpoint = {"uri": "s3://bucket/demo/step-00000300", "step": 300, "time": "2026-11-23T00:00:00Z"}
    cluster.patch_status(
        RUNS, "demo", {"progress": {"step": 310, "updatedAt": "2026-11-23T00:00:05Z"}, "lastGoodCheckpoint": checkpoint}
    )
    pod = cluster.worker_pod("demo-a1")
    cluster.container_terminated(pod, 134, "Error")  # SIGABRT: a failure, retryable
    cluster.job_condition("demo-a1", "Created", "Failed")

    wait_for(lambda: cluster.get(JOBS, "demo-a2"), what="attempt 2")
    assert cluster.env_of("demo-a2")["TRAININGRUN_RESUME_FROM"] == checkpoint["uri"]
    # the rendezvous Service now selects attempt 2's worker-0, at the address the server gave it at attempt 1
    moved = wait_for(
        lambda: (
            (cluster.get("service", "demo-rendezvous")["spec"]["selector"][naming.LABEL_ATTEMPT] == "2")
            and cluster.get("service", "demo-rendezvous")
        ),
        what="the Service at attempt 2",
    )
    assert moved["spec"]["clusterIP"] == rendezvous["spec"]["clusterIP"]
    status = wait_for(lambda: cluster.status().get("attempt") == 2 and cluster.status())
    assert status["restarts"] == {"failures": 1, "preemptions": 0, "total": 1, "backoffSeconds": 0.0}
    assert status["lastGoodCheckpoint"]["step"] == 300  # the operator's status writes kept the trainer's fields

    cluster.job_condition("demo-a2", "Created", "Running")
    cluster.job_condition("demo-a2", "Created", "Succeeded")
    status = wait_for(lambda: cluster.status().get("phase") == "Succeeded" and cluster.status())
    assert status["completionTime"]
    wait_for(lambda: cluster.events("Succeeded"), what="the Succeeded Event")
    reasons = [e["reason"] for e in sorted(cluster.events(), key=lambda e: e["metadata"]["creationTimestamp"])]
    assert reasons.count("AttemptStarted") == 2 and "AttemptFailed" in reasons

    # Deleting the run: the garbage collector removes every child (and the job's pod), the operator nothing.
    # The collector starts watching a kind it did not know at its next discovery resync (every 30 s): on this
    # fresh cluster the CRD is seconds old, so the children went 39 s after the delete (built-ins: ~0.2 s).
    plane.kubectl("-n", ns, "delete", RUNS, "demo", "--wait=true", "--timeout=60s")
    for kind, name in children + [(JOBS, "demo-a2"), ("pod", pod)]:
        wait_for(
            lambda kind=kind, name=name: cluster.get(kind, name) is None,
            timeout=120,
            what=f"the garbage collector to delete {kind}/{name}",
        )


def assert_kubeflows_sdk_reads_the_job(plane, namespace, name, workers):
    """Kubeflow's own Python SDK (kubeflow-training 1.9, what users of Kubeflow script with) reads the job the
    operator made as a typed PyTorchJob: elastic policy, Worker replicas and the job's state as Kubeflow sees it."""
    from kubeflow.training import TrainingClient

    sdk = TrainingClient(config_file=str(plane.admin_kubeconfig), namespace=namespace)
    job = sdk.get_job(name, job_kind="PyTorchJob")
    worker = job.spec.pytorch_replica_specs["Worker"]
    assert worker.replicas == workers and job.spec.elastic_policy.min_replicas == workers
    assert worker.template.spec.containers[0].name == "pytorch"  # the container Kubeflow's controller looks for
    assert sdk.is_job_running(name, job_kind="PyTorchJob")


def test_a_quota_refusal_is_a_condition_until_the_quota_allows_it(cluster, operator_process):
    """A refusal the real server makes (quota admission, 403): condition ChildRejected with the server's words
    and one Event; when the quota is lifted the attempt starts and the condition clears."""
    plane, ns = cluster.plane, cluster.namespace
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-jobs", "namespace": ns},
        "spec": {"hard": {"count/pytorchjobs.kubeflow.org": "0"}},
    }
    plane.kubectl("create", "-f", "-", input=json.dumps(quota))
    plane.kubectl("create", "-f", "-", input=training_run(ns))
    condition = wait_for(lambda: cluster.condition("ChildRejected"), what="condition ChildRejected")
    # "exceeded quota: no-jobs", or "status unknown for quota: no-jobs" while the quota controller has not yet
    # counted the new kind: both are the quota admission's 403
    assert condition["status"] == "True" and "quota: no-jobs" in condition["message"], condition
    assert "403 Forbidden" in condition["message"]
    assert cluster.get(JOBS, "demo-a1") is None
    plane.kubectl("-n", ns, "delete", "resourcequota", "no-jobs")
    wait_for(lambda: cluster.get(JOBS, "demo-a1"), timeout=30, what="the attempt once the quota is gone")
    wait_for(lambda: (cluster.condition("ChildRejected") or {}).get("status") == "False", what="the condition cleared")
    assert len(cluster.events("ChildRejected")) == 1


def test_a_misspelt_builtin_class_is_rejected_before_anything_is_scheduled(cluster, operator_process):
    """The real server accepts any classPath (the CRD cannot know the trainer's classes); with the operator's own
    trainer image the operator can, and refuses it with the field and the fix instead of starting pods."""
    plane, ns = cluster.plane, cluster.namespace
    model = {"classPath": "trainingrun_trainer.models.CharTransfomer"}
    plane.kubectl("create", "-f", "-", input=training_run(ns, trainer={"model": model}))
    condition = wait_for(lambda: cluster.condition("SpecRejected"), what="condition SpecRejected")
    assert condition["status"] == "True" and condition["reason"] == "InvalidSpec", condition
    assert "spec.trainer.model.classPath" in condition["message"] and "CharTransformer" in condition["message"]
    assert cluster.get(JOBS, "demo-a1") is None
    assert len(wait_for(lambda: cluster.events("SpecRejected"), what="the SpecRejected Event")) == 1


def test_a_pending_attempt_says_why_its_pods_do_not_run(cluster, operator_process):
    """Pods never created (Kubeflow's FailedCreate on the job), never scheduled (the scheduler's condition), or
    never started (the kubelet's FailedMount of a missing Secret): each is a condition within a minute, and
    all clear when the attempt runs. The test plays Kubeflow, the scheduler and the kubelet."""
    plane, ns = cluster.plane, cluster.namespace
    plane.kubectl("create", "-f", "-", input=training_run(ns))
    wait_for(lambda: cluster.status().get("phase") == "Pending", what="phase Pending")
    cluster.warning(
        "PyTorchJob",
        "demo-a1",
        "FailedCreate",
        'Error creating: pods "demo-a1-worker-0" is forbidden: exceeded quota: pods',
    )
    condition = wait_for(lambda: cluster.condition("PodsNotCreated"), timeout=60, what="condition PodsNotCreated")
    assert condition["status"] == "True" and "exceeded quota: pods" in condition["message"]

    pod = cluster.worker_pod("demo-a1")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    cluster.patch_status(
        "pod",
        pod,
        {
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/4 nodes are available: 4 Insufficient nvidia.com/gpu.",
                    "lastTransitionTime": now,
                }
            ]
        },
    )
    condition = wait_for(lambda: cluster.condition("Unschedulable"), timeout=60, what="condition Unschedulable")
    assert "Insufficient nvidia.com/gpu" in condition["message"]

    cluster.warning("Pod", pod, "FailedMount", 'MountVolume.SetUp failed for volume "gcs-key" : secret "gcs" not found')
    condition = wait_for(lambda: cluster.condition("SecretMissing"), timeout=60, what="condition SecretMissing")
    assert 'secret "gcs" not found' in condition["message"]
    assert {e["reason"] for e in cluster.events()} >= {"PodsNotCreated", "Unschedulable", "SecretMissing"}

    cluster.patch_status(
        "pod",
        pod,
        {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]},
    )
    cluster.job_condition("demo-a1", "Created", "Running")
    wait_for(lambda: cluster.status().get("phase") == "Running", what="phase Running")
    for type_ in ("PodsNotCreated", "Unschedulable", "SecretMissing"):
        wait_for(lambda type_=type_: cluster.condition(type_)["status"] == "False", what=f"{type_} cleared")


def test_a_job_planted_with_an_owner_reference_to_the_run_is_never_used(cluster, operator_process):
    """Anyone who may create PyTorchJobs in the namespace can copy the run's uid into an owner reference. On main the
    operator took such a job, planted under the next attempt's name, as the run's: used it unchanged, and accepted its
    pods' reports. Now only a job the operator signed is the run's: the run says NameConflict, the job is untouched."""
    plane, ns = cluster.plane, cluster.namespace
    plane.kubectl("create", "-f", "-", input=training_run(ns))
    signature = wait_for(lambda: signature_of(cluster.get(JOBS, "demo-a1")), what="attempt 1's signed PyTorchJob")
    run = cluster.get(RUNS, "demo")
    assert signature.startswith("v2.")  # bound to the job's uid (naming.job_signature)
    planted = pytorchjob.pytorch_job(validation.parse(json.loads(training_run(ns))), 2)
    planted["metadata"]["namespace"] = ns
    planted["metadata"]["ownerReferences"] = [
        {
            "apiVersion": "trainingrun.dev/v1alpha1",
            "kind": "TrainingRun",
            "name": "demo",
            "uid": run["metadata"]["uid"],
            "controller": True,
        }
    ]
    planted["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"] = "evil/image:1"
    plane.kubectl("create", "-f", "-", input=json.dumps(planted))
    before = cluster.get(JOBS, "demo-a2")["metadata"]["resourceVersion"]

    cluster.container_terminated(cluster.worker_pod("demo-a1"), 134, "Error")
    cluster.job_condition("demo-a1", "Created", "Failed")
    condition = wait_for(lambda: cluster.condition("NameConflict"), timeout=60, what="condition NameConflict")
    assert "PyTorchJob demo-a2 already exists and is not controlled by this run" in condition["message"], condition
    assert cluster.get(JOBS, "demo-a2")["metadata"]["resourceVersion"] == before
    cluster.job_condition("demo-a2", "Created", "Running")  # what the planted job's pods would make Kubeflow say
    plane.kubectl("-n", ns, "delete", JOBS, "demo-a2")
    wait_for(lambda: signature_of(cluster.get(JOBS, "demo-a2")), timeout=60, what="the run's own, signed attempt 2")
    assert "evil" not in json.dumps(cluster.get(JOBS, "demo-a2")["spec"])


def signature_of(job):
    return ((job or {}).get("metadata", {}).get("annotations") or {}).get(naming.ANNOTATION_SIGNATURE)


def test_objects_with_the_childrens_names_that_the_run_does_not_own_are_left_alone(cluster, operator_process):
    """A Service and a PyTorchJob (labelled as the run's) that exist before the run, not controlled by it, and
    a ServiceAccount and Role named as earlier versions named a run's: none is changed or gains an owner
    reference (so none goes with the run); the run says NameConflict, naming its two, with one Event. Once
    those are gone, the run creates its own and the condition clears."""
    plane, ns = cluster.plane, cluster.namespace
    labels = {naming.LABEL_RUN: "demo"}
    multi_pod = {"replicas": {"min": 2, "max": 2}}  # a run with a rendezvous Service
    job = pytorchjob.pytorch_job(validation.parse(json.loads(training_run(ns, **multi_pod))), 1)
    del job["metadata"]["ownerReferences"]
    foreign = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "demo-rendezvous", "labels": labels},
            "spec": {"selector": {"app": "someone-else"}, "ports": [{"port": 8080}]},
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "demo-trainer"}},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": {"name": "demo-trainer"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"]}],
        },
        job,
    ]
    for document in foreign:
        document["metadata"]["namespace"] = ns
        plane.kubectl("create", "-f", "-", input=json.dumps(document))
    kinds = [
        ("service", "demo-rendezvous"),
        ("serviceaccount", "demo-trainer"),
        ("role", "demo-trainer"),
        (JOBS, "demo-a1"),
    ]
    before = {kind: cluster.get(kind, name)["metadata"]["resourceVersion"] for kind, name in kinds}

    plane.kubectl("create", "-f", "-", input=training_run(ns, **multi_pod))
    condition = wait_for(lambda: cluster.condition("NameConflict"), timeout=60, what="condition NameConflict")
    assert condition["status"] == "True", condition
    for kind in ("Service demo-rendezvous", "PyTorchJob demo-a1"):
        assert f"{kind} already exists and is not controlled by this run" in condition["message"], condition
    wait_for(lambda: cluster.events("NameConflict"), what="the NameConflict Event")
    for kind, name in kinds:
        now = cluster.get(kind, name)
        assert now["metadata"]["resourceVersion"] == before[kind], f"{kind}/{name} was changed"
        assert not now["metadata"].get("ownerReferences"), f"{kind}/{name} was adopted"
    assert cluster.status().get("phase") != "Running"

    for kind, name in [("service", "demo-rendezvous"), (JOBS, "demo-a1")]:
        plane.kubectl("-n", ns, "delete", kind, name)
    wait_for(
        lambda: (cluster.condition("NameConflict") or {}).get("status") == "False",
        timeout=60,
        what="NameConflict resolved",
    )
    run_uid = cluster.get(RUNS, "demo")["metadata"]["uid"]
    assert cluster.get("service", "demo-rendezvous")["metadata"]["ownerReferences"][0]["uid"] == run_uid
    assert len(cluster.events("NameConflict")) == 1
