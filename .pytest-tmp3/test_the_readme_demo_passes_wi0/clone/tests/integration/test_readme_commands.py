"""The README's commands work as written on a fresh machine: its marked steps (scripts/readme_steps.py, which
`.ci/run` runs) in a clean clone, and its demo with the trainer's default metrics port taken."""

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from environments import inherited

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

import readme_steps  # noqa: E402


def clean_clone(tmp_path: Path) -> Path:
    """The repository's tracked files (as a clone has them, with this working tree's edits) in `tmp_path/clone`,
    beside `tmp_path/shared` (../shared, which the install scripts read)."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    clone = tmp_path / "clone"
    for name in filter(None, listed.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (clone / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, clone / name)  # times kept: make sees the venv as newer than pyproject.toml
    (tmp_path / "shared").symlink_to(REPO.parent / "shared")
    return clone


def user_env() -> dict[str, str]:
    """A user's shell: nothing of the contract or of a test run leaks in."""
    return inherited("TRAININGRUN_", "KUBEBUILDER_", "PYTEST_")


def run_steps(name: str, clone: Path) -> None:
    for command in readme_steps.steps(name):
        result = subprocess.run(
            ["bash", "-eo", "pipefail", "-c", command],
            cwd=clone,
            env=user_env(),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert result.returncode == 0, (
            f"README step {name!r}: `{command}` failed:\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
        )


def test_the_readme_marks_the_steps_ci_runs_and_ci_installs_nothing_itself():
    found = readme_steps.all_steps((REPO / "README.md").read_text(encoding="utf-8"))
    assert found["demo"] == ["make demo"] and found["test"] == ["make test"] and found["lint"] == ["make lint"]
    assert found["e2e"][-1] == "make e2e" and "bash scripts/build-images.sh" in found["e2e"]
    ci = (REPO / ".ci" / "run").read_text()
    assert [line.split()[1] for line in ci.splitlines() if line.startswith("readme_steps ")] == [
        "test-tools",
        "lint",
        "test",
        "e2e",
    ]
    assert "apt-get" not in ci  # what CI needs, a user's fresh machine needs: the scripts install it


@pytest.mark.slow
@pytest.mark.installs
def test_the_test_tools_step_installs_every_tool_in_a_clean_clone(tmp_path):
    if not (REPO.parent / "shared" / "k8s").is_dir():
        pytest.skip("../shared/k8s (the Kubernetes binaries install-k8s.sh unpacks) is not beside this checkout")
    clone = clean_clone(tmp_path)
    run_steps("test-tools", clone)
    for tool in (".tools/bin/helm", ".tools/bin/helm3", ".tools/k8s/kube-apiserver", ".tools/k8s/etcd"):
        assert os.access(clone / tool, os.X_OK), tool
    for command in ("promtool", "prometheus", "openssl"):
        assert shutil.which(command), command


def hold_port(port: int) -> socket.socket:
    """Listens on `port` as another program would; when one already does, the port is taken either way."""
    holder = socket.socket()
    try:
        holder.bind(("0.0.0.0", port))
        holder.listen()
    except OSError:
        holder.close()
    return holder


@pytest.mark.slow
def test_the_readme_demo_passes_with_the_default_metrics_port_taken(tmp_path):
    venv = REPO / ".venv"
    if not (venv / ".installed").exists():
        pytest.skip("make setup has not made .venv here")
    clone = clean_clone(tmp_path)
    (clone / ".venv").symlink_to(venv)  # `make demo` sets up first: here the venv `make test` runs in
    with hold_port(9464):  # OpenTelemetry's Prometheus exporter's default, and the pod's spec.metrics.port
        run_steps("demo", clone)
    log = (clone / "runs" / "minimal-cpu" / "attempt-1.log").read_text()
    assert "Address already in use" not in log and "9464" not in log
