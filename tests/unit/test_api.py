"""Invalid TrainingRuns are rejected by `validate` (pydantic) and by the CRD (as the API server would).

Each case changes one thing in a minimal valid run and names the field path and the words the user
must see. The same document goes through `crd_server.admit`, which applies the generated CRD's
schema and CEL rules, so the two stay in agreement.
"""
import copy

import pytest
from crd_server import admit

from trainingrun_operator import crd, validation


def put(path: str, value):
    """A change that sets one dotted path (creating parents); value DELETE removes it."""

    def change(body):
        node = body
        parts = path.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        if value is DELETE:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = copy.deepcopy(value)

    return change


def both(*changes):
    def change(body):
        for c in changes:
            c(body)

    return change


DELETE = object()
GPU = put("spec.resources", {"gpu": 2})

# (id, change, expected problem line fragment, path the CRD must report (None: the API server
#  rejects it another way, as said in the id))
CASES = [
    ("name-too-long", put("metadata.name", "a" * 41), "metadata.name: 'aaaa", ""),
    ("name-not-dns-label", put("metadata.name", "Bad_Name"), "metadata.name: 'Bad_Name' is not a valid name", ""),
    ("name-starts-with-digit", put("metadata.name", "1run"), "starting with a letter", ""),
    ("spec-missing", put("spec", DELETE), "spec: is required but missing; add it", ""),
    ("checkpoint-missing", put("spec.checkpoint", DELETE), "spec.checkpoint: is required but missing", "spec"),
    ("uri-http-scheme", put("spec.checkpoint.uri", "http://bucket/x"), "spec.checkpoint.uri: 'http://bucket/x' has scheme 'http'; use gs://", "spec.checkpoint.uri"),
    ("uri-no-scheme", put("spec.checkpoint.uri", "bucket/x"), "has no scheme; use gs://bucket/path", "spec.checkpoint.uri"),
    ("keep-zero", put("spec.checkpoint.keep", 0), "spec.checkpoint.keep: must be >= 1, got 0", "spec.checkpoint.keep"),
    ("interval-neither", put("spec.checkpoint.interval", {"steps": None}), "spec.checkpoint.interval: neither steps nor seconds is set", "spec.checkpoint.interval"),
    ("interval-seconds-too-small", put("spec.checkpoint.interval", {"seconds": 5}), "spec.checkpoint.interval.seconds: must be >= 10, got 5", "spec.checkpoint.interval.seconds"),
    ("endpoint-not-s3", both(put("spec.checkpoint.uri", "gs://b/p"), put("spec.checkpoint.endpointUrl", "http://minio:9000")), "endpointUrl is only used with s3:// URIs", "spec.checkpoint"),
    ("replicas-min-zero", put("spec.replicas", {"min": 0}), "spec.replicas.min: must be >= 1, got 0", "spec.replicas.min"),
    ("replicas-min-over-max", put("spec.replicas", {"min": 3, "max": 2}), "spec.replicas: min (3) is greater than max (2); raise max or lower min", "spec.replicas"),
    ("replicas-min-string", put("spec.replicas", {"min": "2"}), "spec.replicas.min: must be an integer, got '2'", "spec.replicas.min"),
    ("replicas-max-negative", put("spec.replicas", {"max": -1}), "spec.replicas.max: must be >= 1, got -1", "spec.replicas.max"),
    ("file-uri-several-pods", both(put("spec.checkpoint.uri", "file:///tmp/ckpt"), put("spec.replicas", {"min": 1, "max": 2})), "spec: checkpoint.uri file:///tmp/ckpt with up to 2 pods: a file:// checkpoint is local to each pod", "spec"),
    ("nproc-zero", put("spec.nprocPerNode", 0), "spec.nprocPerNode: must be >= 1, got 0", "spec.nprocPerNode"),
    ("nproc-over-gpus", both(GPU, put("spec.nprocPerNode", 4)), "nprocPerNode (4) is greater than resources.gpu (2)", "spec"),
    ("gpu-negative", put("spec.resources", {"gpu": -1}), "spec.resources.gpu: must be >= 0, got -1", "spec.resources.gpu"),
    ("memory-not-quantity", put("spec.resources", {"memory": "lots"}), "spec.resources.memory: 'lots' does not have the expected form", "spec.resources.memory"),
    ("cpu-unquoted", put("spec.resources", {"cpu": 2}), "spec.resources.cpu: must be a string (quote it in YAML), got 2", "spec.resources.cpu"),
    ("precision-unknown", put("spec.trainer", {"precision": "fp8"}), "spec.trainer.precision: 'fp8' is not allowed; use one of: 32-true, 16-mixed, bf16-mixed, bf16-true", "spec.trainer.precision"),
    ("precision-near-miss", put("spec.trainer", {"precision": "bf16"}), "spec.trainer.precision: 'bf16' is not allowed; did you mean 'bf16-", "spec.trainer.precision"),
    ("precision-fp16-on-cpu", put("spec.trainer", {"precision": "16-mixed"}), "16-mixed needs a GPU", "spec"),
    ("schedule-unknown", put("spec.trainer", {"schedule": {"name": "cosine_warmup"}}), "spec.trainer.schedule.name: 'cosine_warmup' is not allowed; did you mean 'cosine", "spec.trainer.schedule.name"),
    ("optimizer-near-miss", put("spec.trainer", {"optimizer": {"name": "adam"}}), "did you mean 'adamw'?", "spec.trainer.optimizer.name"),
    ("lr-zero", put("spec.trainer", {"optimizer": {"lr": 0}}), "spec.trainer.optimizer.lr: must be > 0, got 0", "spec.trainer.optimizer.lr"),
    ("max-steps-zero", put("spec.trainer", {"maxSteps": 0}), "spec.trainer.maxSteps: must be >= 1, got 0", "spec.trainer.maxSteps"),
    ("accumulation-zero", put("spec.trainer", {"gradAccumulationSteps": 0}), "spec.trainer.gradAccumulationSteps: must be >= 1", "spec.trainer.gradAccumulationSteps"),
    ("restart-mult-zero", put("spec.trainer", {"schedule": {"restartPeriodMult": 0}}), "spec.trainer.schedule.restartPeriodMult: must be >= 1", "spec.trainer.schedule.restartPeriodMult"),
    ("class-path-not-dotted", put("spec.trainer", {"model": {"classPath": "my model"}}), "spec.trainer.model.classPath: 'my model' is not a dotted Python path; write it as package.module.ClassName", "spec.trainer.model.classPath"),
    ("class-path-missing", put("spec.trainer", {"model": {"initArgs": {"dim": 8}}}), "spec.trainer.model.classPath: is required but missing", "spec.trainer.model"),
    ("unknown-field-typo", put("spec.replica", {"min": 1}), "spec.replica: unknown field; did you mean 'replicas'?", "spec.replica"),
    ("unknown-field-snake-case", put("spec.trainer", {"model": {"class_path": "a.B"}}), "spec.trainer.model.class_path: unknown field; did you mean 'classPath'?", "spec.trainer.model.class_path"),
    ("secret-env-without-key", put("spec.secrets", {"env": [{"name": "WANDB_API_KEY", "secretName": "wandb"}]}), "spec.secrets.env[0].key: is required but missing; add it", "spec.secrets.env[0]"),
    ("secret-env-empty-key", put("spec.secrets", {"env": [{"name": "WANDB_API_KEY", "secretName": "wandb", "key": ""}]}), "spec.secrets.env[0].key: is empty", "spec.secrets.env[0].key"),
    ("gcs-key-without-key", put("spec.secrets", {"gcsKeyFile": {"secretName": "gcs"}}), "spec.secrets.gcsKeyFile.key: is required but missing", "spec.secrets.gcsKeyFile"),
    ("env-name-invalid", put("spec.env", [{"name": "1BAD", "value": "x"}]), "spec.env[0].name: '1BAD' does not have the expected form", "spec.env[0].name"),
    ("env-name-reserved", put("spec.env", [{"name": "TRAININGRUN_NAME", "value": "x"}]), "env[0].name TRAININGRUN_NAME is set by the operator; choose another name", "spec"),
    ("secret-env-name-reserved", put("spec.secrets", {"env": [{"name": "AWS_SECRET_ACCESS_KEY", "secretName": "s", "key": "k"}]}), "secrets.env[0].name AWS_SECRET_ACCESS_KEY is set by the operator", "spec"),
    ("env-duplicate-across-lists", both(put("spec.env", [{"name": "TOKEN", "value": "x"}]), put("spec.secrets", {"env": [{"name": "TOKEN", "secretName": "s", "key": "k"}]})), "secrets.env[0].name TOKEN is already set by env[0]; set each variable once", "spec"),
    ("backoff-over-max", put("spec.recovery", {"backoffSeconds": 100, "maxBackoffSeconds": 50}), "spec.recovery: backoffSeconds (100) is greater than maxBackoffSeconds (50)", "spec.recovery"),
    ("max-failures-negative", put("spec.recovery", {"maxFailures": -1}), "spec.recovery.maxFailures: must be >= 0, got -1", "spec.recovery.maxFailures"),
    ("grace-period-too-short", put("spec.terminationGracePeriodSeconds", 5), "spec.terminationGracePeriodSeconds: must be >= 30, got 5", "spec.terminationGracePeriodSeconds"),
    ("metrics-port-privileged", put("spec.metrics", {"port": 80}), "spec.metrics.port: must be >= 1024, got 80", "spec.metrics.port"),
    ("toleration-operator", put("spec.tolerations", [{"key": "spot", "operator": "Maybe"}]), "spec.tolerations[0].operator: 'Maybe' is not allowed", "spec.tolerations[0].operator"),
    ("command-empty", put("spec.command", []), "spec.command: has fewer than 1 items", "spec.command"),
    ("queue-name-invalid", put("spec.queueName", "bad queue!"), "spec.queueName: 'bad queue!' does not have the expected form", "spec.queueName"),
    ("suspend-not-bool", put("spec.suspend", "yes"), "spec.suspend: must be true or false, got 'yes'", "spec.suspend"),
]


