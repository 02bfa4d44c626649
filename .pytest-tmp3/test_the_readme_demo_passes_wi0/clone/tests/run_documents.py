"""TrainingRun documents that validate must accept or reject, shared by the offline tests
(tests/unit/operator/test_api.py, through crd_server) and the real API server (tests/real_api/test_validate_agrees.py).

Each case changes one thing in a minimal valid run (`minimal_body` in conftest.py).
"""

import copy
import string

from hypothesis import strategies as st

from trainingrun_api import contract


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
    (
        "no-checkpoint-several-pods",
        both(put("spec.checkpoint", DELETE), put("spec.replicas", {"min": 1, "max": 2})),
        "spec: checkpoint.uri file:///tmp/trainingrun/checkpoints with up to 2 pods: a file:// checkpoint is local to each pod (and without checkpoint.uri, checkpoints go to the pod's own disk)",
        "spec",
    ),
    (
        "uri-http-scheme",
        put("spec.checkpoint.uri", "http://bucket/x"),
        "spec.checkpoint.uri: 'http://bucket/x' has scheme 'http'; use gs://",
        "spec.checkpoint",
    ),
    ("uri-no-scheme", put("spec.checkpoint.uri", "bucket/x"), "has no scheme; use gs://bucket/path", "spec.checkpoint"),
    ("keep-zero", put("spec.checkpoint.keep", 0), "spec.checkpoint.keep: must be >= 1, got 0", "spec.checkpoint.keep"),
    (
        "interval-neither",
        put("spec.checkpoint.interval", {"steps": None}),
        "spec.checkpoint.interval: neither steps nor seconds is set",
        "spec.checkpoint.interval",
    ),
    (
        "interval-steps-word",
        put("spec.checkpoint.interval", {"steps": "often"}),
        "spec.checkpoint.interval.steps: 'often' is neither a whole number of steps from 1 nor 'auto'",
        "spec.checkpoint.interval.steps",
    ),
    (
        "interval-steps-zero",
        put("spec.checkpoint.interval", {"steps": 0}),
        "spec.checkpoint.interval.steps: 0 is neither a whole number of steps from 1 nor 'auto'",
        "spec.checkpoint.interval.steps",
    ),
    (
        "interval-bounds-without-auto",
        put("spec.checkpoint.interval", {"steps": 100, "minSteps": 5}),
        "spec.checkpoint.interval: minSteps applies only with steps: auto",
        "spec.checkpoint.interval",
    ),
    (
        "interval-auto-min-over-max",
        put("spec.checkpoint.interval", {"steps": "auto", "minSteps": 50, "maxSteps": 10}),
        "spec.checkpoint.interval: minSteps 50 is above maxSteps 10",
        "spec.checkpoint.interval",
    ),
    (
        "interval-seconds-too-small",
        put("spec.checkpoint.interval", {"seconds": 5}),
        "spec.checkpoint.interval.seconds: must be >= 10, got 5",
        "spec.checkpoint.interval.seconds",
    ),
    (
        "endpoint-not-s3",
        both(put("spec.checkpoint.uri", "gs://bkt/p"), put("spec.checkpoint.endpointUrl", "http://minio:9000")),
        "endpointUrl is only used with s3:// URIs",
        "spec.checkpoint",
    ),
    (
        "mlflow-without-tracking-uri",
        put("spec.trainer.loggers", [{"kind": "mlflow"}]),
        "spec.trainer.loggers[0]: a mlflow logger needs trackingUri",
        "spec.trainer.loggers[0]",
    ),
    (
        "wandb-without-project",
        put("spec.trainer.loggers", [{"kind": "wandb"}]),
        "spec.trainer.loggers[0]: a wandb logger needs project",
        "spec.trainer.loggers[0]",
    ),
    (
        "tensorboard-without-log-dir",
        put("spec.trainer.loggers", [{"kind": "tensorboard"}]),
        "spec.trainer.loggers[0]: a tensorboard logger needs logDir",
        "spec.trainer.loggers[0]",
    ),
    (
        "prefetch-without-workers",
        put("spec.trainer.data", {"prefetchFactor": 4}),
        "spec.trainer.data: prefetchFactor needs worker processes: set numWorkers",
        "spec.trainer.data",
    ),
    (
        "replicas-min-zero",
        put("spec.replicas", {"min": 0}),
        "spec.replicas.min: must be >= 1, got 0",
        "spec.replicas.min",
    ),
    (
        "replicas-min-over-max",
        put("spec.replicas", {"min": 3, "max": 2}),
        "spec.replicas: min (3) is greater than max (2); raise max or lower min",
        "spec.replicas",
    ),
    (
        "replicas-min-string",
        put("spec.replicas", {"min": "2"}),
        "spec.replicas.min: must be an integer, got '2'",
        "spec.replicas.min",
    ),
    (
        "replicas-max-negative",
        put("spec.replicas", {"max": -1}),
        "spec.replicas.max: must be >= 1, got -1",
        "spec.replicas.max",
    ),
    (
        "file-uri-several-pods",
        both(put("spec.checkpoint.uri", "file:///tmp/ckpt"), put("spec.replicas", {"min": 1, "max": 2})),
        "spec: checkpoint.uri file:///tmp/ckpt with up to 2 pods: a file:// checkpoint is local to each pod",
        "spec",
    ),
    ("nproc-zero", put("spec.nprocPerNode", 0), "spec.nprocPerNode: must be >= 1, got 0", "spec.nprocPerNode"),
    (
        "nproc-over-gpus",
        both(GPU, put("spec.nprocPerNode", 4)),
        "nprocPerNode (4) is greater than resources.gpu (2)",
        "spec",
    ),
    (
        "gpu-negative",
        put("spec.resources", {"gpu": -1}),
        "spec.resources.gpu: must be >= 0, got -1",
        "spec.resources.gpu",
    ),
    (
        "memory-not-quantity",
        put("spec.resources", {"memory": "lots"}),
        "spec.resources.memory: 'lots' is not a Kubernetes quantity; write a number with an optional unit, e.g. '900Gi'",
        "spec.resources.memory",
    ),
    (
        "cpu-unquoted",
        put("spec.resources", {"cpu": 2}),
        "spec.resources.cpu: must be a string (quote it in YAML), got 2",
        "spec.resources.cpu",
    ),
    (
        "precision-unknown",
        put("spec.trainer", {"precision": "fp8"}),
        "spec.trainer.precision: 'fp8' is not allowed; use one of: 32-true, 16-mixed, bf16-mixed, bf16-true",
        "spec.trainer.precision",
    ),
    (
        "precision-near-miss",
        put("spec.trainer", {"precision": "bf16"}),
        "spec.trainer.precision: 'bf16' is not allowed; did you mean 'bf16-",
        "spec.trainer.precision",
    ),
    ("precision-fp16-on-cpu", put("spec.trainer", {"precision": "16-mixed"}), "16-mixed needs a GPU", "spec"),
    (
        "schedule-unknown",
        put("spec.trainer", {"schedule": {"name": "cosine_warmup"}}),
        "spec.trainer.schedule.name: 'cosine_warmup' is not allowed; did you mean 'cosine",
        "spec.trainer.schedule.name",
    ),
    (
        "optimizer-near-miss",
        put("spec.trainer", {"optimizer": {"name": "adam"}}),
        "did you mean 'adamw'?",
        "spec.trainer.optimizer.name",
    ),
    (
        "lr-zero",
        put("spec.trainer", {"optimizer": {"lr": 0}}),
        "spec.trainer.optimizer.lr: must be > 0, got 0",
        "spec.trainer.optimizer.lr",
    ),
    (
        "max-steps-zero",
        put("spec.trainer", {"maxSteps": 0}),
        "spec.trainer.maxSteps: must be >= 1, got 0",
        "spec.trainer.maxSteps",
    ),
    (
        "accumulation-zero",
        put("spec.trainer", {"gradAccumulationSteps": 0}),
        "spec.trainer.gradAccumulationSteps: must be >= 1",
        "spec.trainer.gradAccumulationSteps",
    ),
    (
        "restart-mult-zero",
        put("spec.trainer", {"schedule": {"restartPeriodMult": 0}}),
        "spec.trainer.schedule.restartPeriodMult: must be >= 1",
        "spec.trainer.schedule.restartPeriodMult",
    ),
    (
        "class-path-not-dotted",
        put("spec.trainer", {"model": {"classPath": "my model"}}),
        "spec.trainer.model.classPath: 'my model' is not a dotted Python path; write it as package.module.ClassName",
        "spec.trainer.model.classPath",
    ),
    (
        "class-path-missing",
        put("spec.trainer", {"model": {"initArgs": {"dim": 8}}}),
        "spec.trainer.model.classPath: is required but missing",
        "spec.trainer.model",
    ),
    (
        "unknown-field-typo",
        put("spec.replica", {"min": 1}),
        "spec.replica: unknown field; did you mean 'replicas'?",
        "spec.replica",
    ),
    (
        "field-one-level-too-high",
        put("spec.interval", {"steps": 10}),
        "spec.interval: unknown field here; did you mean spec.checkpoint.interval?",
        "spec.interval",
    ),
    (
        "unknown-field-snake-case",
        put("spec.trainer", {"model": {"class_path": "a.B"}}),
        "spec.trainer.model.class_path: unknown field; did you mean 'classPath'?",
        "spec.trainer.model.class_path",
    ),
    (
        "secret-env-without-key",
        put("spec.secrets", {"env": [{"name": "WANDB_API_KEY", "secretName": "wandb"}]}),
        "spec.secrets.env[0].key: is required but missing; add it",
        "spec.secrets.env[0]",
    ),
    (
        "secret-env-empty-key",
        put("spec.secrets", {"env": [{"name": "WANDB_API_KEY", "secretName": "wandb", "key": ""}]}),
        "spec.secrets.env[0].key: is empty",
        "spec.secrets.env[0].key",
    ),
    (
        "gcs-key-without-key",
        put("spec.secrets", {"gcsKeyFile": {"secretName": "gcs"}}),
        "spec.secrets.gcsKeyFile.key: is required but missing",
        "spec.secrets.gcsKeyFile",
    ),
    (
        "env-name-invalid",
        put("spec.env", [{"name": "1BAD", "value": "x"}]),
        "spec.env[0].name: '1BAD' does not have the expected form",
        "spec.env[0].name",
    ),
    (
        "env-name-reserved",
        put("spec.env", [{"name": "TRAININGRUN_NAME", "value": "x"}]),
        "env[0].name TRAININGRUN_NAME is set by the operator; choose another name",
        "spec",
    ),
    (
        "secret-env-name-reserved",
        put("spec.secrets", {"env": [{"name": "AWS_SECRET_ACCESS_KEY", "secretName": "s", "key": "k"}]}),
        "secrets.env[0].name AWS_SECRET_ACCESS_KEY is set by the operator",
        "spec",
    ),
    (
        "env-duplicate-across-lists",
        both(
            put("spec.env", [{"name": "TOKEN", "value": "x"}]),
            put("spec.secrets", {"env": [{"name": "TOKEN", "secretName": "s", "key": "k"}]}),
        ),
        "secrets.env[0].name TOKEN is already set by env[0]; set each variable once",
        "spec",
    ),
    (
        "backoff-over-max",
        put("spec.recovery", {"backoffSeconds": 100, "maxBackoffSeconds": 50}),
        "spec.recovery: backoffSeconds (100) is greater than maxBackoffSeconds (50)",
        "spec.recovery",
    ),
    (
        "max-failures-negative",
        put("spec.recovery", {"maxFailures": -1}),
        "spec.recovery.maxFailures: must be >= 0, got -1",
        "spec.recovery.maxFailures",
    ),
    (
        "grace-period-too-short",
        put("spec.terminationGracePeriodSeconds", 5),
        "spec.terminationGracePeriodSeconds: must be >= 30, got 5",
        "spec.terminationGracePeriodSeconds",
    ),
    (
        "metrics-port-privileged",
        put("spec.metrics", {"port": 80}),
        "spec.metrics.port: must be >= 1024, got 80",
        "spec.metrics.port",
    ),
    (
        "toleration-operator",
        put("spec.tolerations", [{"key": "spot", "operator": "Maybe"}]),
        "spec.tolerations[0].operator: 'Maybe' is not allowed",
        "spec.tolerations[0].operator",
    ),
    ("command-empty", put("spec.command", []), "spec.command: has fewer than 1 items", "spec.command"),
    (
        "queue-name-invalid",
        put("spec.queueName", "bad queue!"),
        "spec.queueName: 'bad queue!' does not have the expected form",
        "spec.queueName",
    ),
    ("suspend-not-bool", put("spec.suspend", "yes"), "spec.suspend: must be true or false, got 'yes'", "spec.suspend"),
]


