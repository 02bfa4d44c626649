"""The README and docs/ show only what works: every TrainingRun in them passes `validate`, every variable they tell
users to set in `spec.env` is allowed, and the README's summary line has the fields `trainingrun local` prints."""

import re
from pathlib import Path

import yaml

from trainingrun_operator import local, validation

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]


def yaml_blocks():
    for page in PAGES:
        for block in re.findall(r"```ya?ml\n(.*?)```", page.read_text(encoding="utf-8"), flags=re.S):
            yield page, block


def test_every_yaml_block_of_the_readme_and_docs_is_yaml():
    for page, block in yaml_blocks():
        try:
            list(yaml.safe_load_all(block))
        except yaml.YAMLError as error:
            raise AssertionError(f"{page.name}: a YAML block does not parse: {error}") from None


def test_every_trainingrun_in_the_readme_and_docs_passes_validate():
    runs = [
        d
        for _, block in yaml_blocks()
        for d in yaml.safe_load_all(block)
        if isinstance(d, dict) and d.get("kind") == "TrainingRun"
    ]
    assert runs, "the README shows at least one TrainingRun"
    for document in runs:
        validation.check(document)  # raises InvalidTrainingRun, naming each field, when one does not


def test_every_dataset_section_in_the_docs_passes_validate_inside_a_run():
    """docs/ show parts of a spec (`data:`, indented); each is checked inside a minimal run."""
    parts = [yaml.safe_load(block) for _, block in yaml_blocks() if block.lstrip().startswith("data:")]
    assert parts, "docs/data.md shows a data section"
    for part in parts:
        validation.check(
            {
                "apiVersion": "trainingrun.dev/v1alpha1",
                "kind": "TrainingRun",
                "metadata": {"name": "r"},
                "spec": {"checkpoint": {"uri": "s3://bucket/r"}, "trainer": part},
            }
        )


def test_every_spec_env_variable_the_readme_tells_users_to_set_is_allowed():
    text = "\n".join(page.read_text(encoding="utf-8") for page in PAGES)
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


def test_every_relative_link_of_the_readme_and_docs_names_a_file_that_exists():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []
