"""The report endpoint against a real API server, with real pod-bound ServiceAccount tokens.

The operator runs as its own process with the chart's identity (test_operator_real.py) and serves the
report endpoint over TLS with a certificate this test makes. Tokens come from the API server's
TokenRequest, bound to pods the test creates as Kubeflow would (owned by the attempt's PyTorchJob), so
TokenReview, the pod binding and the audience are the real server's. The test plays the trainer's rank 0.
"""

import datetime
import json
import ssl
import urllib.error
import urllib.request

import pytest
from test_operator_real import (  # noqa: F401 - fixtures
    JOBS,
    RUNS,
    RealCluster,
    cluster,
    operator_kubeconfig,
    rendered_chart,
    running_operator,
    training_run,
    wait_for,
)

from tls_files import certificate
from trainingrun_api import contract, progress_report
from trainingrun_api.progress_report import CommittedCheckpoint, Progress, Report

ACCOUNT = "trainers"  # one ServiceAccount for every run of the namespace, as in examples/workload-identity.yaml


@pytest.fixture
def endpoint(operator_kubeconfig, tmp_path):  # noqa: F811
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    tls = certificate(tmp_path)
    url = f"https://127.0.0.1:{port}{contract.REPORT_PATH}"
    env = {"TRAININGRUN_REPORT_URL": url, "TRAININGRUN_REPORT_PORT": str(port), "TRAININGRUN_REPORT_TLS_DIR": str(tls)}
    env["TRAININGRUN_CORDON_AVOIDED_NODES"] = "true"  # as the chart value sets it; its RBAC is the test's to grant
    for log in running_operator(operator_kubeconfig, tmp_path, **env):
        wait_for(lambda log=log: "report endpoint listening" in log.read_text(), what="the report endpoint")
        yield url, ssl.create_default_context(cafile=str(tls / "ca.crt"))


def post(endpoint, report, token):
    url, context = endpoint
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    request = urllib.request.Request(url, data=report.to_json(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30, context=context) as response:
            return response.status, ""
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())["message"]


def started(cluster, name, **spec):  # noqa: F811
    """A run of ACCOUNT whose attempt 1 runs, and its worker pod: (run uid, pod name, pod uid)."""
    cluster.plane.kubectl(
        "create",
        "-f",
        "-",
        input=training_run(cluster.namespace, **spec).replace('"name": "demo"', f'"name": "{name}"'),
    )
    wait_for(lambda: cluster.get(JOBS, f"{name}-a1"), what=f"{name}'s PyTorchJob")
    cluster.job_condition(f"{name}-a1", "Created", "Running")
    wait_for(lambda: cluster.status(name).get("phase") == "Running", what=f"{name} Running")
    pod = cluster.worker_pod(f"{name}-a1")
    return cluster.get(RUNS, name)["metadata"]["uid"], pod, cluster.get("pod", pod)["metadata"]["uid"]


def report_of(cluster, name, uid, attempt=1, step=5, checkpoint=None, in_memory=None):  # noqa: F811
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Report(
        cluster.namespace,
        name,
        uid,
        attempt,
        progress=Progress(step, now, total_steps=20, loss=2.5),
        last_good_checkpoint=checkpoint,
        checkpoint_in_memory=progress_report.CheckpointInMemory(in_memory, now) if in_memory else None,
    )


