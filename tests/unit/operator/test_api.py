"""Invalid TrainingRuns (tests/run_documents.py) are rejected by `validate` (pydantic) and by the CRD (as the
API server would, offline; tests/real_api/test_validate_agrees.py sends the same documents to a real one).

Each case changes one thing in a minimal valid run and names the field path and the words the user
must see. The same document goes through `crd_server.admit`, which applies the generated CRD's
schema and CEL rules, so the two stay in agreement.
"""

import copy

import pytest

from crd_server import admit
from run_documents import CASES, GAP_CASES, VALID_CASES
from trainingrun_operator import crd, validation


@pytest.mark.parametrize("change,expected", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_validate_rejects_with_field_and_fix(minimal_body, change, expected):
    change(minimal_body)
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.parse(minimal_body)
    lines = [str(p) for p in caught.value.problems]
    assert any(expected in line for line in lines), lines
    assert all(": " in line for line in lines)  # every line names a path (or the document) first


@pytest.mark.slow
@pytest.mark.parametrize("change,crd_path", [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES])
def test_crd_rejects_the_same_documents(minimal_body, change, crd_path):
    change(minimal_body)
    _, errors = admit(crd.crd(), minimal_body)
    assert errors, "the CRD admitted a document that validate rejects"
    assert any(e.startswith(crd_path) for e in errors), errors


@pytest.mark.parametrize("change,expected,crd_path", [c[1:4] for c in GAP_CASES], ids=[c[0] for c in GAP_CASES])
def test_validate_rejects_what_the_cluster_refuses(minimal_body, change, expected, crd_path):
    """Found on a real API server: each passed validate, then the server or a child's admission refused it."""
    change(minimal_body)
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.check(minimal_body)
    lines = [str(p) for p in caught.value.problems]
    assert any(expected in line for line in lines), lines
    if crd_path is not None:
        _, errors = admit(crd.crd(), minimal_body)
        assert any(e.startswith(crd_path) for e in errors), errors


def test_uri_credentials_are_never_repeated(minimal_body):
    minimal_body["spec"]["checkpoint"] = {
        "uri": "s3://AKIAEXAMPLE:wJalrSECRET@bucket/x",
        "endpointUrl": "https://user:hunter2@minio:9000",
    }
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.check(minimal_body)
    text = str(caught.value)
    assert "spec.checkpoint.uri" in text and "spec.checkpoint.endpointUrl" in text
    assert "wJalrSECRET" not in text and "AKIAEXAMPLE" not in text and "hunter2" not in text
    _, errors = admit(crd.crd(), minimal_body)
    assert errors and not any("wJalrSECRET" in e or "hunter2" in e for e in errors)


@pytest.mark.parametrize("change", [c[1] for c in VALID_CASES], ids=[c[0] for c in VALID_CASES])
def test_valid_documents_pass_validate_and_the_crd(minimal_body, change):
    change(minimal_body)
    validation.check(minimal_body)
    _, errors = admit(crd.crd(), minimal_body)
    assert errors == []


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


def test_a_yaml_alias_bomb_is_refused_without_expanding_it(tmp_path):
    """Nine levels of nine aliases: 9^9 nodes once expanded (rendering it took ~2 GB before the limit)."""
    lines = ['a0: &a0 ["x"]'] + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 10)]
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(validation.InvalidTrainingRun) as caught:
        validation.load_file(str(path))
    assert "expands to" in str(caught.value) and "aliases" in str(caught.value)


def test_a_few_aliases_are_fine(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: demo}\n"
        "spec:\n  checkpoint: {uri: &u 's3://bucket/x'}\n  env: [{name: URI, value: *u}]\n"
    )
    [run] = validation.load_runs(str(path))
    assert run.spec.env[0].value == "s3://bucket/x"


def test_floats_read_as_kubernetes_reads_them(tmp_path):
    """kubectl get -o yaml writes 1e-08; YAML 1.1 (PyYAML) would read it as a string."""
    path = tmp_path / "run.yaml"
    path.write_text(
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: demo}\n"
        "spec:\n  checkpoint: {uri: 's3://bucket/x'}\n  trainer: {optimizer: {eps: 1e-08, lr: 3e-4}}\n"
    )
    [run] = validation.load_runs(str(path))
    assert run.spec.trainer.optimizer.eps == 1e-08 and run.spec.trainer.optimizer.lr == 3e-4


@pytest.mark.parametrize("where", ["spec.trainer.optimizer.lr", "spec.trainer.model.initArgs.dropout"])
@pytest.mark.parametrize("number", [".nan", ".inf", "-.inf"])
def test_a_number_that_is_not_finite_is_refused_with_its_field(tmp_path, where, number):
    """YAML has NaN and infinities, JSON (the API server's) does not, and the trainer's config is JSON: a local file
    with one is refused before anything runs, naming the field."""
    trainer = (
        f"{{optimizer: {{lr: {number}}}}}"
        if where.endswith(".lr")
        else f"{{model: {{classPath: trainingrun_trainer.models.CharTransformer, initArgs: {{dropout: {number}}}}}}}"
    )
    path = tmp_path / "run.yaml"
    path.write_text(
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: demo}\n"
        f"spec:\n  checkpoint: {{uri: 's3://bucket/x'}}\n  trainer: {trainer}\n"
    )
    with pytest.raises(validation.InvalidTrainingRun) as refused:
        validation.load_runs(str(path))
    message = str(refused.value)
    assert where.rsplit(".", 1)[0] in message and "finite" in message, message
