"""The builders turn every valid TrainingRun into children the real schemas accept."""

import copy
import json
import re
import socket
from datetime import datetime, timezone

import jsonschema
import kubernetes_validate
import pytest

from conftest import EXAMPLES
from trainingrun_api import contract
from trainingrun_operator import builders, naming, pytorchjob, validation
from trainingrun_operator.api_meta import MAX_RUN_NAME_LENGTH
from trainingrun_operator.settings import Settings

K8S_VERSION = "1.30.0"


def pytorchjob_problems(job: dict, schema: dict) -> list[str]:
    """Schema errors plus the rules the Kubeflow Training Operator enforces in its webhook."""
    problems = [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(job)]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    if "elasticPolicy" in job["spec"] and "Worker" not in replicas:
        problems.append("elasticPolicy needs a Worker replica spec")
    if replicas.get("Master", {}).get("replicas", 1) != 1:
        problems.append("Master replicas must be 1")
    for kind, replica in replicas.items():
        names = [c["name"] for c in replica["template"]["spec"]["containers"]]
        if "pytorch" not in names:
            problems.append(f"{kind} has no container named pytorch")
    return problems


def assert_valid_builtins(objects: list[dict]) -> None:
    for obj in objects:
        if obj["kind"] == "PyTorchJob":
            template = obj["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
            obj = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template}
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def run_from(body: dict):
    return validation.parse(body)


def job_of(objects: list[dict]) -> dict:
    return next(o for o in objects if o["kind"] == "PyTorchJob")


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_render_children_that_real_schemas_accept(example, pytorchjob_schema):
    runs = validation.load_runs(str(example))
    assert runs
    for run in runs:
        run = run.model_copy(update={"metadata": run.metadata.model_copy(update={"uid": "u-1"})})
        objects = pytorchjob.children(run, attempt=2, resume_from="s3://bkt/ckpt/step-100")
        assert pytorchjob_problems(job_of(objects), pytorchjob_schema) == []
        assert_valid_builtins(objects)


