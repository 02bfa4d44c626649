"""Tests for tests/crd_server.py itself: it must default, and reject, what the API server would.

A checker that admits everything would make every CRD test pass, so each kind of check is shown to
fire on the real generated CRD, and every CEL rule of that CRD is shown to fire on some object.
"""

import copy
import re

import celpy
import pytest

from crd_server import admit
from trainingrun_operator import crd as crd_module

MINIMAL = {
    "apiVersion": "trainingrun.dev/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "demo"},
    "spec": {"checkpoint": {"uri": "s3://bkt/p"}},
}


@pytest.fixture(scope="module")
def crd() -> dict:
    return crd_module.crd()


@pytest.fixture(scope="module")
def schema(crd) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def with_spec(**spec) -> dict:
    body = copy.deepcopy(MINIMAL)
    body["spec"].update(copy.deepcopy(spec))
    return body


def rules_of(node, path="<root>"):
    """Every (path, schema node, rule) in a schema, parents first."""
    for rule in node.get("x-kubernetes-validations", []):
        yield path, node, rule
    for name, sub in node.get("properties", {}).items():
        yield from rules_of(sub, name if path == "<root>" else f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            yield from rules_of(node[key], f"{path}[*]")


# ------------------------------------------------------------------ defaulting and a valid object


def test_minimal_run_is_admitted_and_defaulted(crd):
    defaulted, errors = admit(crd, MINIMAL)
    assert errors == []
    spec = defaulted["spec"]
    assert spec["replicas"]["min"] == 1
    assert "max" not in spec["replicas"]  # no default: stays absent
    assert spec["trainer"]["optimizer"]["name"] == "adamw"
    assert spec["checkpoint"]["interval"]["steps"] == "auto"
    assert spec["resources"]["gpu"] == 0
    assert MINIMAL["spec"] == {"checkpoint": {"uri": "s3://bkt/p"}}  # the input is not changed


def test_given_values_win_over_defaults(crd):
    defaulted, errors = admit(crd, with_spec(replicas={"min": 2, "max": 4}, trainer={"optimizer": {"lr": 0.1}}))
    assert errors == []
    assert defaulted["spec"]["replicas"] == {"min": 2, "max": 4}
    assert defaulted["spec"]["trainer"]["optimizer"]["lr"] == 0.1
    assert defaulted["spec"]["trainer"]["optimizer"]["name"] == "adamw"  # defaults inside a given object


def test_null_in_non_nullable_field_is_pruned_then_defaulted(crd):
    defaulted, errors = admit(crd, with_spec(replicas={"min": None}, suspend=None))
    assert errors == []
    assert defaulted["spec"]["replicas"]["min"] == 1
    assert defaulted["spec"]["suspend"] is False


def test_null_in_nullable_field_is_kept_and_not_defaulted(crd):
    defaulted, errors = admit(
        crd, with_spec(checkpoint={"uri": "s3://bkt/p", "interval": {"steps": None, "seconds": 60}})
    )
    assert errors == []
    assert defaulted["spec"]["checkpoint"]["interval"] == {"steps": None, "seconds": 60}


# ------------------------------------------------------------------ every CEL rule fires

CEL_CASES = [
    (
        "replicas-min-over-max",
        with_spec(replicas={"min": 3, "max": 2}),
        "spec.replicas",
        "replicas.min must be <= replicas.max",
    ),
    (
        "interval-neither-steps-nor-seconds",
        with_spec(checkpoint={"uri": "s3://bkt/p", "interval": {"steps": None}}),
        "spec.checkpoint.interval",
        "set checkpoint.interval.steps, checkpoint.interval.seconds or both",
    ),
    (
        "endpoint-url-with-gs-uri",
        with_spec(checkpoint={"uri": "gs://bkt/p", "endpointUrl": "http://minio:9000"}),
        "spec.checkpoint",
        "endpointUrl is only used with s3:// URIs",
    ),
    (
        "interval-steps-a-word",
        with_spec(checkpoint={"uri": "s3://bkt/p", "interval": {"steps": "often"}}),
        "spec.checkpoint.interval.steps",
        "must be a whole number from 1 or one of 'auto'",
    ),
    (
        "interval-steps-zero",
        with_spec(checkpoint={"uri": "s3://bkt/p", "interval": {"steps": 0}}),
        "spec.checkpoint.interval.steps",
        "must be a whole number from 1 or one of 'auto'",
    ),
    (
        "slow-rank-factor-between-off-and-on",
        with_spec(recovery={"slowRankFactor": 1.05}),
        "spec.recovery",
        "recovery.slowRankFactor must be 0 (off) or from 1.1 to 100",
    ),
    (
        "hang-timeout-a-word",
        with_spec(recovery={"hangTimeoutSeconds": "soon"}),
        "spec.recovery.hangTimeoutSeconds",
        "must be a whole number from 0 or one of 'auto'",
    ),
    (
        "hang-timeout-negative",
        with_spec(recovery={"hangTimeoutSeconds": -1}),
        "spec.recovery.hangTimeoutSeconds",
        "must be a whole number from 0 or one of 'auto'",
    ),
    (
        "interval-bounds-without-auto",
        with_spec(checkpoint={"uri": "s3://bkt/p", "interval": {"steps": 100, "maxSteps": 9}}),
        "spec.checkpoint.interval",
        "checkpoint.interval.minSteps, maxSteps and expectedSecondsBetweenFailures only apply",
    ),
    (
        "interval-min-over-max",
        with_spec(checkpoint={"uri": "s3://bkt/p", "interval": {"steps": "auto", "minSteps": 9, "maxSteps": 3}}),
        "spec.checkpoint.interval",
        "checkpoint.interval.minSteps is above maxSteps",
    ),
    (
        "storage-interval-empty",
        with_spec(checkpoint={"uri": "s3://bkt/p", "storageInterval": {}}),
        "spec.checkpoint.storageInterval",
        "set checkpoint.storageInterval.steps, checkpoint.storageInterval.seconds",
    ),
    (
        "nproc-over-gpu",
        with_spec(nprocPerNode=4, resources={"gpu": 2}),
        "spec",
        "nprocPerNode must be <= resources.gpu",
    ),
    (
        "file-uri-several-pods",
        with_spec(checkpoint={"uri": "file:///tmp/ckpt"}, replicas={"min": 2}),
        "spec",
        "a file:// checkpoint is local to each pod",
    ),
    (
        "fp16-without-gpu",
        with_spec(trainer={"precision": "16-mixed"}),
        "spec",
        "trainer.precision 16-mixed needs a GPU",
    ),
    (
        "prefetch-without-workers",
        with_spec(trainer={"data": {"prefetchFactor": 4}}),
        "spec.trainer.data",
        "prefetchFactor needs worker processes",
    ),
    (
        "eval-dataset-without-interval",
        with_spec(trainer={"eval": {"dataset": {"classPath": "trainingrun_trainer.data.SyntheticText"}}}),
        "spec.trainer.eval",
        "dataset is set but intervalSteps is 0",
    ),
    (
        "tensorboard-without-log-dir",
        with_spec(trainer={"loggers": [{"kind": "tensorboard"}]}),
        "spec.trainer.loggers[0]",
        "a tensorboard logger needs logDir",
    ),
    (
        "mlflow-without-tracking-uri",
        with_spec(trainer={"loggers": [{"kind": "mlflow"}]}),
        "spec.trainer.loggers[0]",
        "a mlflow logger needs trackingUri",
    ),
    (
        "log-dir-on-mlflow",
        with_spec(trainer={"loggers": [{"kind": "mlflow", "trackingUri": "http://m", "logDir": "/t"}]}),
        "spec.trainer.loggers[0]",
        "logDir is for tensorboard and wandb loggers only",
    ),
    (
        "wandb-without-project",
        with_spec(trainer={"loggers": [{"kind": "wandb"}]}),
        "spec.trainer.loggers[0]",
        "a wandb logger needs project",
    ),
    (
        "entity-on-mlflow",
        with_spec(trainer={"loggers": [{"kind": "mlflow", "trackingUri": "http://m", "entity": "t"}]}),
        "spec.trainer.loggers[0]",
        "entity is for wandb loggers only",
    ),
    (
        "project-on-tensorboard",
        with_spec(trainer={"loggers": [{"kind": "tensorboard", "logDir": "/t", "project": "p"}]}),
        "spec.trainer.loggers[0]",
        "project is for wandb loggers only",
    ),
    (
        "tracking-uri-on-tensorboard",
        with_spec(trainer={"loggers": [{"kind": "tensorboard", "logDir": "/t", "trackingUri": "http://m"}]}),
        "spec.trainer.loggers[0]",
        "trackingUri is for mlflow loggers only",
    ),
    (
        "experiment-on-tensorboard",
        with_spec(trainer={"loggers": [{"kind": "tensorboard", "logDir": "/t", "experiment": "e"}]}),
        "spec.trainer.loggers[0]",
        "experiment is for mlflow loggers only",
    ),
    (
        "backoff-over-max",
        with_spec(recovery={"backoffSeconds": 700, "maxBackoffSeconds": 600}),
        "spec.recovery",
        "recovery.backoffSeconds must be <= recovery.maxBackoffSeconds",
    ),
    (
        "name-too-long",
        {**MINIMAL, "metadata": {"name": "a" * 41}},
        "<root>",
        "metadata.name must be at most 40 characters",
    ),
    (
        "name-not-dns",
        {**MINIMAL, "metadata": {"name": "Bad_Name"}},
        "<root>",
        "metadata.name must be at most 40 characters",
    ),
    (
        "reserved-env-name",
        with_spec(env=[{"name": "TRAININGRUN_X", "value": "1"}], secrets={"env": []}),
        "spec",
        "env: names starting with TRAININGRUN_ or PET_",
    ),
    (
        "reserved-secret-env-name",
        with_spec(env=[], secrets={"env": [{"name": "AWS_ACCESS_KEY_ID", "secretName": "s", "key": "k"}]}),
        "spec",
        "secrets.env: names starting with TRAININGRUN_ or PET_",
    ),
    (
        "env-in-both-lists",
        with_spec(
            env=[{"name": "WANDB_API_KEY", "value": "x"}],
            secrets={"env": [{"name": "WANDB_API_KEY", "secretName": "s", "key": "k"}]},
        ),
        "spec",
        "a variable is set in both env and secrets.env",
    ),
    (
        "uri-credentials",
        with_spec(checkpoint={"uri": "s3://KEY:SECRET@bkt/p"}),
        "spec.checkpoint",
        "checkpoint.uri holds credentials",
    ),
    (
        "uri-whitespace",
        with_spec(checkpoint={"uri": "s3://bkt/a b"}),
        "spec.checkpoint",
        "checkpoint.uri contains whitespace",
    ),
    (
        "uri-scheme",
        with_spec(checkpoint={"uri": "http://bkt/p"}),
        "spec.checkpoint",
        "checkpoint.uri must start with gs://",
    ),
    (
        "uri-no-bucket",
        with_spec(checkpoint={"uri": "gs:///p"}),
        "spec.checkpoint",
        "checkpoint.uri needs a bucket name",
    ),
    (
        "uri-relative-file",
        with_spec(checkpoint={"uri": "file://rel"}),
        "spec.checkpoint",
        "checkpoint.uri: a file:// URI must be absolute",
    ),
    (
        "endpoint-credentials",
        with_spec(checkpoint={"uri": "s3://bkt/p", "endpointUrl": "https://u:p@minio"}),
        "spec.checkpoint",
        "checkpoint.endpointUrl holds credentials",
    ),
    (
        "resume-from-credentials",
        with_spec(checkpoint={"uri": "s3://bkt/p", "resumeFrom": "s3://K:S@bkt/o/step-00000010"}),
        "spec.checkpoint",
        "checkpoint.resumeFrom holds credentials",
    ),
    (
        "resume-from-not-a-step",
        with_spec(checkpoint={"uri": "s3://bkt/p", "resumeFrom": "s3://bkt/other"}),
        "spec.checkpoint",
        "checkpoint.resumeFrom must be a checkpoint's step directory",
    ),
    (
        "resume-from-other-storage",
        with_spec(checkpoint={"uri": "s3://bkt/p", "resumeFrom": "gs://bkt/o/step-00000010"}),
        "spec.checkpoint",
        "checkpoint.resumeFrom must be on the same storage",
    ),
    (
        "tracking-uri-credentials",
        with_spec(trainer={"loggers": [{"kind": "mlflow", "trackingUri": "https://u:p@mlflow"}]}),
        "spec.trainer.loggers[0]",
        "trackingUri holds credentials",
    ),
    (
        "tracking-uri-query-token",
        with_spec(trainer={"loggers": [{"kind": "mlflow", "trackingUri": "https://mlflow/?token=abc"}]}),
        "spec.trainer.loggers[0]",
        "trackingUri holds credentials",
    ),
    (
        "uri-query-signature",
        with_spec(checkpoint={"uri": "s3://bkt/p?X-Amz-Signature=abc"}),
        "spec.checkpoint",
        "checkpoint.uri holds credentials",
    ),
    (
        "endpoint-fragment-token",
        with_spec(checkpoint={"uri": "s3://bkt/p", "endpointUrl": "https://minio/#access_token=abc"}),
        "spec.checkpoint",
        "checkpoint.endpointUrl holds credentials",
    ),
    (
        "resume-from-query-key",
        with_spec(checkpoint={"uri": "s3://bkt/p", "resumeFrom": "s3://bkt/p/step-00000010?Key=abc"}),
        "spec.checkpoint",
        "checkpoint.resumeFrom holds credentials",
    ),
    (
        "log-dir-credentials",
        with_spec(trainer={"loggers": [{"kind": "tensorboard", "logDir": "s3://KEY:SECRET@bkt/tb"}]}),
        "spec.trainer.loggers[0]",
        "logDir holds credentials",
    ),
    (
        "metrics-rendezvous-port",
        with_spec(metrics={"port": 23456}),
        "spec.metrics",
        "metrics.port 23456 is the Kubeflow rendezvous port",
    ),
    (
        "node-selector-key",
        with_spec(nodeSelector={"a b": "c"}),
        "spec.nodeSelector",
        "nodeSelector: every key must be a Kubernetes qualified name",
    ),
    (
        "pod-label-key",
        with_spec(podLabels={"x/" + "a" * 64: "c"}),
        "spec.podLabels",
        "podLabels: every key must be a Kubernetes qualified name",
    ),
    (
        "pod-label-reserved",
        with_spec(podLabels={"training.kubeflow.org/job-name": "x"}),
        "spec.podLabels",
        "podLabels: keys under trainingrun.dev/",
    ),
    (
        "pod-annotation-key",
        with_spec(podAnnotations={"a" * 254 + "/b": "c"}),
        "spec.podAnnotations",
        "podAnnotations: every key must be",
    ),
    (
        "toleration-exists-with-value",
        with_spec(tolerations=[{"key": "k", "operator": "Exists", "value": "v"}]),
        "spec.tolerations[0]",
        "tolerations: value must be empty when operator is Exists",
    ),
    (
        "toleration-no-key-equal",
        with_spec(tolerations=[{"value": "v"}]),
        "spec.tolerations[0]",
        "tolerations: operator must be Exists when key is empty",
    ),
    (
        "toleration-seconds-not-noexecute",
        with_spec(tolerations=[{"key": "k", "tolerationSeconds": 5}]),
        "spec.tolerations[0]",
        "tolerations: tolerationSeconds needs effect NoExecute",
    ),
    (
        "toleration-key",
        with_spec(tolerations=[{"key": "a b", "operator": "Exists"}]),
        "spec.tolerations[0]",
        "tolerations: key must be a Kubernetes qualified name",
    ),
]


@pytest.mark.parametrize("body,path,message", [c[1:] for c in CEL_CASES], ids=[c[0] for c in CEL_CASES])
def test_cel_rule_fires(crd, body, path, message):
    _, errors = admit(crd, body)
    assert any(e.startswith(f"{path}: {message}") for e in errors), errors


def test_every_cel_rule_of_the_crd_has_a_violating_case(schema):
    """A rule added to the CRD without a case above would be untested; this names it. Transition rules (oldSelf) run
    only on update, which this emulator does not check: the real API server's tier has a case for each
    (test_validate_agrees.py, test_spec_backend_cannot_change_once_the_run_exists)."""
    covered = {message for *_, message in CEL_CASES}
    missing = [
        (p, r["message"])
        for p, _, r in rules_of(schema)
        if "oldSelf" not in r["rule"] and not any(r["message"].startswith(m) for m in covered)
    ]
    assert missing == []


def test_valid_boundaries_pass_the_rules(crd):
    body = with_spec(
        replicas={"min": 2, "max": 2}, nprocPerNode=2, resources={"gpu": 2}, trainer={"precision": "16-mixed"}
    )
    body["metadata"]["name"] = "a" * 40
    body["spec"]["checkpoint"] = {"uri": "s3://bkt/p", "endpointUrl": "http://minio:9000", "interval": {"seconds": 60}}
    body["spec"]["recovery"] = {"backoffSeconds": 600, "maxBackoffSeconds": 600}
    body["spec"]["env"] = [{"name": "A", "value": "1"}]
    body["spec"]["secrets"] = {"env": [{"name": "B", "secretName": "s", "key": "k"}]}
    assert admit(crd, body)[1] == []


def test_rule_that_cannot_evaluate_is_an_error_not_a_pass(crd):
    broken = copy.deepcopy(crd)
    spec_schema = broken["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    spec_schema["x-kubernetes-validations"] = [{"rule": "self.noSuchField > 1", "message": "never shown"}]
    _, errors = admit(broken, MINIMAL)
    assert len(errors) == 1 and errors[0].startswith("spec: rule 'self.noSuchField > 1' could not be evaluated")


# ------------------------------------------------------------------ plain schema errors


@pytest.mark.parametrize(
    "body,expected",
    [
        (with_spec(replicas={"min": "2"}), "spec.replicas.min: '2' is not of type 'integer'"),
        (with_spec(trainer={"precision": "fp8"}), "spec.trainer.precision: 'fp8' is not one of"),
        (with_spec(replicas={"min": 0}), "spec.replicas.min: 0 is less than the minimum of 1"),
        (with_spec(queueName="bad queue"), "spec.queueName: 'bad queue' does not match"),
        (with_spec(env=[{"value": "x"}]), "spec.env[0].name: 'name' is a required property"),
        (with_spec(replica={"min": 1}), "spec.replica: unknown field"),
        (with_spec(env=[{"name": "A"}, {"name": "A"}]), "spec.env[1]: Duplicate value"),
        ({**MINIMAL, "metadata": {}}, "metadata.name: Required value"),
        ({**MINIMAL, "kind": "PyTorchJob"}, "<root>: trainingrun.dev/v1alpha1 PyTorchJob is not served"),
    ],
    ids=["type", "enum", "minimum", "pattern", "required", "unknown", "duplicate-map-key", "no-name", "kind"],
)
def test_schema_error(crd, body, expected):
    _, errors = admit(crd, body)
    assert any(e.startswith(expected) for e in errors), errors


def test_blocking_schema_error_skips_the_rules(crd):
    """As the API server: after a type error the rules are not run (and cannot fail on the type)."""
    _, errors = admit(crd, with_spec(replicas={"min": "3", "max": 2}))
    assert errors[0].startswith("spec.replicas.min: '3' is not of type 'integer'")
    assert errors[-1].startswith("<root>: some validation rules were not checked")
    assert not any("replicas.min must be" in e for e in errors)


def test_non_blocking_schema_error_still_runs_the_rules(crd):
    _, errors = admit(crd, with_spec(replicas={"min": 0, "max": -1}))
    assert "spec.replicas: replicas.min must be <= replicas.max; raise max or lower min" in errors


def test_nullable_fields_accept_null_and_others_do_not(crd):
    assert admit(crd, with_spec(image=None))[1] == []
    _, errors = admit(crd, with_spec(env=[{"name": None, "value": "x"}]))  # pruned, so missing
    assert any(e.startswith("spec.env[0].name: 'name' is a required property") for e in errors), errors


# ------------------------------------------------------------------ the rules themselves


def test_every_rule_compiles_in_celpy(schema):
    rules = list(rules_of(schema))
    assert len(rules) >= 7
    for path, _, rule in rules:
        env = celpy.Environment()
        env.program(env.compile(rule["rule"]))  # raises CELParseError on a syntax error
        assert rule.get("message"), f"{path}: rule {rule['rule']!r} has no message"


def _field_refs(rule: str):
    """Dotted `self.a.b` references of a rule, without a trailing method call (`.startsWith(`)."""
    for match in re.finditer(r"\bself((?:\.[A-Za-z_]\w*)+)(\s*\()?", rule):
        parts = match.group(1).split(".")[1:]
        yield parts[:-1] if match.group(2) else parts


def test_every_field_a_rule_names_exists(schema):
    """celpy does not type-check (the API server does, when the CRD is created), and has() of a
    misspelt field is simply false; so check each `self.x.y` against the schema."""
    metadata = schema["properties"]["metadata"]
    for path, node, rule in rules_of(schema):
        for parts in _field_refs(rule["rule"]):
            where = node
            for part in parts:
                if where is metadata:  # the API server shows rules only these two
                    assert part in ("name", "generateName"), f"{path}: {rule['rule']!r} reads metadata.{part}"
                    break
                assert part in where.get("properties", {}), f"{path}: {rule['rule']!r} names unknown field {part}"
                where = where["properties"][part]


def test_field_refs_keep_fields_and_drop_method_calls():
    assert list(_field_refs("!has(self.endpointURL) || self.uri.startsWith('s3://')")) == [["endpointURL"], ["uri"]]
