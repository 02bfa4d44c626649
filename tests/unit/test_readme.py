"""The README shows only what works: every TrainingRun in it passes `validate`, and its summary line has the
fields `trainingrun local` prints."""

import re
from pathlib import Path

import yaml

from trainingrun_operator import local, validation

README = Path(__file__).resolve().parents[2] / "README.md"


def yaml_documents():
    for block in re.findall(r"```ya?ml\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S):
        yield from (d for d in yaml.safe_load_all(block) if d)


def test_every_trainingrun_in_the_readme_passes_validate():
    runs = [d for d in yaml_documents() if isinstance(d, dict) and d.get("kind") == "TrainingRun"]
    assert runs, "the README shows at least one TrainingRun"
    for document in runs:
        validation.check(document)  # raises InvalidTrainingRun, naming each field, when one does not


def test_every_spec_env_variable_the_readme_tells_users_to_set_is_allowed():
    text = README.read_text(encoding="utf-8")
    named = set(re.findall(r"`([A-Z][A-Z0-9_]+)`[^.]*?in `spec\.env`", text))
    assert named, "the README names the variables that turn features on through spec.env"
    for name in named:
        body = {
            "apiVersion": "trainingrun.dev/v1alpha1",
            "kind": "TrainingRun",
            "metadata": {"name": "r"},
            "spec": {"checkpoint": {"uri": "s3://bucket/r"}, "env": [{"name": name, "value": "1"}]},
        }
        validation.check(body)


def test_the_readme_summary_line_has_the_fields_trainingrun_local_prints():
    shown = re.search(r"`(result: [^`]*)`", README.read_text(encoding="utf-8")).group(1)
    printed = local.Summary(
        steps=1,
        final_loss=1.0,
        attempts=1,
        restarts_in_place=0,
        lost_steps=0,
        goodput=1.0,
        wall_seconds=1.0,
        outcome="succeeded",
    ).result_line()
    assert re.findall(r"(\w+)=", shown) == re.findall(r"(\w+)=", printed)