def test_schema_check_catches_a_broken_job(pytorchjob_schema, minimal_body):
    """The checks above must be able to fail."""
    job = job_of(pytorchjob.children(run_from(minimal_body)))
    broken = copy.deepcopy(job)
    broken["spec"]["elasticPolicy"]["minReplicas"] = "two"
    broken["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    problems = pytorchjob_problems(broken, pytorchjob_schema)
    assert any("'two' is not of type 'integer'" in p for p in problems)
    assert "Worker has no container named pytorch" in problems
    with pytest.raises(kubernetes_validate.ValidationError):
        template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
        bad = copy.deepcopy(template)
        bad["spec"]["containers"][0]["env"][0]["valueFrom"] = "nope"
        assert_valid_builtins([{**job, "spec": {**job["spec"], "pytorchReplicaSpecs": {"Worker": {"template": bad}}}}])


def test_elastic_job_shape(minimal_body):
    minimal_body["spec"].update({"replicas": {"min": 2, "max": 4}, "nprocPerNode": 2, "resources": {"gpu": 2}})
    run = run_from(minimal_body)
    job = pytorchjob.pytorch_job(run, attempt=3, resume_from="s3://bucket/runs/demo/step-00000500")
    assert job["metadata"]["name"] == "demo-a3"
    assert job["metadata"]["namespace"] == "team-a"
    elastic = job["spec"]["elasticPolicy"]
    assert elastic["minReplicas"] == 2 and elastic["maxReplicas"] == 4
    assert elastic["rdzvBackend"] == "c10d"
    assert elastic["rdzvId"] == "3f1c2a9e-0000-4000-8000-000000000001-a3"
    assert elastic["maxRestarts"] == run.spec.recovery.max_restarts_per_attempt
    assert job["spec"]["nprocPerNode"] == "2"
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    assert worker["replicas"] == 4 and worker["restartPolicy"] == "ExitCode"
    container = worker["template"]["spec"]["containers"][0]
    assert container["name"] == "pytorch"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TRAININGRUN_ATTEMPT"] == "3"
    assert env["TRAININGRUN_RESUME_FROM"] == "s3://bucket/runs/demo/step-00000500"
    assert "TRAININGRUN_CHECKPOINT_URI" not in env  # one channel: the config file
    assert env["TRAININGRUN_CONFIG"] == "/etc/trainingrun/config.json"
    assert env["TRAININGRUN_UID"] == "3f1c2a9e-0000-4000-8000-000000000001"
    assert env["TRAININGRUN_METRICS_PORT"] == "9464"
    # the agent gives workers most of the grace period for the emergency checkpoint, and exits before SIGKILL
    assert 0 < int(env["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"]) < worker["template"]["spec"]["terminationGracePeriodSeconds"]
    assert container["command"] == ["python", "-m", "trainingrun_trainer.launch", "--module", "trainingrun_trainer"]
    # torch.compile's caches in the pod's /tmp emptyDir, which a worker restarted in the pod finds again
    assert env["TORCHINDUCTOR_CACHE_DIR"].startswith("/tmp/") and env["TRITON_CACHE_DIR"].startswith("/tmp/")
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
    assert {"name": "tmp", "emptyDir": {}} in worker["template"]["spec"]["volumes"]
    owner = job["metadata"]["ownerReferences"][0]
    assert owner["kind"] == "TrainingRun" and owner["controller"] is True and owner["name"] == "demo"
    pod = worker["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= 30
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert worker["template"]["metadata"]["labels"]["trainingrun.dev/run"] == "demo"


def test_attempts_get_distinct_names_and_rendezvous(minimal_body):
    run = run_from(minimal_body)
    first, second = pytorchjob.pytorch_job(run, 1), pytorchjob.pytorch_job(run, 2)
    assert first["metadata"]["name"] != second["metadata"]["name"]
    assert first["spec"]["elasticPolicy"]["rdzvId"] != second["spec"]["elasticPolicy"]["rdzvId"]
    assert pytorchjob.pytorch_job(run, 1) == first  # deterministic: a restarted operator renders the same
    with pytest.raises(ValueError, match="attempt must be 1 or more"):
        pytorchjob.pytorch_job(run, 0)


def test_multi_pod_runs_reach_the_rendezvous_host_through_a_service_of_the_current_attempt(minimal_body):
    minimal_body["spec"]["replicas"] = {"min": 1, "max": 3}
    run = run_from(minimal_body)
    service, job = pytorchjob.children(run, attempt=2)
    assert [service["kind"], job["kind"]] == ["Service", "PyTorchJob"]
    assert job["spec"]["elasticPolicy"]["rdzvHost"] == service["metadata"]["name"] == "demo-rendezvous"
    assert job["spec"]["elasticPolicy"]["rdzvPort"] == service["spec"]["ports"][0]["port"] == contract.RENDEZVOUS_PORT
    assert service["spec"]["ports"][0]["targetPort"] == contract.RENDEZVOUS_PORT
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["publishNotReadyAddresses"] is True
    # it selects exactly worker 0 of this attempt: the pod labels plus Kubeflow's replica index
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    worker_labels = {**template["metadata"]["labels"], naming.KUBEFLOW_REPLICA_INDEX_LABEL: "0"}
    assert service["spec"]["selector"].items() <= worker_labels.items()
    assert service["spec"]["selector"][naming.LABEL_ATTEMPT] == "2"
    assert (
        not service["spec"]["selector"].items() <= {**worker_labels, naming.KUBEFLOW_REPLICA_INDEX_LABEL: "1"}.items()
    )
    assert pytorchjob.children(run, attempt=3)[0]["spec"]["selector"][naming.LABEL_ATTEMPT] == "3"
    env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
    assert env[contract.RENDEZVOUS_HOST_POD]["value"] == "demo-a2-worker-0"
    assert env[contract.POD_IP]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert_valid_builtins([service])


def test_single_pod_runs_have_no_rendezvous_service(minimal_body):
    minimal_body["spec"]["replicas"] = {"min": 1, "max": 1}
    run = run_from(minimal_body)
    assert [o["kind"] for o in pytorchjob.children(run)] == ["PyTorchJob"]
    job = pytorchjob.pytorch_job(run, 1)
    assert "rdzvHost" not in job["spec"]["elasticPolicy"]  # Kubeflow's default: the pod's own name
    env = {e["name"] for e in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]}
    assert contract.RENDEZVOUS_HOST_POD not in env and contract.POD_IP in env


def test_run_policy_and_scheduling(minimal_body):
    minimal_body["spec"].update(
        {
            "suspend": True,
            "activeDeadlineSeconds": 7200,
            "queueName": "team-queue",
            "nodeSelector": {"pool": "a100"},
            "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]}
                        ]
                    }
                }
            },
            "priorityClassName": "high",
            "imagePullSecrets": ["registry"],
            "podAnnotations": {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"},
        }
    )
    job = pytorchjob.pytorch_job(run_from(minimal_body), 1)
    assert job["spec"]["runPolicy"]["suspend"] is True
    assert job["spec"]["runPolicy"]["activeDeadlineSeconds"] == 7200
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-queue"
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    pod = template["spec"]
    assert pod["nodeSelector"] == {"pool": "a100"}
    assert pod["tolerations"] == [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}]
    assert pod["affinity"]["nodeAffinity"]
    assert pod["priorityClassName"] == "high"
    assert pod["imagePullSecrets"] == [{"name": "registry"}]
    annotations = template["metadata"]["annotations"]
    assert annotations.pop(naming.ANNOTATION_CONFIG)  # the trainer config rides along (test_pods_read_the_trainer...)
    assert annotations == {"cluster-autoscaler.kubernetes.io/safe-to-evict": "false"}