@pytest.mark.parametrize("change,expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_validate_rejects_with_field_and_fix(minimal_body, change, expected):
    change(minimal_body)
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.parse(minimal_body)
    lines = [str(p) for p in caught.value.problems]
    assert any(expected in line for line in lines), lines
    assert all(": " in line for line in lines)  # every line names a path (or the document) first


@pytest.mark.parametrize("change,crd_path", [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_crd_rejects_the_same_documents(minimal_body, change, crd_path):
    change(minimal_body)
    _, errors = admit(crd.crd(), minimal_body)
    assert errors, "the CRD admitted a document that validate rejects"
    assert any(e.startswith(crd_path) for e in errors), errors


def test_there_are_at_least_25_invalid_cases():
    assert len(CASES) >= 25


def test_minimal_and_defaults_agree_between_model_and_crd(minimal_body):
    """What the API server fills in is what the model assumes."""
    defaulted, errors = admit(crd.crd(), copy.deepcopy(minimal_body))
    assert errors == []
    run = validation.parse(minimal_body)
    spec = defaulted["spec"]
    assert spec["replicas"]["min"] == run.spec.replicas.min
    assert spec["trainer"]["optimizer"]["lr"] == run.spec.trainer.optimizer.lr
    assert spec["checkpoint"]["interval"]["steps"] == run.spec.checkpoint.interval.steps
    assert spec["recovery"]["maxPreemptions"] == run.spec.recovery.max_preemptions
    assert spec["terminationGracePeriodSeconds"] == run.spec.termination_grace_period_seconds
    # and the model accepts what the API server stores
    assert validation.parse(defaulted).spec == run.spec


def test_all_problems_are_reported_at_once(minimal_body):
    minimal_body["spec"]["replicas"] = {"min": 0}
    minimal_body["spec"]["nprocPerNode"] = 0
    minimal_body["spec"]["trainer"] = {"precision": "fp8"}
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.parse(minimal_body)
    paths = {p.path for p in caught.value.problems}
    assert {"spec.replicas.min", "spec.nprocPerNode", "spec.trainer.precision"} <= paths


def test_secret_reference_errors_never_echo_the_value(minimal_body):
    pasted = "ghp_" + "x" * 36
    minimal_body["spec"]["secrets"] = {"env": [{"name": "TOKEN", "secretName": pasted, "key": "k"}]}
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.parse(minimal_body)
    assert "spec.secrets.env[0].secretName" in str(caught.value)
    assert pasted[:10] not in str(caught.value)


def test_wrong_api_version_and_kind(minimal_body):
    minimal_body["apiVersion"] = "trainingrun.dev/v1"
    minimal_body["kind"] = "TrainingJob"
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.parse(minimal_body)
    text = str(caught.value)
    assert "apiVersion: 'trainingrun.dev/v1' is not allowed; did you mean 'trainingrun.dev/v1alpha1'?" in text
    assert "kind: 'TrainingJob' is not allowed; did you mean 'TrainingRun'?" in text
