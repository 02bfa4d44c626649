"""`trainingrun status` against a real API server, read with a kubeconfig as a user has one."""

import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import yaml


def status_command(kubeconfig, *argv):
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    return subprocess.run(
        [sys.executable, "-m", "trainingrun_operator.cli", "status", "--kubeconfig", str(kubeconfig), *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_status_reads_the_run_in_the_contexts_namespace(kube_cluster_with_crds, kube_namespace, minimal_body, tmp_path):
    plane = kube_cluster_with_crds
    minimal_body["metadata"] = {"name": "followed"}
    minimal_body["spec"]["trainer"] = {"maxSteps": 3000}
    plane.kubectl("-n", kube_namespace, "create", "-f", "-", input=yaml.safe_dump(minimal_body))
    eta = (datetime.now(timezone.utc) + timedelta(hours=2, minutes=30)).strftime("%Y-%m-%dT%H:%M:%SZ")
    status = {
        "phase": "Running",
        "attempt": 2,
        "jobName": "followed-a2",
        "progress": {
            "step": 1200,
            "totalSteps": 3000,
            "loss": 1.5,
            "samplesPerSecond": 640.0,
            "percent": 40.0,
            "estimatedCompletionTime": eta,
        },
        "lastGoodCheckpoint": {"uri": "s3://bucket/runs/demo/step-00001200", "step": 1200},
    }
    plane.kubectl(
        "-n",
        kube_namespace,
        "patch",
        "tr",
        "followed",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": status}),
    )
    kubeconfig = tmp_path / "kubeconfig"
    shutil.copy(plane.admin_kubeconfig, kubeconfig)
    plane.kubectl(
        "config", "set-context", "--current", f"--namespace={kube_namespace}", kubeconfig_file=str(kubeconfig)
    )

    result = status_command(kubeconfig, "followed")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"TrainingRun {kube_namespace}/followed: Running, attempt 2 (PyTorchJob followed-a2)"
    assert re.fullmatch(
        rf"  progress    step 1200/3000 \(40%\), loss 1.5000, 640 samples/s, ETA ~2h(29|30)m \({eta}\)", lines[1]
    ), lines[1]
    assert "  checkpoint  step 1200 at s3://bucket/runs/demo/step-00001200" in lines

    missing = status_command(kubeconfig, "nope", "-n", "default")
    assert missing.returncode == 1
    assert missing.stderr.strip() == (
        "no TrainingRun 'nope' in namespace 'default'; `kubectl get tr -n default` lists the runs there"
    )


def test_status_without_a_kubeconfig_is_one_line(tmp_path):
    result = status_command(tmp_path / "absent", "followed")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
