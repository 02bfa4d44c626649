"""`trainingrun crd | validate | render | status | logs | operator`: exit codes, output, and messages a person can
act on. The commands that run on the user's machine alone: test_cli_local.py."""

import os
import subprocess
import sys

import pytest
import yaml

from conftest import EXAMPLES
from trainingrun_operator import cli, crd


def run_cli(*argv):
    """The installed console script, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "trainingrun_operator.cli", *argv], capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    "command",
    [[], ["crd"], ["validate"], ["render"], ["status"], ["logs"], ["checkpoints"], ["operator"], ["monitoring"]],
)
def test_help_on_every_command(command):
    result = run_cli(*command, "--help")
    assert result.returncode == 0
    assert "usage: trainingrun" in result.stdout


def test_crd_prints_the_generated_crd(capsys):
    assert cli.main(["crd"]) == 0
    assert capsys.readouterr().out == crd.crd_yaml()


def test_crd_write(tmp_path, capsys):
    assert cli.main(["crd", "--write", str(tmp_path)]) == 0
    for relative in crd.CRD_PATHS:
        assert (tmp_path / relative).read_text() == crd.crd_yaml()


def test_validate_all_examples(capsys):
    assert cli.main(["validate", *map(str, EXAMPLES)]) == 0
    out = capsys.readouterr().out
    assert out.count("is valid") == len(EXAMPLES)


def write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


BAD = """\
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {name: demo}
spec:
  replica: {min: 1}
  checkpoint: {uri: "ftp://host/x"}
  trainer: {precision: fp8, model: {class_path: a.B}}
"""


def test_validate_prints_one_line_per_problem_and_exits_1(tmp_path, capsys):
    path = write(tmp_path, BAD)
    assert cli.main(["validate", path]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [
        f"{path}: spec.trainer.model.classPath: is required but missing; add it",
        f"{path}: spec.trainer.model.class_path: unknown field; did you mean 'classPath'?",
        f"{path}: spec.trainer.precision: 'fp8' is not allowed; use one of: 32-true, 16-mixed, bf16-mixed, bf16-true",
        f"{path}: spec.checkpoint.uri: 'ftp://host/x' has scheme 'ftp'; use gs://bucket/path, s3://bucket/path or file:///path",
        f"{path}: spec.replica: unknown field; did you mean 'replicas'?",
    ]


MISSPELT_CLASSES = """\
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {name: demo}
spec:
  checkpoint: {uri: "s3://bucket/demo"}
  trainer:
    model: {classPath: trainingrun_trainer.models.CharTransfomer}
    data: {dataset: {classPath: trainingrun_trainer.data.SyntheticText, initArgs: {contextLen: 8}}}
"""


def test_validate_checks_the_trainers_own_classes_and_their_arguments(tmp_path, capsys):
    """Before any cluster: a misspelt built-in class or argument, found without importing torch."""
    path = write(tmp_path, MISSPELT_CLASSES)
    assert cli.main(["validate", path]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"{path}: spec.trainer.model.classPath: module 'trainingrun_trainer.models' has no class 'CharTransfomer'; "
        "did you mean 'CharTransformer'?",
        f"{path}: spec.trainer.data.dataset.initArgs: SyntheticText() got an unexpected keyword argument "
        "'contextLen'; accepted: numSamples, contextLength, vocabSize, seed, split; did you mean 'contextLength'?",
    ]
    user_class = MISSPELT_CLASSES.replace("trainingrun_trainer.models.CharTransfomer", "mypkg.models.Net").replace(
        "contextLen", "contextLength"
    )
    assert cli.main(["validate", write(tmp_path, user_class)]) == 0
    assert (
        "spec.trainer.model.classPath mypkg.models.Net is not importable here: the trainer checks it and its "
        "initArgs when the run starts"
    ) in capsys.readouterr().out


EVERY_PROBLEM = """\
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {name: demo}
spec:
  checkpoint: {uri: "s3://bucket/demo"}
  resources: {gpu: -1}
  trainer:
    model: {classPath: trainingrun_trainer.models.CharTransformer, initArgs: {dim: 256, layers: "x"}}
    data: {dataset: {classPath: trainingrun_trainer.data.SyntheticText, initArgs: {contextLen: 8}}}