# Documents that once passed `validate` and then produced objects the API server or the kubelet refused
# (found on a real API server). Each: (id, change, what validate says, path the CRD reports or None when only
# a rendered child shows the problem or crd_server cannot model it (metadata), pod_change: the same value put
# into a Pod, which the server refuses).
def container_env(env):
    def change(pod):
        pod["spec"]["containers"][0]["env"] = copy.deepcopy(env)

    return change


GAP_CASES = [
    (
        "pod-label-key",
        put("spec.podLabels", {"team a": "x"}),
        "spec.podLabels: key 'team a' is not a valid Kubernetes key",
        "spec.podLabels",
        put("metadata.labels", {"team a": "x"}),
    ),
    (
        "pod-label-value",
        put("spec.podLabels", {"team": "a b"}),
        "spec.podLabels.team: 'a b' does not have the expected form",
        "spec.podLabels.team",
        put("metadata.labels", {"team": "a b"}),
    ),
    (
        "pod-label-reserved",
        put("spec.podLabels", {"trainingrun.dev/run": "other"}),
        "spec.podLabels: label 'trainingrun.dev/run' is set by the operator",
        "spec.podLabels",
        None,
    ),
    (
        "pod-annotation-key",
        put("spec.podAnnotations", {"bad key": "x"}),
        "spec.podAnnotations: key 'bad key' is not a valid Kubernetes key",
        "spec.podAnnotations",
        put("metadata.annotations", {"bad key": "x"}),
    ),
    (
        "pod-annotations-too-big",
        put("spec.podAnnotations", {"a": "x" * 262144}),
        "spec.podAnnotations: annotations total 262145 bytes",
        None,
        put("metadata.annotations", {"a": "x" * 262144}),
    ),
    (
        "node-selector-key",
        put("spec.nodeSelector", {"zone name": "a"}),
        "spec.nodeSelector: key 'zone name' is not a valid Kubernetes key",
        "spec.nodeSelector",
        put("spec.nodeSelector", {"zone name": "a"}),
    ),
    (
        "node-selector-value",
        put("spec.nodeSelector", {"zone": "a b"}),
        "spec.nodeSelector.zone: 'a b' does not have the expected form",
        "spec.nodeSelector.zone",
        put("spec.nodeSelector", {"zone": "a b"}),
    ),
    (
        "toleration-key",
        put("spec.tolerations", [{"key": "a b", "operator": "Exists"}]),
        "spec.tolerations[0].key: key 'a b' is not a valid Kubernetes key",
        "spec.tolerations[0]",
        put("spec.tolerations", [{"key": "a b", "operator": "Exists"}]),
    ),
    (
        "toleration-exists-with-value",
        put("spec.tolerations", [{"key": "spot", "operator": "Exists", "value": "x"}]),
        "spec.tolerations[0]: value must be empty when operator is Exists",
        "spec.tolerations[0]",
        put("spec.tolerations", [{"key": "spot", "operator": "Exists", "value": "x"}]),
    ),
    (
        "toleration-equal-without-key",
        put("spec.tolerations", [{"value": "x"}]),
        "spec.tolerations[0]: operator must be Exists when key is empty",
        "spec.tolerations[0]",
        put("spec.tolerations", [{"operator": "Equal", "value": "x"}]),
    ),
    (
        "toleration-seconds-without-noexecute",
        put("spec.tolerations", [{"key": "spot", "operator": "Exists", "tolerationSeconds": 5}]),
        "spec.tolerations[0]: tolerationSeconds needs effect NoExecute",
        "spec.tolerations[0]",
        put("spec.tolerations", [{"key": "spot", "operator": "Exists", "tolerationSeconds": 5}]),
    ),
    (
        "affinity-unknown-field",
        put("spec.affinity", {"nodeAffinity": {"requiredDuringScheduling": {}}}),
        "spec.affinity.nodeAffinity.requiredDuringScheduling: unknown field",
        "spec.affinity.nodeAffinity.requiredDuringScheduling",
        None,
    ),
    (
        "affinity-in-without-values",
        put(
            "spec.affinity",
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
                    }
                }
            },
        ),
        "operator In needs values",
        None,
        put(
            "spec.affinity",
            {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": "zone", "operator": "In"}]}]
                    }
                }
            },
        ),
    ),
    (
        "gpu-resource-standard",
        put("spec.resources", {"gpu": 1, "gpuResourceName": "memory"}),
        "spec.resources.gpuResourceName: 'memory' does not have the expected form",
        "spec.resources.gpuResourceName",
        None,
    ),
    (
        "integer-past-int64",
        put("spec.trainer", {"maxSteps": 2**63}),
        "spec.trainer.maxSteps: 9223372036854775808 is outside the 64-bit integers",
        "spec.trainer.maxSteps",
        None,
    ),
    (
        "integer-past-int64-in-init-args",
        put("spec.trainer", {"model": {"classPath": "a.B", "initArgs": {"seed": 2**64}}}),
        "spec.trainer.model.initArgs.seed: 18446744073709551616 is outside the 64-bit integers",
        None,
        None,
    ),
    (
        "init-args-over-64kib",
        put("spec.trainer", {"model": {"classPath": "a.B", "initArgs": {"vocab": "x" * (1024 * 1024)}}}),
        "spec.trainer.model.initArgs: is 1048588 bytes as JSON, more than 65536; pass a file the class reads",
        None,
        None,
    ),
    (
        "config-annotation-over-256kib",
        both(
            put("spec.podAnnotations", {"example.com/notes": "x" * 90_000}),
            put(
                "spec.trainer",
                {
                    "model": {"classPath": "a.B", "initArgs": {"vocab": "x" * 60_000}},
                    "data": {"dataset": {"classPath": "a.C", "initArgs": {"vocab": "x" * 60_000}}},
                    "eval": {"intervalSteps": 10, "dataset": {"classPath": "a.C", "initArgs": {"vocab": "x" * 60_000}}},
                },
            ),
        ),
        "spec.trainer: renders to a",
        None,
        None,
    ),
    (
        "uri-credentials",
        put("spec.checkpoint.uri", "s3://AKIAEXAMPLE:wJalrSECRET@bucket/x"),
        "spec.checkpoint.uri: holds credentials",
        "spec.checkpoint",
        None,
    ),
    (
        "uri-no-bucket",
        put("spec.checkpoint.uri", "gs:///x"),
        "spec.checkpoint.uri: 'gs:///x' has no valid bucket name",
        "spec.checkpoint",
        None,
    ),
    (
        "uri-whitespace",
        put("spec.checkpoint.uri", "s3://bucket/my runs"),
        "spec.checkpoint.uri: 's3://bucket/my runs' contains whitespace",
        "spec.checkpoint",
        None,
    ),
    (
        "uri-relative-file",
        put("spec.checkpoint.uri", "file://relative/path"),
        "spec.checkpoint.uri: 'file://relative/path' is a relative file:// URI",
        "spec.checkpoint",
        None,
    ),
    (
        "endpoint-credentials",
        both(
            put("spec.checkpoint.uri", "s3://bucket/x"),
            put("spec.checkpoint.endpointUrl", "https://minio-user:s3cr3tpass@minio:9000"),
        ),
        "spec.checkpoint.endpointUrl: holds credentials",
        "spec.checkpoint",
        None,
    ),
    (
        "resume-from-not-a-step",
        put("spec.checkpoint.resumeFrom", "s3://bucket/other"),
        "spec.checkpoint.resumeFrom: must be a checkpoint's step directory",
        "spec.checkpoint",
        None,
    ),
    (
        "resume-from-other-storage",
        put("spec.checkpoint.resumeFrom", "gs://bucket/other/step-00000010"),
        "checkpoint.resumeFrom must be on the same storage",
        "spec.checkpoint",
        None,
    ),
    (
        "tracking-uri-credentials",
        put("spec.trainer.loggers", [{"kind": "mlflow", "trackingUri": "https://ml-user:s3cr3tpass@mlflow:5000"}]),
        "spec.trainer.loggers[0].trackingUri: holds credentials",
        "spec.trainer.loggers[0]",
        None,
    ),
    (
        "tracking-uri-query-token",
        put("spec.trainer.loggers", [{"kind": "mlflow", "trackingUri": "https://mlflow:5000/?x=1&Token=s3cr3t"}]),
        "spec.trainer.loggers[0].trackingUri: holds credentials",
        "spec.trainer.loggers[0]",
        None,
    ),
    (
        "uri-query-signature",
        put("spec.checkpoint.uri", "s3://bucket/x?X-Amz-Signature=s3cr3t"),
        "spec.checkpoint.uri: holds credentials",
        "spec.checkpoint",
        None,
    ),
    (
        "endpoint-fragment-token",
        both(
            put("spec.checkpoint.uri", "s3://bucket/x"),
            put("spec.checkpoint.endpointUrl", "https://minio:9000/#access_token=s3cr3t"),
        ),
        "spec.checkpoint.endpointUrl: holds credentials",
        "spec.checkpoint",
        None,
    ),
    (
        "log-dir-credentials",
        put("spec.trainer.loggers", [{"kind": "tensorboard", "logDir": "s3://AKIAEXAMPLE:wJalrSECRET@bucket/tb"}]),
        "spec.trainer.loggers[0].logDir: holds credentials",
        "spec.trainer.loggers[0]",
        None,
    ),
    (
        "init-args-credentials",
        put(
            "spec.trainer",
            {"model": {"classPath": "a.B", "initArgs": {"weights": "s3://AKIAEXAMPLE:wJalrSECRET@bucket/w"}}},
        ),
        "spec.trainer.model.initArgs.weights: holds credentials",
        None,
        None,
    ),
    (
        "secret-key-dotdot",
        put("spec.secrets", {"env": [{"name": "TOKEN", "secretName": "s", "key": ".."}]}),
        "spec.secrets.env[0].key: '<value not shown>' does not have the expected form",
        "spec.secrets.env[0].key",
        container_env([{"name": "T", "valueFrom": {"secretKeyRef": {"name": "s", "key": ".."}}}]),
    ),
    (
        "metrics-port-rendezvous",
        put("spec.metrics", {"port": 23456}),
        "spec.metrics.port: 23456 is the port the Kubeflow Training Operator gives the rendezvous",
        "spec.metrics",
        None,
    ),
    ("metadata-unknown-field", put("metadata.lables", {"team": "a"}), "metadata.lables: unknown field", None, None),
    (
        "metadata-label-key",
        put("metadata.labels", {"team a": "x"}),
        "metadata.labels: key 'team a' is not a valid Kubernetes key",
        None,
        None,
    ),
    (
        "image-pull-secret-name",
        put("spec.imagePullSecrets", ["Bad_Name"]),
        "spec.imagePullSecrets[0]: 'Bad_Name' does not have the expected form",
        "spec.imagePullSecrets[0]",
        None,
    ),
]

