"""TrainingRun files the local tests load: a minimal one and one with secrets."""

BODY = """\
apiVersion: trainingrun.dev/v1alpha1
kind: TrainingRun
metadata: {name: laptop}
spec:
  trainer: {maxSteps: 10}
  secrets:
    env: [{name: WANDB_API_KEY, secretName: wandb, key: api-key}]
    gcsKeyFile: {secretName: gcs, key: key.json}
"""


def write_minimal(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "apiVersion: trainingrun.dev/v1alpha1\nkind: TrainingRun\nmetadata: {name: laptop}\n"
        "spec:\n  trainer: {maxSteps: 10}\n"
    )
    return path