"""


def test_validate_reports_every_problem_in_one_pass(tmp_path, capsys):
    """The initArgs' types and names are checked in the same pass as a problem elsewhere (spec.resources)."""
    path = write(tmp_path, EVERY_PROBLEM)
    assert cli.main(["validate", path]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.removeprefix(f"{path}: ").partition(":")[0] for line in lines] == [
        "spec.resources.gpu",
        "spec.trainer.model.initArgs.layers",
        "spec.trainer.data.dataset.initArgs",
    ], lines
    assert "must be a positive integer, got 'x'" in lines[1]


def test_validate_checks_an_importable_user_class_and_names_the_ones_it_could_not(tmp_path, capsys, monkeypatch):
    (tmp_path / "my_models.py").write_text("class Net:\n    def __init__(self, layers: int = 2):\n        pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    wrong = MISSPELT_CLASSES.replace("trainingrun_trainer.models.CharTransfomer", "my_models.Net").replace(
        "contextLen", "contextLength"
    )
    try:
        path = write(
            tmp_path,
            wrong.replace(
                "model: {classPath: my_models.Net}", 'model: {classPath: my_models.Net, initArgs: {layers: "x"}}'
            ),
        )
        assert cli.main(["validate", path]) == 1
        assert capsys.readouterr().err.strip() == f"{path}: spec.trainer.model.initArgs.layers: must be int, got 'x'"
        assert cli.main(["validate", write(tmp_path, wrong)]) == 0
        assert "not importable" not in capsys.readouterr().out
    finally:
        sys.modules.pop("my_models", None)