# Documents validate and the API server both accept, each rendering children the API server accepts.
VALID_CASES = [
    ("minimal", put("spec.replicas", {"min": 1})),
    ("resume-from-another-run", put("spec.checkpoint.resumeFrom", "s3://bucket/other-run/step-00000500")),
    ("user-sets-pythonunbuffered", put("spec.env", [{"name": "PYTHONUNBUFFERED", "value": "0"}])),
    (
        "user-sets-home-and-shutdown-timeout",
        put(
            "spec.env", [{"name": "HOME", "value": "/data"}, {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "30"}]
        ),
    ),
    # The trainer's one user knob in the environment: outside the reserved TRAININGRUN_ prefix, so users can set it.
    ("user-sets-grid-intensity", put("spec.env", [{"name": contract.GRID_INTENSITY, "value": "350"}])),
    ("secret-env-named-home", put("spec.secrets", {"env": [{"name": "HOME", "secretName": "home", "key": "path"}]})),
    (
        "null-for-defaulted-fields",
        both(put("spec.recovery", None), put("spec.nprocPerNode", None), put("spec.trainer", {"maxSteps": None})),
    ),
    (
        "scheduling",
        both(
            put("spec.podLabels", {"team": "vision", "example.com/cost-center": "a-1"}),
            put("spec.podAnnotations", {"example.com/note": "any text: here"}),
            put("spec.nodeSelector", {"cloud.google.com/gke-nodepool": "a100"}),
            put(
                "spec.tolerations",
                [
                    {"key": "spot", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
                    {"operator": "Exists"},
                ],
            ),
            put(
                "spec.affinity",
                {
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {
                                    "matchExpressions": [
                                        {"key": "zone", "operator": "In", "values": ["a", "b"]},
                                        {"key": "gen", "operator": "Gt", "values": ["3"]},
                                    ]
                                }
                            ]
                        }
                    },
                    "podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 50,
                                "podAffinityTerm": {
                                    "topologyKey": "kubernetes.io/hostname",
                                    "labelSelector": {"matchLabels": {"team": "vision"}},
                                },
                            }
                        ]
                    },
                },
            ),
        ),
    ),
    (
        "gpus-and-secrets",
        both(
            put("spec.resources", {"gpu": 8, "gpuResourceName": "amd.com/gpu", "cpu": "30", "memory": "500Gi"}),
            put("spec.nprocPerNode", 8),
            put("spec.checkpoint.uri", "gs://my-bucket.example/runs/x"),
            put(
                "spec.secrets",
                {
                    "gcsKeyFile": {"secretName": "gcs", "key": ".key.json"},
                    "env": [{"name": "WANDB_API_KEY", "secretName": "wandb", "key": "api-key"}],
                },
            ),
            put("spec.imagePullSecrets", ["registry"]),
        ),
    ),
    (
        "s3-with-endpoint",
        both(
            put("spec.checkpoint", {"uri": "s3://bucket/x", "endpointUrl": "http://minio.storage:9000"}),
            put("spec.secrets", {"s3Credentials": {"secretName": "s3"}}),
            put("spec.replicas", {"min": 2, "max": 4}),
        ),
    ),
    ("file-uri-one-pod", put("spec.checkpoint.uri", "file:///data/ckpt")),
    ("no-checkpoint-one-pod", put("spec.checkpoint", DELETE)),  # the pod's own disk: a trial's default
    ("checkpoint-without-uri", put("spec.checkpoint", {"interval": {"steps": 10}})),
    (
        "checkpoint-interval-auto",
        put(
            "spec.checkpoint.interval",
            {
                "steps": "auto",
                "minSteps": 20,
                "maxSteps": 2000,
                "expectedSecondsBetweenFailures": 7200,
                "seconds": 1800,
            },
        ),
    ),
    ("checkpoint-interval-auto-defaults", put("spec.checkpoint.interval", {"steps": "auto"})),
]


