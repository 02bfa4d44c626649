"""An attempt as a JobSet (`jobset.py`) on a real API server with the real JobSet controller v0.9.1 and its webhooks
(tests/jobset_controller.py) and the real Job controller and garbage collector (kube-controller-manager): what the
pods of a JobSet attempt are made of is what the rendezvous needs, and the run owns all of it.

No kubelet runs in this tier, so the pods stay Pending: what they do once running is the e2e tier's.
"""

import json
import time

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
