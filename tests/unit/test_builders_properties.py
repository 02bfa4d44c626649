"""Property: any TrainingRun document either renders valid children or fails validation; never a crash.

Documents are drawn from values that are valid, borderline and wrong for each field, so both
branches are exercised. The CRD (as the API server applies it) must agree with `validate`.
"""
import string

import jsonschema
import kubernetes_validate
from crd_server import admit
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_builders import K8S_VERSION, pytorchjob_problems

from trainingrun_operator import builders, crd, validation

CRD = crd.crd()

names = st.one_of(
    st.from_regex(r"[a-z][a-z0-9-]{0,45}[a-z0-9]", fullmatch=True),
    st.sampled_from(["a", "run-1", "Run", "-x", "x_y", "1abc"]),
)
small_ints = st.integers(min_value=-2, max_value=12)
quantities = st.sampled_from(["1", "500m", "2.5", "16Gi", "1e3", "", "lots", "-1"])
env_names = st.sampled_from(["A", "TOKEN", "WANDB_API_KEY", "TRAININGRUN_NAME", "PET_NNODES", "AWS_ACCESS_KEY_ID", "1X", "X Y"])
secret_names = st.sampled_from(["wandb", "s3-keys", "a.b", "Bad_Name", ""])
keys = st.sampled_from(["api-key", "key.json", "", "a/b"])


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
        name=st.sampled_from(["cosine", "cosine-warm-restarts", "inverse-sqrt", "exponential", "step", "constant", "linear"]),
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
        uri=st.sampled_from(["gs://b/p", "s3://b/p", "file:///ckpt", "http://x", "b/p", ""]),
        interval=optional(steps=st.one_of(st.none(), small_ints), seconds=st.one_of(st.none(), st.integers(0, 100))),
        keep=small_ints,
        keepEvery=st.one_of(st.none(), small_ints),
        endpointUrl=st.sampled_from(["http://minio:9000", "minio:9000"]),
    ),
    replicas=optional(min=small_ints, max=st.one_of(st.none(), small_ints)),
    nprocPerNode=small_ints,
    resources=optional(gpu=small_ints, cpu=quantities, memory=quantities, sharedMemory=quantities),
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
    metrics=optional(enabled=st.booleans(), port=st.integers(0, 70000)),
    tolerations=st.lists(optional(key=st.sampled_from(["spot", "nvidia.com/gpu"]), operator=st.sampled_from(["Exists", "Equal", "Maybe"])), max_size=2),
    unknownField=st.integers(),
)


def documents():
    return st.builds(
        lambda name, s: {
            "apiVersion": "trainingrun.dev/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": name, "namespace": "ns", "uid": "uid-1"},
            "spec": {"checkpoint": {"uri": "s3://b/p"}, **s} if "checkpoint" not in s else s,
        },
        names,
        spec,
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents(), st.integers(min_value=1, max_value=2001))
def test_any_document_renders_valid_children_or_fails_validation(pytorchjob_schema, body, attempt):
    _, crd_errors = admit(CRD, body)
    try:
        run = validation.parse(body)
    except validation.InvalidTrainingRun as error:
        assert error.problems and all(str(p) for p in error.problems)
        assert crd_errors, f"validate rejects but the CRD admits: {error}"
        return
    assert crd_errors == [], "the CRD rejects a document that validate accepts"
    objects = builders.children(run, attempt)
    job = next(o for o in objects if o["kind"] == "PyTorchJob")
    assert pytorchjob_problems(job, pytorchjob_schema) == []
    for obj in objects:
        if obj["kind"] != "PyTorchJob":
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    template = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]
    kubernetes_validate.validate(
        {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
        K8S_VERSION,
        strict=True,
    )
