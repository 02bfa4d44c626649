"""One tenant's TrainingRun must never blind the operator for the others (issue 77, item 1), on the real API server.

`initArgs` is free-form (x-kubernetes-preserve-unknown-fields), so the API server stores whatever nesting its own JSON
decoder takes. On main a run nested a few hundred levels deep ended the informer task (re-serialising it for the index
raised), and from then on no run, job or pod event reached the operator in any namespace; one nested deeper than the
operator's JSON parser allows made every list page unreadable. Here such runs stand beside a normal one, which must
still get its attempt, while the deep ones get a condition that names the field.
"""

import json

import pytest
from test_operator_real import JOBS, RealCluster, operator_kubeconfig, running_operator, training_run, wait_for  # noqa: F401 - a fixture


def deep_run(namespace: str, name: str, depth: int) -> str:
    """The run as JSON text, `initArgs` `depth` objects deep (written as text: Python's own json stops at ~1000)."""
    body = json.loads(training_run(namespace))
    body["metadata"]["name"] = name
    body["spec"]["trainer"] = {
        "model": {"classPath": "trainingrun_trainer.models.CharTransformer", "initArgs": "NESTED"}
    }
    return json.dumps(body).replace('"NESTED"', '{"a": ' * depth + '{"leaf": 1}' + "}" * depth)


def rejection(cluster: RealCluster, name: str):
    """The run's SpecRejected condition, read without its spec (Python's json stops at ~1000 levels)."""
    found = cluster.plane.kubectl(
        "-n", cluster.namespace, "get", "trainingrun", name, "-o", "jsonpath={.status.conditions}", check=False
    )
    conditions = json.loads(found.stdout or "[]") if found.returncode == 0 else []
    return next((c for c in conditions if c["type"] == "SpecRejected"), None)


@pytest.fixture
def cluster(kube_cluster_with_crds, kube_namespace):
    return RealCluster(kube_cluster_with_crds, kube_namespace)


@pytest.mark.parametrize("when", ["before the operator starts", "while it watches"])
def test_runs_nested_deeper_than_any_parser_leave_a_normal_run_reconciled(cluster, operator_kubeconfig, tmp_path, when):
    plane, ns = cluster.plane, cluster.namespace
    # 300: past what orjson serialises (254); 1500: past what it parses (1024), so a list page holding it was unreadable.
    deep = {"deep-300": 300, "deep-1500": 1500}

    def create_deep_runs():
        for name, depth in deep.items():
            created = plane.kubectl("create", "-f", "-", input=deep_run(ns, name, depth), check=False)
            assert created.returncode == 0, f"the API server refused a {depth}-deep run: {created.stderr[-500:]}"

    if when == "before the operator starts":
        create_deep_runs()  # in the first list's page
    operator = running_operator(operator_kubeconfig, tmp_path)
    log = next(operator)
    try:
        if when == "while it watches":
            create_deep_runs()  # as watch events
        plane.kubectl("create", "-f", "-", input=training_run(ns))
        wait_for(lambda: cluster.get(JOBS, "demo-a1"), timeout=60, what="the normal run's PyTorchJob")
        for name in deep:
            rejected = wait_for(lambda name=name: rejection(cluster, name), what=f"{name}'s condition")
            assert "spec.trainer.model.initArgs" in rejected["message"] and "levels" in rejected["message"], rejected
            assert cluster.get(JOBS, f"{name}-a1") is None
        # The normal run goes on being reconciled: a job's status event still reaches the operator.
        cluster.job_condition("demo-a1", "Created", "Running")
        wait_for(lambda: cluster.status().get("phase") == "Running", what="phase Running after the deep runs")
        text = log.read_text()
        assert "Traceback" not in text and "values cut" in text  # the 1500-deep run was read, its deep part cut
    finally:
        next(operator, None)