def test_only_a_pod_of_the_runs_current_attempt_changes_its_status(cluster, endpoint):  # noqa: F811
    """Two runs share a ServiceAccount: each pod's token reports for its own run only; another run's pod, a
    pod of a previous attempt, a token for another audience or none at all is refused and status does not
    change; a checkpoint outside the run's URI is refused; a fresh token for the same pod (rotation) works."""
    plane, ns = cluster.plane, cluster.namespace
    plane.kubectl("-n", ns, "create", "serviceaccount", ACCOUNT)
    demo_uid, demo_pod, demo_pod_uid = started(cluster, "demo", serviceAccountName=ACCOUNT)
    other_uid, other_pod, other_pod_uid = started(cluster, "other", serviceAccountName=ACCOUNT)
    demo_token = plane.token(ns, ACCOUNT, contract.REPORT_AUDIENCE, pod=(demo_pod, demo_pod_uid))
    other_token = plane.token(ns, ACCOUNT, contract.REPORT_AUDIENCE, pod=(other_pod, other_pod_uid))

    checkpoint = CommittedCheckpoint("s3://bucket/demo/step-00000004", 4, "2026-11-24T00:00:00Z")
    assert (
        post(endpoint, report_of(cluster, "demo", demo_uid, checkpoint=checkpoint, in_memory=5), demo_token)[0] == 200
    )
    status = wait_for(lambda: cluster.status("demo").get("progress") and cluster.status("demo"), what="progress")
    assert status["progress"]["step"] == 5 and status["lastGoodCheckpoint"]["uri"] == checkpoint.uri
    assert status["checkpointInMemory"]["step"] == 5  # the CRD's status schema keeps it (a server prunes what it lacks)
    assert status["progress"]["percent"] == 25.0  # the operator's, from totalSteps
    columns = plane.kubectl("-n", ns, "get", "trainingruns", "demo", "--no-headers").stdout.split()
    assert columns[2:4] == ["5", "25"], columns  # Step, then the Progress column (percent)
    assert status["lastReportTime"]

    refused = {
        "another run's pod": (report_of(cluster, "other", other_uid, step=99), demo_token),
        "for another run": (report_of(cluster, "demo", demo_uid, step=99), other_token),
        "another audience": (
            report_of(cluster, "demo", demo_uid, step=99),
            plane.token(ns, ACCOUNT, pod=(demo_pod, demo_pod_uid)),
        ),
        "not bound to a pod": (
            report_of(cluster, "demo", demo_uid, step=99),
            plane.token(ns, ACCOUNT, contract.REPORT_AUDIENCE),
        ),
        "no token": (report_of(cluster, "demo", demo_uid, step=99), None),
        "a checkpoint elsewhere": (
            report_of(
                cluster,
                "demo",
                demo_uid,
                step=99,
                checkpoint=CommittedCheckpoint("s3://attacker/x/step-00000100", 100, "2026-11-24T00:00:00Z"),
            ),
            demo_token,
        ),
    }
    for what, (report, token) in refused.items():
        code, message = post(endpoint, report, token)
        assert code in (401, 403), (what, code, message)
    assert (cluster.status("other").get("progress") or {}).get("step") is None
    assert cluster.status("demo")["progress"]["step"] == 5
    assert cluster.status("demo")["lastGoodCheckpoint"]["uri"] == checkpoint.uri

    rotated = plane.token(ns, ACCOUNT, contract.REPORT_AUDIENCE, pod=(demo_pod, demo_pod_uid))
    assert rotated != demo_token
    step_6 = CommittedCheckpoint("s3://bucket/demo/step-00000006", 6, "2026-11-24T00:00:01Z")  # news: written now
    assert post(endpoint, report_of(cluster, "demo", demo_uid, step=6, checkpoint=step_6), rotated)[0] == 200
    wait_for(lambda: cluster.status("demo")["progress"]["step"] == 6, what="step 6")

    # attempt 1 fails; its pod, still there, may not report for attempt 2
    cluster.container_terminated(demo_pod, 134, "Error")
    cluster.job_condition("demo-a1", "Created", "Failed")
    wait_for(lambda: cluster.status("demo").get("attempt") == 2, what="attempt 2")
    for attempt in (1, 2):
        code, _ = post(endpoint, report_of(cluster, "demo", demo_uid, attempt=attempt, step=99), rotated)
        assert code == 403, attempt
    assert cluster.status("demo")["progress"]["step"] == 6


