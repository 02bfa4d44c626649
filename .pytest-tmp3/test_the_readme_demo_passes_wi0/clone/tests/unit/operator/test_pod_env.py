"""pod_env: the trainer container's environment. Secrets only by reference, the user's variables over the operator's
defaults (never a name twice), the thread count from the pod's CPUs, the report pace from the stall timeout."""

from decimal import Decimal

import pytest

from trainingrun_api import contract
from trainingrun_operator import pod_env, validation
from trainingrun_operator.settings import Settings


def run_of(body: dict, **spec):
    body["spec"].update(spec)
    return validation.parse(body)


@pytest.mark.parametrize(
    "quantity, value",
    [
        ("2", "2"),
        ("500m", "0.5"),
        ("1e3", "1000"),
        ("1Ki", "1024"),
        ("1.5Gi", "1610612736"),
        ("2k", "2000"),
        ("100u", "0.0001"),
        ("3E", "3000000000000000000"),
        ("2.5e2", "250"),
    ],
)
def test_quantities_read_as_kubernetes_reads_them(quantity, value):
    assert pod_env.quantity_value(quantity) == Decimal(value)


def test_each_process_gets_its_share_of_the_pods_cpus_and_at_least_one_thread(minimal_body):
    assert pod_env.omp_threads(run_of(minimal_body).spec) is None  # no CPU request: torch's own default
    assert pod_env.omp_threads(run_of(minimal_body, resources={"cpu": "8"}, nprocPerNode=4).spec) == 2
    assert pod_env.omp_threads(run_of(minimal_body, resources={"cpu": "500m"}).spec) == 1
    assert pod_env.omp_threads(run_of(minimal_body, resources={"cpu": "7"}).spec, nproc=2) == 3


def test_the_report_pace_keeps_reports_closer_than_a_short_stall_timeout():
    default = contract.DEFAULT_REPORT_INTERVAL_SECONDS
    assert pod_env.report_interval_seconds(0) == default  # no stall timeout
    assert pod_env.report_interval_seconds(3600) == default
    assert pod_env.report_interval_seconds(20) == 5.0 < default


def names_and_values(env: list[dict]) -> dict:
    names = [entry["name"] for entry in env]
    assert len(names) == len(set(names)), f"a name given twice (the PyTorchJob CRD refuses it): {names}"
    return {entry["name"]: entry.get("value", entry.get("valueFrom")) for entry in env}


def test_secrets_reach_the_container_only_as_references(minimal_body):
    run = run_of(
        minimal_body,
        secrets={
            "s3Credentials": {"secretName": "s3-keys", "sessionTokenKey": "token"},
            "gcsKeyFile": {"secretName": "gcs", "key": "key.json"},
            "env": [{"name": "WANDB_API_KEY", "secretName": "tracker", "key": "api-key"}],
        },
    )
    env = names_and_values(pod_env.trainer_env(run, 1, Settings(), None))
    assert env["AWS_ACCESS_KEY_ID"] == {"secretKeyRef": {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"}}
    assert env["AWS_SECRET_ACCESS_KEY"] == {"secretKeyRef": {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"}}
    assert env["AWS_SESSION_TOKEN"] == {"secretKeyRef": {"name": "s3-keys", "key": "token"}}
    assert env["WANDB_API_KEY"] == {"secretKeyRef": {"name": "tracker", "key": "api-key"}}
    assert env["GOOGLE_APPLICATION_CREDENTIALS"] == f"{Settings().gcs_key_dir}/key.json"  # a path, not the key


def test_the_users_variables_replace_the_operators_defaults_and_the_contract_stays(minimal_body):
    run = run_of(
        minimal_body,
        resources={"cpu": "4"},
        env=[{"name": "OMP_NUM_THREADS", "value": "16"}, {"name": "HOME", "value": "/work"}],
    )
    env = names_and_values(pod_env.trainer_env(run, 3, Settings(), "s3://bucket/runs/demo/step-00000010"))
    assert env["OMP_NUM_THREADS"] == "16" and env["HOME"] == "/work"
    assert env[contract.NAME] == "demo" and env[contract.NAMESPACE] == "team-a" and env[contract.ATTEMPT] == "3"
    assert env[contract.RESUME_FROM] == "s3://bucket/runs/demo/step-00000010"
    assert env[contract.POD_NAME] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_the_report_endpoint_and_its_pace_are_passed_when_the_operator_has_one(minimal_body):
    quiet = names_and_values(pod_env.trainer_env(run_of(minimal_body), 1, Settings(), None))
    assert contract.REPORT_URL not in quiet
    settings = Settings(report_url="http://operator:8443/report")
    run = run_of(minimal_body, recovery={"stallTimeoutSeconds": 20})
    env = names_and_values(pod_env.trainer_env(run, 1, settings, None))
    assert env[contract.REPORT_URL] == "http://operator:8443/report"
    assert env[contract.REPORT_TOKEN_FILE] == contract.REPORT_TOKEN_PATH
    assert env[contract.REPORT_INTERVAL_SECONDS] == "5"


def test_the_shutdown_timeout_leaves_the_agent_time_before_the_kubelets_sigkill(minimal_body):
    env = pod_env.contract_env(run_of(minimal_body, terminationGracePeriodSeconds=120), 1, "/etc/trainingrun/c.yaml")
    assert env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] == str(120 - pod_env.SHUTDOWN_MARGIN_SECONDS)
    assert env[contract.CONFIG] == "/etc/trainingrun/c.yaml"