def test_validate_needs_no_torch(tmp_path):
    """The operator's image has no torch: validate (and the operator, which parses the same way) must not import it."""
    code = (
        "import sys; sys.modules['torch'] = None; from trainingrun_operator import cli; "
        f"sys.exit(cli.main(['validate', {write(tmp_path, MISSPELT_CLASSES)!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "did you mean 'CharTransformer'" in result.stderr, result.stderr


def test_validate_subprocess_has_no_traceback(tmp_path):
    result = run_cli("validate", write(tmp_path, BAD))
    assert result.returncode == 1
    assert "Traceback" not in result.stderr and "did you mean 'replicas'" in result.stderr


@pytest.mark.parametrize(
    "text,expected",
    [
        ("spec: [unclosed", "is not valid YAML at line 1"),
        ("", "holds no YAML document"),
        ("- just\n- a list\n", "expected a TrainingRun mapping, got list"),
        ("kind: TrainingRun\nspec: {}\nkind: Other\n", "key 'kind' is given twice in one mapping; keep one"),
    ],
)
def test_validate_unreadable_documents(tmp_path, capsys, text, expected):
    assert cli.main(["validate", write(tmp_path, text)]) == 1
    assert expected in capsys.readouterr().err


def test_validate_binary_file(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_bytes(b"\xff\xfe\x00binary")
    assert cli.main(["validate", str(path)]) == 1
    assert "is not UTF-8 text" in capsys.readouterr().err


def test_validate_missing_file(tmp_path, capsys):
    assert cli.main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().err


def test_multi_document_file_names_the_document(tmp_path, capsys):
    good = next(p for p in EXAMPLES if p.name == "minimal-cpu.yaml").read_text()
    path = write(tmp_path, good + "\n---\n" + good.replace("spec:", "spec:\n  nprocPerNode: 0", 1))
    assert cli.main(["validate", path]) == 1
    assert f"{path}: document 2: spec.nprocPerNode: must be >= 1, got 0" in capsys.readouterr().err


def test_render_prints_children_as_yaml(capsys):
    example = next(p for p in EXAMPLES if p.name == "gpu-gcs.yaml")
    assert cli.main(["render", str(example), "--attempt", "3", "--resume-from", "gs://bkt/x/step-1"]) == 0
    captured = capsys.readouterr()
    documents = [d for d in yaml.safe_load_all(captured.out) if d]
    assert [d["kind"] for d in documents] == ["Service", "PyTorchJob"]  # a multi-pod run
    assert documents[0]["spec"]["selector"]["trainingrun.dev/attempt"] == "3"
    job = documents[-1]
    assert job["metadata"]["name"] == "charlm-gpu-a3"
    env = {
        e["name"]: e.get("value")
        for e in job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TRAININGRUN_RESUME_FROM"] == "gs://bkt/x/step-1"
    assert "no metadata.uid" in captured.err  # the placeholder is announced, not hidden


def test_render_prints_the_jobset_backends_children(capsys):
    example = next(p for p in EXAMPLES if p.name == "gpu-gcs.yaml")
    assert cli.main(["render", str(example), "--attempt", "3", "--backend", "JobSet"]) == 0
    documents = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d]
    assert [d["kind"] for d in documents] == ["Service", "JobSet"]
    assert documents[0]["spec"]["selector"]["batch.kubernetes.io/job-completion-index"] == "0"
    assert documents[-1]["metadata"]["name"] == "charlm-gpu-a3"


def test_render_rejects_invalid_input_and_bad_attempt(tmp_path, capsys):
    assert cli.main(["render", write(tmp_path, BAD)]) == 1
    assert "did you mean 'replicas'" in capsys.readouterr().err
    result = run_cli("render", str(EXAMPLES[0]), "--attempt", "0")
    assert result.returncode == 2 and "must be 1 or more" in result.stderr


@pytest.mark.slow
def test_operator_without_credentials_says_why_and_exits_1(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    result = subprocess.run(
        [sys.executable, "-m", "trainingrun_operator", "--metrics-port", "0", "--health-port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("trainingrun operator: no Kubernetes credentials")


def test_the_operator_collects_garbage_rarely_and_never_looks_at_its_modules_again():
    # In a subprocess: freezing and thresholds are the whole interpreter's.
    code = (
        "import gc; from trainingrun_operator import cli; cli._collect_garbage_less_often(); "
        "print(gc.get_threshold()[0], gc.get_freeze_count())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    young, frozen = map(int, done.stdout.split())
    assert young == cli.GC_YOUNG_THRESHOLD > 700  # Python's default is 700
    assert frozen > 10_000  # the modules, classes and functions imported so far


def test_validate_says_a_removed_field_is_ignored_and_to_remove_it(tmp_path, capsys):
    path = write(tmp_path, MISSPELT_CLASSES.replace("CharTransfomer", "CharTransformer").replace("contextLen", "contextLength")
                 .replace('checkpoint: {uri: "s3://bucket/demo"}', 'checkpoint: {uri: "s3://bucket/demo", writerProcess: true}'))  # fmt: skip
    assert cli.main(["validate", path]) == 0
    assert (
        "  spec.checkpoint.writerProcess is deprecated and ignored: the trainer's checkpoint thread writes every "
        "checkpoint; remove the field"
    ) in capsys.readouterr().out.splitlines()


def test_validate_imports_the_users_module_from_the_working_folder_and_survives_its_annotations(
    tmp_path, capsys, monkeypatch
):
    """Issue 78 items 5 and 11: a class of the user's own module is checked as `trainingrun local` would import it
    (from the working folder, with no PYTHONPATH), and a config class whose annotations pydantic can only build when
    used (as `GPT2LMHeadModel(config)`'s) is left to the constructor: on main a PydanticUserError traceback."""
    (tmp_path / "cfg_models.py").write_text(
        "from __future__ import annotations\n"
        "from dataclasses import dataclass\n\n"
        "@dataclass\n"
        "class Cfg:\n"
        "    n_layer: int\n"
        "    inner: Undefined  # noqa: F821\n\n"
        "class Net:\n"
        "    def __init__(self, config: Cfg, layers: int = 2):\n"
        "        self.config = config\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    body = (
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: demo}\n"
        "spec:\n  checkpoint: {uri: 's3://bucket/demo'}\n  trainer:\n"
        "    model: {classPath: cfg_models.Net, initArgs: {config: {n_layer: 2, inner: 1}, layers: LAYERS}}\n"
    )
    try:
        assert cli.main(["validate", write(tmp_path, body.replace("LAYERS", "3"))]) == 0
        out = capsys.readouterr().out
        assert "is valid" in out and "not importable" not in out
        assert cli.main(["validate", write(tmp_path, body.replace("LAYERS", "'x'"))]) == 1
        assert "spec.trainer.model.initArgs.layers: must be int, got 'x'" in capsys.readouterr().err
    finally:
        sys.modules.pop("cfg_models", None)