def test_pods_get_no_api_token_only_a_report_token_bound_to_them(minimal_body):
    """No per-run ServiceAccount, Role or RoleBinding: a pod runs as the run's serviceAccountName (else the
    namespace default) with no API token mounted, and reports with a projected token for the report
    audience, verified against the CA its annotation carries."""
    run = run_from(minimal_body)
    settings = Settings(report_url="https://op.ops.svc:8443/v1/reports", report_ca="-----BEGIN CERTIFICATE-----\n")
    objects = pytorchjob.children(run, 1, settings)
    assert [o["kind"] for o in objects] == ["PyTorchJob"]
    pod = objects[0]["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    projected = next(v for v in pod["volumes"] if v["name"] == "report-token")["projected"]["sources"][0]
    assert projected["serviceAccountToken"]["audience"] == contract.REPORT_AUDIENCE
    container = pod["containers"][0]
    assert {"name": "report-token", "mountPath": contract.REPORT_TOKEN_DIR, "readOnly": True} in container[
        "volumeMounts"
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env[contract.REPORT_URL] == settings.report_url
    assert env[contract.REPORT_TOKEN_FILE] == f"{contract.REPORT_TOKEN_DIR}/{projected['serviceAccountToken']['path']}"
    assert env[contract.REPORT_CA_FILE] == f"{settings.config_dir}/{contract.REPORT_CA_KEY}"
    assert pod_files(objects[0])[env[contract.REPORT_CA_FILE]] == settings.report_ca
    # without a report endpoint: no token at all
    bare = pytorchjob.pytorch_job(run, 1, Settings())["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert (
        not any(v["name"] == "report-token" for v in bare["volumes"]) and bare["automountServiceAccountToken"] is False
    )


@pytest.mark.parametrize("stall_timeout", [1, 8, 20, 45, 120, 1800])
def test_reports_reach_status_more_often_than_a_short_stall_timeout_looks(minimal_body, stall_timeout):
    """Rank 0 reports every report interval and the endpoint writes a heartbeat to status every heartbeat interval:
    the two together must stay under stallTimeoutSeconds, or a run that trains reads as ReportingUnavailable."""
    from trainingrun_operator import reports

    minimal_body["spec"]["recovery"] = {"stallTimeoutSeconds": stall_timeout}
    settings = Settings(report_url="https://op.ops.svc:8443/v1/reports")
    container = pytorchjob.pytorch_job(run_from(minimal_body), 1, settings)["spec"]["pytorchReplicaSpecs"]["Worker"][
        "template"
    ]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    interval = float(env.get(contract.REPORT_INTERVAL_SECONDS, contract.DEFAULT_REPORT_INTERVAL_SECONDS))
    assert interval + reports.heartbeat_write_seconds(stall_timeout) < stall_timeout
    assert (contract.REPORT_INTERVAL_SECONDS in env) == (stall_timeout < 4 * contract.DEFAULT_REPORT_INTERVAL_SECONDS)


def test_own_service_account_is_used_as_it_is(minimal_body):
    minimal_body["spec"]["serviceAccountName"] = "workload-identity-sa"
    run = run_from(minimal_body)
    assert "ServiceAccount" not in [o["kind"] for o in pytorchjob.children(run)]
    pod = pytorchjob.pytorch_job(run, 1)["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["serviceAccountName"] == "workload-identity-sa"


def pod_files(job):
    """The config volume's files as the kubelet writes them: each the pod annotation its downward API item names."""
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == "config")
    mount = next(m for m in template["spec"]["containers"][0]["volumeMounts"] if m["name"] == "config")
    annotations = template["metadata"]["annotations"]
    files = {}
    for item in volume["downwardAPI"]["items"]:
        key = item["fieldRef"]["fieldPath"].removeprefix("metadata.annotations['").removesuffix("']")
        files[f"{mount['mountPath']}/{item['path']}"] = annotations[key]
    return files


def test_pods_read_the_trainer_config_with_defaults_from_their_annotations(minimal_body):
    minimal_body["spec"]["trainer"] = {"maxSteps": 77, "optimizer": {"lr": 0.001}}
    minimal_body["spec"]["podAnnotations"] = {naming.ANNOTATION_CONFIG: "{}", "team": "vision"}  # the operator's wins
    run = run_from(minimal_body)
    assert [c["kind"] for c in pytorchjob.children(run)] == ["PyTorchJob"]  # no ConfigMap: one write per attempt
    job = pytorchjob.pytorch_job(run, 1, Settings(report_url="https://operator:8443/v1/reports", report_ca="PEM"))
    files = pod_files(job)
    env = {
        e["name"]: e.get("value")
        for e in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    }
    assert files[env["TRAININGRUN_CONFIG"]] and files[env[contract.REPORT_CA_FILE]] == "PEM"
    assert job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["metadata"]["annotations"]["team"] == "vision"
    config = json.loads(files[env["TRAININGRUN_CONFIG"]])
    assert config["trainer"]["maxSteps"] == 77
    assert config["trainer"]["optimizer"]["lr"] == 0.001
    assert config["trainer"]["optimizer"]["name"] == "adamw"  # default filled in
    assert config["checkpoint"]["uri"] == "s3://bucket/runs/demo"
    from trainingrun_api.config import RunConfig

    assert RunConfig.from_wire(config).trainer.max_steps == 77  # the trainer can read it back


def test_children_are_all_owned_and_labelled(minimal_body):
    for obj in pytorchjob.children(run_from(minimal_body)):
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "3f1c2a9e-0000-4000-8000-000000000001"
        assert obj["metadata"]["labels"]["trainingrun.dev/run"] == "demo"
        assert obj["metadata"]["name"].startswith("demo-")


def test_longest_allowed_name_fits_every_generated_name(minimal_body):
    """Kubeflow names pods and Services <job>-worker-<index>; Services must be <= 63 characters."""
    name = "r" * MAX_RUN_NAME_LENGTH
    minimal_body["metadata"]["name"] = name
    minimal_body["spec"]["replicas"] = {"min": 1, "max": 10000}
    run = run_from(minimal_body)
    worst_attempt = 1 + 2 * 1000  # every failure and preemption budget spent
    job = pytorchjob.pytorch_job(run, worst_attempt)
    assert len(f"{job['metadata']['name']}-worker-{10000 - 1}") <= 63
    for obj in pytorchjob.children(run):
        assert len(obj["metadata"]["name"]) <= 63


SECRET_VALUES = ["AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", "-----BEGIN PRIVATE KEY-----"]


def test_no_secret_value_can_reach_a_rendered_object(minimal_body):
    """Secrets are references: the spec has no field that takes a value, and values never leak.

    A user who pastes a value where a secret *name* goes gets a validation error, and the
    Secret's name and key (not content) are all that reach pods.
    """
    minimal_body["spec"]["secrets"] = {
        "s3Credentials": {"secretName": "s3-keys", "sessionTokenKey": "token"},
        "gcsKeyFile": {"secretName": "gcs", "key": "key.json"},
        "env": [{"name": "WANDB_API_KEY", "secretName": "wandb", "key": "api-key"}],
    }
    objects = pytorchjob.children(run_from(minimal_body))
    text = json.dumps(objects)
    job = job_of(objects)
    container = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    secret_env = {e["name"]: e for e in container["env"] if "secretKeyRef" in e.get("valueFrom", {})}
    assert set(secret_env) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "WANDB_API_KEY"}
    assert all("value" not in e for e in secret_env.values())
    assert secret_env["WANDB_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "wandb", "key": "api-key"}
    volumes = {v["name"]: v for v in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["volumes"]}
    assert volumes["gcs-key"]["secret"]["secretName"] == "gcs"
    for value in SECRET_VALUES:
        assert value not in text

    # Pasting a value where a reference goes is rejected, and the value is not echoed back in full.
    for value in SECRET_VALUES:
        body = copy.deepcopy(minimal_body)
        body["spec"]["secrets"]["env"][0]["secretName"] = value
        with pytest.raises(validation.InvalidTrainingRun) as caught:
            run_from(body)
        assert "spec.secrets.env[0].secretName" in str(caught.value)
    # There is no field that takes a secret value: a `value` next to a reference is unknown.
    body = copy.deepcopy(minimal_body)
    body["spec"]["secrets"]["env"][0]["value"] = SECRET_VALUES[1]
    with pytest.raises(validation.InvalidTrainingRun, match=r"spec.secrets.env\[0\].value: unknown field"):
        run_from(body)


def test_settings_default_image_and_override(minimal_body, monkeypatch):
    run = run_from(minimal_body)

    def image(job):
        return job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["image"]

    assert image(pytorchjob.pytorch_job(run, 1)) == Settings().default_trainer_image
    settings = Settings.from_env({"TRAININGRUN_TRAINER_IMAGE": "registry.local/trainer:dev"})
    assert image(pytorchjob.pytorch_job(run, 1, settings)) == "registry.local/trainer:dev"
    minimal_body["spec"]["image"] = "mine:1"
    assert image(pytorchjob.pytorch_job(run_from(minimal_body), 1, settings)) == "mine:1"


@pytest.mark.parametrize(
    "cpu,nproc,threads", [("500m", 1, "1"), ("8", 2, "4"), ("7500m", 2, "3"), ("1e1", 4, "2"), (None, 2, None)]
)
def test_each_process_gets_its_share_of_the_cpu_request_as_threads(minimal_body, cpu, nproc, threads):
    """torch starts a thread per node core whatever the pod may use: oversubscribed, and numerics that
    depend on the node, so the same file would compute another model on another node or locally."""
    minimal_body["spec"]["nprocPerNode"] = nproc
    if cpu:
        minimal_body["spec"]["resources"] = {"cpu": cpu}
    container = job_of(pytorchjob.children(run_from(minimal_body), 1))["spec"]["pytorchReplicaSpecs"]["Worker"][
        "template"
    ]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env.get("OMP_NUM_THREADS") == threads
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_the_users_thread_count_wins_without_a_duplicate(minimal_body):
    minimal_body["spec"].update(resources={"cpu": "8"}, env=[{"name": "OMP_NUM_THREADS", "value": "3"}])
    container = job_of(pytorchjob.children(run_from(minimal_body), 1))["spec"]["pytorchReplicaSpecs"]["Worker"][
        "template"
    ]["spec"]["containers"][0]
    assert [e.get("value") for e in container["env"] if e["name"] == "OMP_NUM_THREADS"] == ["3"]


def test_an_image_pull_secret_named_twice_is_listed_once(minimal_body):
    """The PyTorchJob CRD refuses a duplicate (the real API server's 422, found by the random documents)."""
    minimal_body["spec"]["imagePullSecrets"] = ["wandb", "regcred", "wandb"]
    pod = job_of(pytorchjob.children(run_from(minimal_body), 1))["spec"]["pytorchReplicaSpecs"]["Worker"]["template"][
        "spec"
    ]
    assert pod["imagePullSecrets"] == [{"name": "wandb"}, {"name": "regcred"}]


def test_the_checkpoint_uri_reaches_the_pod_through_the_config_file_alone(minimal_body):
    """The operator decides the URI an attempt uses (the one the run started with, whatever the spec says now)."""
    run = run_from(minimal_body)
    started = run.spec.checkpoint.uri
    edited = run.model_copy(deep=True)
    edited.spec.checkpoint.uri = "s3://elsewhere/later"
    (job,) = pytorchjob.children(edited, 2, checkpoint_uri=started)
    assert json.loads(pod_files(job)["/etc/trainingrun/config.json"])["checkpoint"]["uri"] == started
    env = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    assert not [e for e in env if "s3://" in str(e.get("value")) or "CHECKPOINT_URI" in e["name"]]
    # the job is stamped as built from the spec it ran with: the started URI, not the edit
    assert job["metadata"]["annotations"][naming.ANNOTATION_SPEC_DIGEST] == naming.spec_digest(run)
    assert naming.ANNOTATION_SPEC_HASH not in job["metadata"]["annotations"]  # an older operator's, never written


def test_events_of_one_run_at_one_moment_get_names_of_their_own(minimal_body):
    """Event names are the run's and the clock's nanoseconds, as client-go's: never twice the same in a process, even
    when the operator's clock stands still (a second Event under a taken name would be refused and lost)."""
    body = copy.deepcopy(minimal_body)
    body["metadata"].update(name="r" * MAX_RUN_NAME_LENGTH, namespace="ns", uid="u-1")
    now = datetime(2026, 11, 29, 9, 0, tzinfo=timezone.utc)
    note = builders.Note("Normal", "AttemptStarted", "attempt 1 started")
    events = [builders.event_object(body, note, now) for _ in range(1000)]
    names = [e["metadata"]["name"] for e in events]
    assert len(set(names)) == len(names)
    for name in names:
        assert name.startswith(body["metadata"]["name"] + ".")
        assert len(name) <= 253 and re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name)
    assert {e["reportingInstance"] for e in events} == {socket.gethostname()}
    assert events[0]["involvedObject"]["uid"] == "u-1" and events[0]["firstTimestamp"] == "2026-11-29T09:00:00Z"
