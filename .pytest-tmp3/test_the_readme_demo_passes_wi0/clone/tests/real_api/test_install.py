"""The install path on a real API server: the README's commands, run as a user would run them.

`kubectl apply --server-side` of the CRDs and the plain manifests, `kubectl explain`, and `helm install`
of the chart with every ci/ values file, with Helm 4 and Helm 3. A real API server checks what no
offline tool did: every CRD default against the schema's own CEL rules, CEL cost budgets, strict
decoding, and RBAC objects as the RBAC API stores them.
"""

import json
import subprocess
import time
import uuid

import pytest
import yaml

from conftest import REPO

CHART = REPO / "charts" / "trainingrun-operator"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
HELMS = {"helm4": REPO / ".tools/bin/helm", "helm3": REPO / ".tools/bin/helm3"}

# The Prometheus Operator's CRDs cannot be downloaded here (no registry ships them), so the monitoring
# scenario installs stand-ins that accept any spec: they prove the chart's objects are of kinds and
# versions the Prometheus Operator serves; their content is checked by promtool in test_monitoring.py.
PROMETHEUS_OPERATOR_KINDS = {
    "PodMonitor": "podmonitors",
    "ServiceMonitor": "servicemonitors",
    "PrometheusRule": "prometheusrules",
}


def stand_in_crd(kind: str, plural: str) -> dict:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {
            "group": "monitoring.coreos.com",
            "scope": "Namespaced",
            "names": {"kind": kind, "plural": plural, "listKind": f"{kind}List", "singular": kind.lower()},
            "versions": [
                {
                    "name": "v1",
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                }
            ],
        },
    }


def test_crds_install_server_side_and_explain_answers(kube_cluster_with_crds):
    plane = kube_cluster_with_crds
    stored = yaml.safe_load(plane.kubectl("get", "crd", "trainingruns.trainingrun.dev", "-o", "yaml").stdout)
    conditions = {c["type"]: c["status"] for c in stored["status"]["conditions"]}
    assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True"
    # Established comes before the API server publishes the kind's discovery and OpenAPI (seen in CI:
    # "couldn't find resource"): a user running explain right after apply waits the same way.
    deadline = time.monotonic() + 60
    while (result := plane.kubectl("explain", "trainingrun.spec.recovery", check=False)).returncode != 0:
        assert time.monotonic() < deadline, result.stderr
        time.sleep(0.5)
    explained = result.stdout
    assert "backoffSeconds" in explained and "maxBackoffSeconds" in explained and "Restart budgets" in explained
    # Re-applying the committed files is a no-op, as `helm upgrade` and GitOps tools do it.
    again = plane.kubectl("apply", "--server-side", "-f", str(REPO / "manifests" / "crds")).stdout
    assert "trainingruns.trainingrun.dev serverside-applied" in again


def test_the_api_server_fills_in_the_models_defaults(kube_cluster_with_crds, kube_namespace, minimal_body, tmp_path):
    """What the server stores for the smallest document is what the model assumes, field by field; and
    `kubectl get -o yaml` output validates (kubectl writes 1e-08, which YAML 1.1 reads as a string)."""
    from trainingrun_operator import validation

    plane = kube_cluster_with_crds
    minimal_body["metadata"] = {"name": "defaults"}
    plane.kubectl("-n", kube_namespace, "create", "-f", "-", input=yaml.safe_dump(minimal_body))
    exported = tmp_path / "exported.yaml"
    exported.write_text(plane.kubectl("-n", kube_namespace, "get", "tr", "defaults", "-o", "yaml").stdout)
    [stored] = validation.load_file(str(exported))
    model = validation.parse(minimal_body).spec
    assert validation.parse({**minimal_body, "spec": stored["spec"]}).spec == model
    assert_within(stored["spec"], model.to_wire(), "spec")
    assert stored["spec"]["recovery"]["maxBackoffSeconds"] == model.recovery.max_backoff_seconds  # not vacuous


def assert_within(stored, model, path):
    """Every value the server filled in is the model's value (the model also has defaults the CRD leaves out:
    required-field objects such as trainer.model, and lists)."""
    if isinstance(stored, dict):
        for key, value in stored.items():
            assert key in model, f"{path}.{key}: the server defaults a field the model does not have"
            assert_within(value, model[key], f"{path}.{key}")
    else:
        assert stored == model, f"{path}: server {stored!r} != model {model!r}"


def test_plain_manifests_apply_server_side(kube_cluster_with_crds):
    plane = kube_cluster_with_crds
    result = plane.kubectl(
        "apply", "--server-side", "-f", str(REPO / "manifests" / "crds"), "-f", str(REPO / "manifests" / "operator")
    )
    assert "deployment.apps/trainingrun-trainingrun-operator serverside-applied" in result.stdout
    assert "clusterrole.rbac.authorization.k8s.io/trainingrun-trainingrun-operator serverside-applied" in result.stdout
    plane.kubectl("delete", "-f", str(REPO / "manifests" / "operator"), "--wait=false")