def test_no_reports_is_a_condition_and_reports_without_progress_are_a_stall(cluster, endpoint):  # noqa: F811
    plane, ns = cluster.plane, cluster.namespace
    plane.kubectl("-n", ns, "create", "serviceaccount", ACCOUNT)
    uid, pod, pod_uid = started(
        cluster, "demo", serviceAccountName=ACCOUNT, recovery={"stallTimeoutSeconds": 3, "backoffSeconds": 0}
    )
    condition = wait_for(
        lambda: (
            (cluster.condition("ReportingUnavailable") or {}).get("status") == "True"
            and cluster.condition("ReportingUnavailable")
        ),
        what="ReportingUnavailable",
    )
    assert "stallTimeoutSeconds=3s" in condition["message"]
    assert cluster.get(JOBS, "demo-a2") is None and cluster.status()["attempt"] == 1
    wait_for(lambda: cluster.events("ReportingUnavailable"), what="the Event")

    # rank 0 reports again, but its last step finished long ago: a stall, restarted
    token = plane.token(ns, ACCOUNT, contract.REPORT_AUDIENCE, pod=(pod, pod_uid))
    stale = Report(ns, "demo", uid, 1, progress=Progress(7, "2026-11-24T00:00:00Z"))
    assert post(endpoint, stale, token)[0] == 200
    wait_for(lambda: cluster.get(JOBS, "demo-a2"), what="attempt 2 after the stall")
    status = cluster.status()
    assert status["restarts"]["failures"] == 1
    assert cluster.condition("ReportingUnavailable")["status"] == "False"
    assert cluster.events("Stalled")


def test_the_operator_keeps_the_processes_account_of_time_and_the_breakdown_in_status(cluster, endpoint):  # noqa: F811
    """Rank 0's process reports its clocks; a restarted process reports its own: status keeps the first one's last
    report as ended, and the breakdown of the run's wall time, whose parts add up to it (and survive the real
    server's pruning: the CRD has their schema)."""
    plane, ns = cluster.plane, cluster.namespace
    plane.kubectl("-n", ns, "create", "serviceaccount", ACCOUNT)
    uid, pod, pod_uid = started(cluster, "timed", serviceAccountName=ACCOUNT)
    token = plane.token(ns, ACCOUNT, contract.REPORT_AUDIENCE, pod=(pod, pod_uid))

    def timed(step, times):
        report = report_of(cluster, "timed", uid, step=step)
        report.progress.productive_seconds = times.restored_productive_seconds + times.compute_seconds - 1.0
        report.process_time = times
        return report

    first = progress_report.ProcessTime("timed-a1-worker-0/41/1", 20.0, 4.0, 0.0, 1.0, 0.5, 12.0, 0.0, 0.0)
    interval = progress_report.IntervalChoice(
        steps=40,
        seconds=2.0,
        save_cost_seconds=0.06,
        seconds_between_failures=28.5,
        failures=1,
        expected_lost_seconds=1.0,
    )
    report = timed(5, first)
    report.checkpoint_interval = interval  # checkpoint.interval.steps: auto
    assert post(endpoint, report, token)[0] == 200
    wait_for(lambda: (cluster.status("timed").get("processTime") or {}).get("current"), what="the process's time")
    second = progress_report.ProcessTime("timed-a1-worker-0/97/2", 10.0, 3.0, 0.5, 0.5, 0.25, 5.0, 0.0, 11.0)
    assert post(endpoint, timed(9, second), token)[0] == 200
    status = wait_for(
        lambda: (cluster.status("timed").get("progress") or {}).get("step") == 9 and cluster.status("timed"),
        what="step 9",
    )
    assert status["processTime"]["ended"] == {**first.to_wire(), "process": "ended"}
    assert status["checkpointInterval"] == interval.to_wire()  # kept by the server: the CRD has its schema
    assert status["processTime"]["current"] == second.to_wire()
    parts = status["timeBreakdown"]
    wall = parts.pop("wallSeconds")
    assert wall > 0 and sum(parts.values()) == pytest.approx(wall, abs=0.01)
    # 17 s of compute in both, 15 kept (second resumed at 11 and reached 15): 2 lost
    assert (parts["productiveSeconds"], parts["lostSeconds"]) == (pytest.approx(4.0 + 11.0), pytest.approx(2.0))
    assert parts["restoreSeconds"] == 0.5 and parts["checkpointSeconds"] == 1.5 and parts["dataWaitSeconds"] == 0.75


