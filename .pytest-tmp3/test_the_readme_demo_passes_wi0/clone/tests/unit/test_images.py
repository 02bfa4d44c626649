"""The Dockerfiles agree with what runs them (chart, PyTorchJob builder, settings) and install the pinned versions.

Building the images takes minutes and podman: scripts/build-images.sh does that (CI runs it after the tests).
"""

import json
import re
import subprocess
import sys

import yaml

from conftest import REPO
from trainingrun_operator import builders
from trainingrun_operator.settings import Settings

CHART_VALUES = yaml.safe_load((REPO / "charts/trainingrun-operator/values.yaml").read_text())


def instructions(dockerfile: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", (REPO / dockerfile).read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def last(dockerfile: str, instruction: str) -> str:
    return [rest for word, rest in instructions(dockerfile) if word == instruction][-1]


def build_arg(dockerfile: str, name: str) -> str:
    return next(
        rest.split("=", 1)[1]
        for word, rest in instructions(dockerfile)
        if word == "ARG" and rest.startswith(f"{name}=")
    )


def test_image_pins_are_what_the_tests_ran_with():
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts/pin-image-deps.py"), "--check"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


def test_both_images_install_with_their_pins_and_the_context_admits_them():
    for dockerfile, extra in (("Dockerfile.operator", "operator"), ("Dockerfile.trainer", "trainer")):
        pip_runs = [rest for word, rest in instructions(dockerfile) if word == "RUN" and "pip install" in rest]
        assert pip_runs, dockerfile
        for command in pip_runs:
            assert f"-c /src/images/{extra}-constraints.txt" in command, (dockerfile, command)
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    assert "*" in ignore, "the build context starts from nothing"
    assert "!images/*-constraints.txt" in ignore


def pins(extra: str) -> dict[str, str]:
    lines = (REPO / f"images/{extra}-constraints.txt").read_text().splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def test_pins_hold_torch_at_the_supported_version():
    assert pins("trainer")["torch"] == "2.13.0"
    # The operator never uses the kubernetes client, and kopf imports it whenever it is installed (~30 MB of RSS);
    # the tests' Kubeflow SDK needs it below 36.
    assert "kubernetes" not in pins("operator")
    assert '"kubernetes>=29,<36"' in (REPO / "pyproject.toml").read_text().split("dev = [")[1].split("]")[0]


def test_trainer_image_runs_the_builders_command_as_the_operators_trainer_uid():
    assert json.loads(last("Dockerfile.trainer", "CMD")) == builders.DEFAULT_COMMAND
    uid = int(build_arg("Dockerfile.trainer", "TRAINER_UID"))
    assert uid == Settings().trainer_uid == CHART_VALUES["trainer"]["uid"]
    assert last("Dockerfile.trainer", "USER") == "${TRAINER_UID}"


def test_operator_image_runs_trainingrun_as_the_charts_non_root_uid():
    assert json.loads(last("Dockerfile.operator", "ENTRYPOINT")) == ["trainingrun"]
    assert json.loads(last("Dockerfile.operator", "CMD")) == ["operator"]
    assert int(last("Dockerfile.operator", "USER")) == CHART_VALUES["podSecurityContext"]["runAsUser"] != 0


def test_default_trainer_image_is_cuda_torch_and_base_images_are_build_args():
    assert build_arg("Dockerfile.trainer", "TORCH_SPEC") == "torch==2.13.0"  # PyPI's Linux wheel: CUDA
    for dockerfile in ("Dockerfile.operator", "Dockerfile.trainer"):
        stages = [rest for word, rest in instructions(dockerfile) if word == "FROM"]
        assert len(stages) == 2 and all(stage.startswith("${BASE_IMAGE}") for stage in stages), dockerfile
        assert build_arg(dockerfile, "BASE_IMAGE").startswith("docker.io/library/python:3.11")