@pytest.mark.parametrize("helm", sorted(HELMS), ids=str)
@pytest.mark.parametrize("values_file", CI_VALUES, ids=lambda p: p.name)
def test_helm_install_every_scenario(kube_cluster_with_crds, tmp_path, helm, values_file):
    plane = kube_cluster_with_crds
    binary = HELMS[helm]
    assert binary.exists(), f"{binary} missing: run scripts/install-helm.sh"
    values = yaml.safe_load(values_file.read_text()) or {}
    for namespace in values.get("watchNamespaces", []):
        plane.kubectl("create", "namespace", namespace, check=False)  # already there from another scenario is fine
    if values.get("monitoring"):
        plane.apply([stand_in_crd(kind, plural) for kind, plural in PROMETHEUS_OPERATOR_KINDS.items()])
        for plural in PROMETHEUS_OPERATOR_KINDS.values():
            plane.wait_established(f"{plural}.monitoring.coreos.com")
    release, namespace = f"tr-{uuid.uuid4().hex[:6]}", f"trainingrun-{uuid.uuid4().hex[:6]}"
    env = {"KUBECONFIG": str(plane.admin_kubeconfig), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"}
    install = subprocess.run(
        [
            str(binary),
            "install",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "--create-namespace",
            "-f",
            str(values_file),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    deployment = yaml.safe_load(plane.kubectl("-n", namespace, "get", "deployment", "-o", "yaml").stdout)["items"]
    assert [d["metadata"]["name"] for d in deployment] == [f"{release}-trainingrun-operator"]
    # The operator's identity can do what the operator does (the RBAC API accepted and resolves the rules).
    identity = f"system:serviceaccount:{namespace}:{release}-trainingrun-operator"
    watched = values.get("watchNamespaces") or ["default"]
    can = plane.kubectl(
        "auth", "can-i", "create", "pytorchjobs.kubeflow.org", "-n", watched[0], f"--as={identity}", check=False
    )
    assert can.stdout.strip() == "yes", can.stdout + can.stderr
    cannot = plane.kubectl("auth", "can-i", "get", "secrets", "-n", watched[0], f"--as={identity}", check=False)
    assert cannot.stdout.strip() == "no"
    # The replica that acts makes the report Service's EndpointSlice, owned by the Service, with server-side apply
    # as the operator's identity (the Role names that one slice: create works by name too); an upgrade keeps it.
    from trainingrun_operator import serving
    from trainingrun_operator.settings import Settings

    report_service = json.loads(
        plane.kubectl(
            "-n",
            namespace,
            "get",
            "service",
            f"{release}-trainingrun-operator-report",
            "-o",
            "json",
            f"--as={identity}",
        ).stdout
    )
    settings = Settings(
        report_service=f"{namespace}/{report_service['metadata']['name']}",
        pod_ip="10.244.0.9",
        report_port=report_service["spec"]["ports"][0]["targetPort"],
    )
    endpoint_slice = serving.report_endpoint_slice(settings, report_service)
    name = endpoint_slice["metadata"]["name"]
    plane.kubectl(
        "apply",
        "--server-side",
        "--field-manager=trainingrun-operator",
        "--force-conflicts",
        "-f",
        "-",
        f"--as={identity}",
        input=json.dumps(endpoint_slice),
    )
    upgrade = subprocess.run(
        [
            str(binary),
            "upgrade",
            release,
            str(CHART),
            "--namespace",
            namespace,
            "-f",
            str(values_file),
            "--set",
            "report.tokenCacheSeconds=30",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert upgrade.returncode == 0, upgrade.stdout + upgrade.stderr
    kept = plane.kubectl("-n", namespace, "get", "endpointslice", name, "-o", "json").stdout
    assert json.loads(kept)["endpoints"] == endpoint_slice["endpoints"]
    for verb, what in (("patch", "endpointslices"), ("create", "endpointslices/other"), ("get", "services/other")):
        other = plane.kubectl("auth", "can-i", verb, what, "-n", namespace, f"--as={identity}", check=False)
        assert other.stdout.strip() == "no", (verb, what)  # that one slice and that one Service only
    uninstall = subprocess.run(
        [str(binary), "uninstall", release, "--namespace", namespace, "--wait"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert uninstall.returncode == 0, uninstall.stdout + uninstall.stderr
    # The slice goes with its Service (the garbage collector), though Helm never knew it.
    deadline = time.monotonic() + 60
    while plane.kubectl("-n", namespace, "get", "endpointslice", name, check=False).returncode == 0:
        assert time.monotonic() < deadline, "the report EndpointSlice outlived its Service"
        time.sleep(0.2)
    plane.kubectl("delete", "namespace", namespace, "--wait=false")