def test_a_straggler_and_a_node_hung_on_twice_reach_status_and_the_next_attempt_keeps_off_that_node(  # noqa: F811
    cluster, endpoint
):
    """A straggler rank 0 names is condition SlowRank; two hangs in a row naming one node end the attempt, and the
    next attempt's pods carry a node affinity that keeps them off it (the real server keeps the new status fields:
    the CRD has their schema)."""
    plane, ns = cluster.plane, cluster.namespace
    plane.kubectl("-n", ns, "create", "serviceaccount", ACCOUNT)
    uid, pod, pod_uid = started(cluster, "shaky", serviceAccountName=ACCOUNT)
    token = plane.token(ns, ACCOUNT, contract.REPORT_AUDIENCE, pod=(pod, pod_uid))

    report = report_of(cluster, "shaky", uid, step=5)
    report.slow_rank = progress_report.SlowRank(
        rank=1, pod="shaky-a1-worker-1", node="node-b", ratio=2.5, seconds=0.5, median_seconds=0.2, factor=1.5, step=3
    )
    assert post(endpoint, report, token)[0] == 200
    status = wait_for(
        lambda: (
            any(c["type"] == "SlowRank" for c in cluster.status("shaky").get("conditions") or [])
            and cluster.status("shaky")
        ),
        what="condition SlowRank",
    )
    assert status["slowRank"] == report.slow_rank.to_wire()
    slow = next(c for c in status["conditions"] if c["type"] == "SlowRank")
    assert slow["status"] == "True" and "rank 1 (pod shaky-a1-worker-1, node node-b) takes 2.5x" in slow["message"]

    plane.kubectl(
        "create", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-b"}})
    )
    binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod, "namespace": ns},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "node-b"}}  # fmt: skip
    plane.kubectl("create", "-f", "-", input=json.dumps(binding))  # the pod runs there, as a scheduler would bind it
    wait_for(lambda: cluster.get("pod", pod)["spec"].get("nodeName") == "node-b", what="the pod on node-b")
    discovery = chart_cluster_role("operator.cordonAvoidedNodes=true")  # what the chart grants with the value on
    plane.apply([discovery])
    for seconds in ("00", "40"):  # one hang, looked at, then another naming the same node
        hang = progress_report.Hang(
            step=5, time=f"2026-12-06T12:00:{seconds}Z", diagnosis="hang after step 5: ...", ranks=[1], nodes=["node-b"]
        )
        assert post(endpoint, Report(ns, "shaky", uid, 1, last_hang=hang), token)[0] == 200
        wait_for(
            lambda hang=hang: (cluster.status("shaky").get("hangNodes") or {}).get("time") == hang.time,
            what="the operator looking at the hang",
        )
    status = wait_for(lambda: cluster.status("shaky").get("attempt") == 2 and cluster.status("shaky"), what="attempt 2")
    assert status["avoidedNodes"] == ["node-b"] and status["restarts"]["failures"] == 1
    job = wait_for(lambda: cluster.get(JOBS, "shaky-a2"), what="attempt 2's PyTorchJob")
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    terms = template["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["node-b"]}]}]
    try:
        node = wait_for(
            lambda: cluster.get("node", "node-b")["spec"].get("unschedulable") and cluster.get("node", "node-b")
        )
        # cordoned, nothing more: the only taint is the one Kubernetes' node controller gives an unschedulable node
        assert {t["key"] for t in node["spec"].get("taints") or []} <= {"node.kubernetes.io/unschedulable"}
        reasons = plane.kubectl("-n", ns, "get", "events", "-o", "jsonpath={.items[*].reason}").stdout.split()
        assert {"AvoidingNode", "SlowRank", "NodeCordoned"} <= set(reasons)
    finally:
        plane.apply([chart_cluster_role()])  # the chart's default again: no access to nodes
        plane.kubectl("delete", "node", "node-b", check=False)


def chart_cluster_role(*values):
    """The chart's cluster-wide role (discovery, TokenReviews; with operator.cordonAvoidedNodes, patch on nodes)."""
    return next(
        d
        for d in rendered_chart(*(f"--set={value}" for value in values))
        if d["kind"] == "ClusterRole" and d["metadata"]["name"].endswith("-discovery")
    )