# ---------------------------------------------------------------- random documents (hypothesis)
# Values that are valid, borderline and wrong for each field, so both verdicts are exercised.

names = st.one_of(
    st.from_regex(r"[a-z][a-z0-9-]{0,45}[a-z0-9]", fullmatch=True),
    st.sampled_from(["a", "run-1", "Run", "-x", "x_y", "1abc"]),
)
small_ints = st.integers(min_value=-2, max_value=12)
quantities = st.sampled_from(["1", "500m", "2.5", "16Gi", "1e3", "", "lots", "-1"])
env_names = st.sampled_from(
    ["A", "TOKEN", "WANDB_API_KEY", "TRAININGRUN_NAME", "PET_NNODES", "AWS_ACCESS_KEY_ID", "1X", "X Y"]
)
secret_names = st.sampled_from(["wandb", "s3-keys", "a.b", "Bad_Name", ""])
keys = st.sampled_from(["api-key", "key.json", "", "a/b", "..", ".x", "..x"])
label_keys = st.sampled_from(
    [
        "team",
        "example.com/team",
        "a b",
        "x/y/z",
        "-a",
        "a" * 64,
        "app.kubernetes.io/name",
        "trainingrun.dev/run",
        "Example.com/x",
    ]
)
label_values = st.sampled_from(["", "v1", "a b", "-x", "x" * 64, "a.b_c-d"])


