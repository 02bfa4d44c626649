"""An attempt as a JobSet (`jobset.py`) on a real API server with the real JobSet controller v0.9.1 and its webhooks
(tests/jobset_controller.py) and the real Job controller and garbage collector (kube-controller-manager): what the
pods of a JobSet attempt are made of is what the rendezvous needs, and the run owns all of it.

No kubelet runs in this tier, so the pods stay Pending: what they do once running is the e2e tier's.
"""

import json
import time

from test_operator_real import JOBS, RUNS, RealCluster, operator_kubeconfig, running_operator, training_run  # noqa: F401

from trainingrun_api import contract
from trainingrun_operator import jobset, naming, validation


def wait_for(check, timeout=60.0, what=""):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)
    return result


def items(plane, namespace, kind, selector):
    answer = plane.kubectl("-n", namespace, "get", kind, "-l", selector, "-o", "json")
    return json.loads(answer.stdout)["items"]


def run_body(name, namespace, replicas):
    return {
        "apiVersion": "trainingrun.dev/v1alpha1",
        "kind": "TrainingRun",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"checkpoint": {"uri": "s3://bucket/runs/x"}, "replicas": {"min": 1, "max": replicas}},
    }


def test_the_longest_run_name_at_a_late_attempt_makes_a_jobset_the_webhooks_take(
    kube_cluster_with_crds, jobset_controller, kube_namespace
):
    """Run names stop at 40 characters so a PyTorchJob's pods fit in 63; a JobSet's hostnames are 2 longer
    (`<run>-a<attempt>-worker-0-<index>`) and its webhook checks the names its Jobs and pods get."""
    body = run_body("a" * 40, kube_namespace, replicas=4)
    body["metadata"]["uid"] = "3f1c2a9e-0000-4000-8000-000000000001"
    attempt = jobset.jobset(validation.parse(body), attempt=9999)
    attempt["metadata"].pop("ownerReferences")  # no such run: a dry run
    code, answer = kube_cluster_with_crds.request(
        "POST", f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{kube_namespace}/jobsets?dryRun=All", attempt
    )
    assert code == 201, answer.get("message")


def test_a_jobset_attempts_pods_have_the_hostnames_and_labels_the_rendezvous_needs_and_the_run_owns_them(
    kube_cluster_with_crds, jobset_controller, kube_namespace
):
    plane = kube_cluster_with_crds
    plane.apply([run_body("demo", kube_namespace, replicas=2)])
    stored = json.loads(
        plane.kubectl("-n", kube_namespace, "get", "trainingruns.trainingrun.dev", "demo", "-o", "json").stdout
    )
    run = validation.parse({**stored, "status": None})
    service, attempt = jobset.children(run, attempt=1)
    plane.apply([service, attempt])

    run_label = f"{naming.LABEL_RUN}=demo"
    pods = wait_for(
        lambda: len(found := items(plane, kube_namespace, "pods", run_label)) == 2 and found,
        what="the Job controller to make the 2 pods of the JobSet's Job (admitted by JobSet's pod webhooks)",
    )
    hostnames = sorted(p["spec"]["hostname"] for p in pods)
    assert hostnames == [jobset.worker_hostname("demo", 1, i) for i in range(2)]
    assert {p["spec"]["subdomain"] for p in pods} == {"demo-a1"}  # the JobSet's headless Service
    wait_for(lambda: plane.kubectl("-n", kube_namespace, "get", "service", "demo-a1", check=False).returncode == 0,
             what="the JobSet's headless Service")  # fmt: skip
    # The rendezvous Service selects worker 0 of the attempt, and that pod knows it is the host.
    selector = ",".join(f"{k}={v}" for k, v in service["spec"]["selector"].items())
    (host,) = items(plane, kube_namespace, "pods", selector)
    assert host["spec"]["hostname"] == jobset.worker_hostname("demo", 1, 0)
    env = {e["name"]: e.get("value") for e in host["spec"]["containers"][0]["env"]}
    assert env[contract.RENDEZVOUS_HOST_POD] == host["spec"]["hostname"] != host["metadata"]["name"]
    assert env["PET_RDZV_ENDPOINT"] == f"demo-rendezvous:{contract.RENDEZVOUS_PORT}"

    # The run owns the JobSet and the Service; JobSet's controller owns the Job, the Job its pods: deleting the
    # run removes everything (the garbage collector, as for a PyTorchJob).
    plane.kubectl("-n", kube_namespace, "delete", "trainingruns.trainingrun.dev", "demo", "--wait=false")
    wait_for(
        lambda: not any(items(plane, kube_namespace, kind, run_label) for kind in ("jobsets.jobset.x-k8s.io", "jobs", "pods", "services")),
        what="the garbage collector to remove the run's JobSet, Job, pods and Services",
    )  # fmt: skip


# ---------------------------------------------------------------- the operator running a JobSet attempt

JOBSETS = "jobsets.jobset.x-k8s.io"


def pods_of(cluster, attempt):
    found = items(cluster.plane, cluster.namespace, "pods", f"{naming.LABEL_RUN}=demo,{naming.LABEL_ATTEMPT}={attempt}")
    return sorted((p for p in found if not p["metadata"].get("deletionTimestamp")), key=lambda p: p["metadata"]["name"])


