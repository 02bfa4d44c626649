"""What a TrainingRun file may hold that must neither crash `trainingrun validate` nor put a credential where the
run's ConfigMap, its trackers or an error message would show it."""

from __future__ import annotations

import copy

import pytest
import yaml

from trainingrun_operator import cli
from trainingrun_trainer import tracking

SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYSECRET"
MINIMAL = {
    "apiVersion": "trainingrun.dev/v1alpha1",
    "kind": "TrainingRun",
    "metadata": {"name": "demo"},
    "spec": {"checkpoint": {"uri": "s3://bucket/demo"}},
}


def validate(tmp_path, text: str, capsys) -> tuple[int, str]:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code = cli.main(["validate", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.slow
@pytest.mark.parametrize("depth", [101, 20_000])
@pytest.mark.parametrize("shape", ["flow", "block"])
def test_yaml_nested_thousands_deep_is_one_line_not_a_traceback(tmp_path, capsys, depth, shape):
    """On main: RecursionError and a traceback."""
    if shape == "flow":
        text = yaml.safe_dump(MINIMAL) + "extra: " + "[" * depth + "]" * depth + "\n"
    else:
        text = yaml.safe_dump(MINIMAL) + "extra:\n" + "".join("  " * (level + 1) + "a:\n" for level in range(depth))
    code, output = validate(tmp_path, text, capsys)
    assert code == 1
    assert "nests deeper than 100 levels" in output and "Traceback" not in output
    assert len(output.strip().splitlines()) == 1


def test_a_run_with_nested_init_args_still_validates(tmp_path, capsys):
    body = copy.deepcopy(MINIMAL)
    body["spec"]["trainer"] = {
        "model": {"classPath": "trainingrun_trainer.models.CharTransformer", "initArgs": {"dim": 64}}
    }
    code, output = validate(tmp_path, yaml.safe_dump(body), capsys)
    assert code == 0, output


def with_(path: str, value) -> dict:
    body = copy.deepcopy(MINIMAL)
    *parents, last = path.split(".")
    node = body
    for name in parents:
        node = node.setdefault(name, {})
    node[last] = value
    return body


@pytest.mark.parametrize(
    "body, field",
    [
        (with_("spec.checkpoint.uri", f"s3://AKIAEXAMPLE:{SECRET}@bucket/x"), "spec.checkpoint.uri"),
        (with_("spec.checkpoint.endpointUrl", f"https://minio:{SECRET}@minio:9000"), "spec.checkpoint.endpointUrl"),
        (
            with_("spec.trainer.loggers", [{"kind": "mlflow", "trackingUri": f"https://me:{SECRET}@mlflow:5000"}]),
            "spec.trainer.loggers[0].trackingUri",
        ),
        (
            with_("spec.trainer.loggers", [{"kind": "tensorboard", "logDir": f"gs://me:{SECRET}@bucket/tb"}]),
            "spec.trainer.loggers[0].logDir",
        ),
        (
            with_("spec.trainer.loggers", [{"kind": "wandb", "project": "p", "logDir": f"s3://me:{SECRET}@b/w"}]),
            "spec.trainer.loggers[0].logDir",
        ),
        (
            with_(
                "spec.trainer.model",
                {
                    "classPath": "trainingrun_trainer.models.CharTransformer",
                    "initArgs": {"dim": 64, "vocab": f"https://me:{SECRET}@host/vocab.txt"},
                },
            ),
            "spec.trainer.model.initArgs.vocab",
        ),
        (
            with_(
                "spec.trainer.data",
                {
                    "dataset": {
                        "classPath": "trainingrun_trainer.shards.TextBytes",
                        "initArgs": {"uris": [f"s3://me:{SECRET}@bucket/shards"], "context": 64},
                    }
                },
            ),
            "spec.trainer.data.dataset.initArgs.uris[0]",
        ),
        # In the query or fragment: on main these passed validation and went to trackers as they were.
        (
            with_("spec.trainer.loggers", [{"kind": "mlflow", "trackingUri": f"https://mlflow:5000/?token={SECRET}"}]),
            "spec.trainer.loggers[0].trackingUri",
        ),
        (
            with_("spec.trainer.loggers", [{"kind": "tensorboard", "logDir": f"gs://b/tb#access_token={SECRET}"}]),
            "spec.trainer.loggers[0].logDir",
        ),
        (with_("spec.checkpoint.uri", f"s3://bucket/x?X-Amz-Signature={SECRET}"), "spec.checkpoint.uri"),
        (with_("spec.checkpoint.endpointUrl", f"https://minio:9000/?a=1&Key={SECRET}"), "spec.checkpoint.endpointUrl"),
        (
            with_("spec.checkpoint.resumeFrom", f"s3://bucket/x/step-00000010?sig={SECRET}"),
            "spec.checkpoint.resumeFrom",
        ),
        (
            with_(
                "spec.trainer.model",
                {
                    "classPath": "trainingrun_trainer.models.CharTransformer",
                    "initArgs": {"dim": 64, "vocab": f"https://host/vocab.txt?X-Goog-Credential={SECRET}"},
                },
            ),
            "spec.trainer.model.initArgs.vocab",
        ),
    ],
)
def test_credentials_in_any_uri_field_are_refused_and_never_repeated(tmp_path, capsys, body, field):
    code, output = validate(tmp_path, yaml.safe_dump(body), capsys)
    assert code == 1
    assert f"{field}: holds credentials" in output, output
    assert SECRET not in output


class Recording:
    """A tracker backend that keeps what it is given (the trackers' own interface: start, metrics, close)."""

    def __init__(self):
        self.started = []

    def start(self, step, config):
        self.started.append(config)

    def metrics(self, step, values):
        pass

    def close(self, finished):
        pass


def test_trackers_never_get_a_secret_from_the_config():
    """Older specs and a user's initArgs can hold what validation now refuses: the trackers get it redacted."""
    config = {
        "trainer": {
            "model": {
                "initArgs": {
                    "apiKey": SECRET,
                    "hfToken": SECRET,
                    "tokenizerPath": "t.json",
                    "weights": f"s3://AK:{SECRET}@bucket/w",
                    "maxTokens": 5,
                }
            },
            "loggers": [
                {"kind": "mlflow", "trackingUri": f"https://me:{SECRET}@mlflow"},
                {"kind": "mlflow", "trackingUri": f"https://mlflow/?region=eu&token={SECRET}#sig={SECRET}"},
            ],
        },
        "checkpoint": {"uri": "s3://bucket/x"},
    }
    backend = Recording()
    trackers = tracking.Tracker([backend])
    trackers.start(0, config)
    trackers.close()
    sent = backend.started[0]
    assert SECRET not in repr(sent)
    init_args = sent["trainer"]["model"]["initArgs"]
    assert init_args["tokenizerPath"] == "t.json" and init_args["maxTokens"] == 5  # words, not substrings
    assert init_args["weights"] == "s3://<redacted>@bucket/w"
    assert sent["trainer"]["loggers"][0]["trackingUri"] == "https://<redacted>@mlflow"
    # every query value, not only those named like a secret: the server decides which of them are
    assert sent["trainer"]["loggers"][1]["trackingUri"] == (
        "https://mlflow/?region=<redacted>&token=<redacted>#sig=<redacted>"
    )


@pytest.mark.parametrize("uid", ["../../victim", "a/b", "x*", "..", "uid\u0661"])
def test_a_uid_that_could_name_a_path_or_a_glob_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch, uid):
    """Issue 77 item 6: `trainingrun local` used metadata.uid from the file in node memory's folder names, a glob and
    their removal: on main a uid with '/' and '..' removed a folder outside the memory root."""
    from trainingrun_api import contract

    root = tmp_path / "shm"
    victim = tmp_path / "victim-attempt-1"
    (root).mkdir()
    victim.mkdir()
    monkeypatch.setenv(contract.MEMORY_TIER_ROOT_ENV, str(root))
    body = copy.deepcopy(MINIMAL)
    body["metadata"]["uid"] = uid
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(body, allow_unicode=True))
    for command in (["validate", str(path)], ["local", str(path), "--runs-dir", str(tmp_path / "runs")]):
        assert cli.main(command) == 1
        output = capsys.readouterr()
        assert "metadata.uid" in output.out + output.err and "cannot be a uid" in output.out + output.err
    assert victim.is_dir()
    with pytest.raises(ValueError, match="cannot name a run's node memory"):
        contract.memory_tier_dir(uid, 1)


def test_a_uid_in_a_tampered_run_ledger_is_ignored(tmp_path):
    """runs/<name>/run.json is a file too: a uid there that could name a path is replaced by a fresh one."""
    import json

    from trainingrun_operator.local.ledger import RunLedger

    (tmp_path / "run.json").write_text(json.dumps({"uid": "../../x", "checkpointUri": "file:///c"}))
    assert RunLedger.load(tmp_path, "file:///c").uid != "../../x"


def test_the_glob_of_a_runs_memory_folders_matches_its_own_only(tmp_path):
    from trainingrun_api import contract

    root = tmp_path / "sh[m]"
    (root / "trainingrun-a-attempt-1").mkdir(parents=True)
    (root / "trainingrun-ab-attempt-1").mkdir()
    import glob

    assert glob.glob(contract.memory_tier_dirs("a", str(root))) == [str(root / "trainingrun-a-attempt-1")]