def optional(**fields):
    return st.fixed_dictionaries({}, optional=fields)


trainer = optional(
    maxSteps=st.integers(min_value=-1, max_value=10**6),
    precision=st.sampled_from(["32-true", "16-mixed", "bf16-mixed", "bf16-true", "fp8", "bf16"]),
    gradAccumulationSteps=small_ints,
    gradClipNorm=st.one_of(st.none(), st.floats(min_value=-1, max_value=10, allow_nan=False)),
    strategy=st.sampled_from(["ddp", "fsdp2", "deepspeed"]),
    optimizer=optional(
        name=st.sampled_from(["adamw", "sgd", "adam"]),
        lr=st.floats(min_value=-0.1, max_value=11, allow_nan=False),
        weightDecay=st.floats(min_value=-0.5, max_value=1.5, allow_nan=False),
    ),
    schedule=optional(
        name=st.sampled_from(
            ["cosine", "cosine-warm-restarts", "inverse-sqrt", "exponential", "step", "constant", "linear"]
        ),
        warmupSteps=small_ints,
        restartPeriodMult=small_ints,
        gamma=st.floats(min_value=-0.5, max_value=1.5, allow_nan=False),
    ),
    model=optional(
        classPath=st.sampled_from(["trainingrun_trainer.models.CharTransformer", "pkg.Mod", "nodots", "a b.C"]),
        initArgs=st.dictionaries(st.text(string.ascii_letters, min_size=1, max_size=5), st.integers(), max_size=2),
    ),
    ema=optional(enabled=st.booleans(), decay=st.floats(min_value=-0.5, max_value=1.5, allow_nan=False)),
)