def pod_phase(cluster, pod, phase, exit_code=None):
    """The kubelet's word on a pod (no kubelet runs in this tier): its phase, and its trainer's exit code."""
    status = {"phase": phase}
    if exit_code is not None:
        now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        terminated = {"exitCode": exit_code, "reason": "Error", "startedAt": now, "finishedAt": now}
        status["containerStatuses"] = [
            {"name": naming.CONTAINER_NAME, "image": "trainer", "imageID": "", "ready": False, "restartCount": 0,
             "state": {"terminated": terminated}}
        ]  # fmt: skip
    cluster.patch_status("pod", pod["metadata"]["name"], status)


def test_the_operator_runs_an_attempt_as_a_jobset_with_the_charts_identity(
    kube_cluster_with_crds, jobset_controller, kube_namespace, operator_kubeconfig, tmp_path
):
    """spec.backend JobSet, on a real API server with the real JobSet, Job and garbage collector controllers and
    the operator as the chart installs it (its RBAC): the attempt is a JobSet the run owns; a pod that fails
    retryably is replaced by the Job and counted in place; the Job failing again ends the attempt (JobSet's own
    restarts off) and the operator starts the next one from the last checkpoint; pods succeeding end the run."""
    cluster = RealCluster(kube_cluster_with_crds, kube_namespace)
    plane = cluster.plane
    operator = running_operator(operator_kubeconfig, tmp_path)
    next(operator)
    try:
        body = json.loads(training_run(kube_namespace, replicas={"min": 2, "max": 2}, backend="JobSet"))
        body["spec"]["recovery"]["maxRestartsPerAttempt"] = 1
        plane.kubectl("create", "-f", "-", input=json.dumps(body))
        run = cluster.get(RUNS, "demo")
        attempt = wait_for(lambda: cluster.get(JOBSETS, "demo-a1"), what="attempt 1's JobSet")
        assert attempt["metadata"]["ownerReferences"][0]["uid"] == run["metadata"]["uid"]
        assert naming.ANNOTATION_SIGNATURE in attempt["metadata"]["annotations"]  # signed, as a PyTorchJob is
        status = wait_for(lambda: cluster.status().get("jobName") and cluster.status())
        assert (status["backend"], status["phase"]) == ("JobSet", "Pending")
        assert cluster.get(JOBS, "demo-a1") is None

        pods = wait_for(lambda: len(found := pods_of(cluster, 1)) == 2 and found, what="the Job's 2 pods")
        for pod in pods:  # what the report endpoint's NetworkPolicy selects them by (the chart)
            assert {"jobset.sigs.k8s.io/jobset-name", "batch.kubernetes.io/job-completion-index"} <= set(
                pod["metadata"]["labels"]
            )
            pod_phase(cluster, pod, "Running")
        wait_for(lambda: cluster.status().get("phase") == "Running", what="phase Running")
        checkpoint = {"uri": "s3://bucket/demo/step-00000300", "step": 300, "time": "2026-12-06T00:00:00Z"}
        cluster.patch_status(RUNS, "demo", {"lastGoodCheckpoint": checkpoint})

        pod_phase(cluster, pods[1], "Failed", exit_code=134)  # SIGABRT: retryable, the Job replaces the pod
        restarts = wait_for(
            lambda: (cluster.status().get("restarts") or {}).get("inPlace") == 1 and cluster.status()["restarts"],
            what="the replaced pod counted in place",
        )
        assert restarts["attemptPodsFailed"] == 1 and restarts["total"] == 0
        wait_for(lambda: cluster.events("PodsRestarted"), what="the PodsRestarted Event")
        assert cluster.status()["attempt"] == 1

        replacement = wait_for(
            lambda: next((p for p in pods_of(cluster, 1) if p["metadata"]["name"] not in {q["metadata"]["name"] for q in pods}), None),
            what="the Job's replacement pod",
        )  # fmt: skip
        pod_phase(cluster, replacement, "Failed", exit_code=134)  # past maxRestartsPerAttempt: the Job fails
        attempt_2 = wait_for(lambda: cluster.get(JOBSETS, "demo-a2"), timeout=60, what="attempt 2's JobSet")
        failed = cluster.get(JOBSETS, "demo-a1")
        assert (failed["status"].get("restarts") or 0) == 0  # JobSet restarted nothing itself
        env = {
            e["name"]: e.get("value")
            for e in attempt_2["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]
        }  # fmt: skip
        assert env["TRAININGRUN_RESUME_FROM"] == checkpoint["uri"]
        status = wait_for(lambda: cluster.status().get("attempt") == 2 and cluster.status())
        assert status["restarts"]["failures"] == 1 and "attemptPodsFailed" not in status["restarts"]
        assert status["restarts"]["inPlace"] == 1  # the failing Job's last pods were not replaced: none counted

        pods = wait_for(lambda: len(found := pods_of(cluster, 2)) == 2 and found, what="attempt 2's pods")
        for pod in pods:
            pod_phase(cluster, pod, "Succeeded", exit_code=0)
        wait_for(lambda: cluster.status().get("phase") == "Succeeded", timeout=60, what="the run to succeed")
    finally:
        operator.close()
