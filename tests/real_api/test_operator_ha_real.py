"""Several operator replicas (the chart's `replicaCount` > 1) against a real API server: one acts, the others
stand by, and a standby takes over when the one acting goes.

Each replica runs as its own process with the identity the chart gives it (ci/ha-values.yaml: kopf peering
through a ClusterKopfPeering, its RBAC rule included), serving the report endpoint and publishing itself in
the report Service's EndpointSlice while it acts, with a made-up pod IP each.
"""

import contextlib
import json
import socket

import pytest
from test_operator_real import JOBS, RealCluster, rendered_chart, running_operator, training_run, wait_for

from conftest import REPO
from tls_files import certificate
from trainingrun_api import contract
from trainingrun_operator import serving

RELEASE, RELEASE_NAMESPACE = "tr-ha", "trainingrun-ha"
PEERING_CRDS = REPO / "charts/trainingrun-operator/crds/kopf-peering.yaml"


@pytest.fixture(scope="module")
def ha_kubeconfig(kube_cluster_with_crds, tmp_path_factory):
    plane = kube_cluster_with_crds
    plane.kubectl("apply", "--server-side", "-f", str(PEERING_CRDS))
    plane.wait_established("clusterkopfpeerings.kopf.dev")
    ha_values = REPO / "charts/trainingrun-operator/ci/ha-values.yaml"
    rendered = rendered_chart("-f", str(ha_values), release=RELEASE, namespace=RELEASE_NAMESPACE)
    documents = [d for d in rendered if d["kind"] != "Deployment"]
    deployment = next(d for d in rendered if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    peering = next(a.split("=", 1)[1] for a in container["args"] if a.startswith("--peering="))
    report_service = next(e["value"] for e in container["env"] if e["name"] == "TRAININGRUN_REPORT_SERVICE")
    plane.kubectl("create", "namespace", RELEASE_NAMESPACE, check=False)
    plane.apply(documents)
    account = next(d for d in documents if d["kind"] == "ServiceAccount")["metadata"]["name"]
    token = plane.token(RELEASE_NAMESPACE, account)
    return plane.token_kubeconfig(tmp_path_factory.mktemp("operator-ha") / "kubeconfig", token), peering, report_service


def replica_env(tls_dir, peering, report_service, pod_ip):
    """What the chart's Deployment gives a replica (the same report certificate: one Secret mounted in every replica,
    whose key also signs the replicas' jobs), with its own report port (both run on this machine)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "TRAININGRUN_PEERING": peering,
        "TRAININGRUN_REPORT_URL": f"https://127.0.0.1:{port}{contract.REPORT_PATH}",
        "TRAININGRUN_REPORT_PORT": str(port),
        "TRAININGRUN_REPORT_TLS_DIR": str(tls_dir),
        "TRAININGRUN_REPORT_SERVICE": report_service,
        "TRAININGRUN_OPERATOR_POD_IP": pod_ip,
        "TRAININGRUN_OPERATOR_POD_NAME": f"operator-{pod_ip}",
    }


def test_one_replica_acts_and_a_standby_takes_over(kube_cluster_with_crds, kube_namespace, ha_kubeconfig, tmp_path):
    kubeconfig, peering, report_service = ha_kubeconfig
    cluster = RealCluster(kube_cluster_with_crds, kube_namespace)
    slice_namespace, service_name = report_service.split("/")
    slice_name = service_name + serving.ENDPOINT_SLICE_SUFFIX

    def report_addresses():
        """The slice's addresses; none while it does not exist (the replica that acts makes it)."""
        found = cluster.plane.kubectl(
            "-n", slice_namespace, "get", "endpointslice", slice_name, "-o", "json", check=False
        )
        if found.returncode != 0:
            assert "NotFound" in found.stderr, found.stderr
            return []
        slice_ = json.loads(found.stdout)
        assert [o["name"] for o in slice_["metadata"]["ownerReferences"]] == [service_name]
        return [a for e in slice_.get("endpoints") or [] for a in e["addresses"]]

    (tmp_path / "first").mkdir(), (tmp_path / "second").mkdir(), (tmp_path / "tls").mkdir()
    tls = certificate(tmp_path / "tls")
    with contextlib.ExitStack() as replicas:  # a failed check must not leave a replica acting in later tests
        first = running_operator(
            kubeconfig, tmp_path / "first", **replica_env(tls, peering, report_service, "10.244.7.1")
        )
        second = running_operator(
            kubeconfig, tmp_path / "second", **replica_env(tls, peering, report_service, "10.244.7.2")
        )
        replicas.callback(second.close)
        replicas.callback(first.close)
        first_log = next(first)
        wait_for(
            lambda: "acting: no replica started earlier" in first_log.read_text(),
            timeout=30,
            what="the first replica to act",
        )
        second_log = next(second)
        wait_for(lambda: "standing by" in second_log.read_text(), timeout=30, what="the second replica to stand by")
        # Reports go to the replica that acts, and only to it: the standby wrote nothing.
        wait_for(lambda: report_addresses() == ["10.244.7.1"], what="the report Service to route to the first")
        assert "reports reach this replica" not in second_log.read_text()

        cluster.plane.kubectl("create", "-f", "-", input=training_run(kube_namespace))
        wait_for(lambda: cluster.get(JOBS, "demo-a1"), what="attempt 1's PyTorchJob")
        wait_for(lambda: cluster.status().get("phase") == "Pending", what="phase Pending")
        assert f"{kube_namespace}/demo" in first_log.read_text()
        assert f"{kube_namespace}/demo" not in second_log.read_text()  # the standby did nothing with it

        first.close()  # the acting replica stops (as in a rolling update or a drained node)
        wait_for(
            lambda: "acting: no replica started earlier" in second_log.read_text(),
            timeout=60,
            what="the standby to take over",
        )
        wait_for(lambda: report_addresses() == ["10.244.7.2"], what="the report Service to route to the second")
        # The pod's exit code is the failure's evidence: without it the operator waits FAILURE_EVIDENCE_GRACE
        # (30 s) for the pods' story before it starts the next attempt.
        cluster.container_terminated(cluster.worker_pod("demo-a1"), 134, "Error")
        cluster.job_condition("demo-a1", "Created", "Failed")
        wait_for(lambda: cluster.get(JOBS, "demo-a2"), what="attempt 2, started by the replica that took over")
        status = wait_for(lambda: cluster.status().get("attempt") == 2 and cluster.status())
        assert status["restarts"]["failures"] == 1
        assert f"{kube_namespace}/demo" in second_log.read_text()