spec = optional(
    trainer=trainer,
    checkpoint=optional(
        uri=st.sampled_from(
            [
                "gs://bkt/p",
                "s3://bkt/p",
                "file:///ckpt",
                "http://x",
                "b/p",
                "",
                "gs:///p",
                "s3://KEY:SECRET@bkt/p",
                "file://rel",
                "s3://bkt /p",
            ]
        ),
        interval=optional(
            steps=st.one_of(st.none(), small_ints, st.sampled_from(["auto", "often", "10"])),
            seconds=st.one_of(st.none(), st.integers(0, 100)),
            minSteps=small_ints,
            maxSteps=small_ints,
        ),
        keep=small_ints,
        keepEvery=st.one_of(st.none(), small_ints),
        endpointUrl=st.sampled_from(["http://minio:9000", "minio:9000"]),
    ),
    replicas=optional(min=small_ints, max=st.one_of(st.none(), small_ints)),
    nprocPerNode=small_ints,
    resources=optional(
        gpu=small_ints,
        cpu=quantities,
        memory=quantities,
        sharedMemory=quantities,
        gpuResourceName=st.sampled_from(["nvidia.com/gpu", "amd.com/gpu", "memory", "gpu", "Example.com/gpu"]),
    ),
    secrets=optional(
        gcsKeyFile=optional(secretName=secret_names, key=keys),
        s3Credentials=optional(secretName=secret_names, sessionTokenKey=keys),
        env=st.lists(optional(name=env_names, secretName=secret_names, key=keys), max_size=3),
    ),
    env=st.lists(optional(name=env_names, value=st.text(max_size=5)), max_size=3),
    recovery=optional(
        maxFailures=small_ints,
        backoffSeconds=st.integers(-1, 4000),
        maxBackoffSeconds=st.integers(-1, 4000),
        stallTimeoutSeconds=st.integers(-1, 5000),
    ),
    suspend=st.sampled_from([True, False, "yes"]),
    queueName=st.sampled_from(["q", "team-queue", "bad queue"]),
    terminationGracePeriodSeconds=st.integers(0, 4000),
    metrics=optional(enabled=st.booleans(), port=st.one_of(st.integers(0, 70000), st.just(23456))),
    tolerations=st.lists(
        optional(
            key=st.sampled_from(["spot", "nvidia.com/gpu", "", "a b"]),
            operator=st.sampled_from(["Exists", "Equal", "Maybe"]),
            value=st.sampled_from(["", "x", "a b"]),
            effect=st.sampled_from(["NoSchedule", "NoExecute"]),
            tolerationSeconds=st.integers(-1, 100),
        ),
        max_size=2,
    ),
    podLabels=st.dictionaries(label_keys, label_values, max_size=2),
    podAnnotations=st.dictionaries(label_keys, st.text(max_size=5), max_size=2),
    nodeSelector=st.dictionaries(label_keys, label_values, max_size=2),
    imagePullSecrets=st.lists(secret_names, max_size=2),
    unknownField=st.integers(),
)


def documents():
    return st.builds(
        lambda name, s: {
            "apiVersion": "trainingrun.dev/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-1"},
            "spec": {"checkpoint": {"uri": "s3://bkt/p"}, **s} if "checkpoint" not in s else s,
        },
        names,
        spec,
    )
