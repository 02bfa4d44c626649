"""The real JobSet controller (kubernetes-sigs/jobset v0.9.1, `jobset-controller` from ../shared/k8s) run beside a
test control plane (`kube_cluster.ControlPlane`), as its README shows it working outside a cluster: as the user
`jobset-controller` with its upstream ClusterRole only, its webhook server on a free loopback port with a serving
certificate of the plane's CA, and its four webhooks (JobSet and Pod, mutating and validating, `failurePolicy: Fail`)
registered once it is ready, so every JobSet and every pod of one is admitted by the real webhooks.
"""

from __future__ import annotations

import base64
import subprocess
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kube_cluster import ControlPlane, ProcessGroup, free_port, sign_certificate

BINARY = "jobset-controller"
MANAGER_ROLE = Path(__file__).resolve().parent / "fixtures" / "jobset-v0.9.1-manager-role.yaml"
JOBSET_WEBHOOKS = [("jobset", "jobset.x-k8s.io", "v1alpha2", "jobsets"), ("pod", "", "v1", "pods")]


@dataclass
class JobSetController(ProcessGroup):
    plane: ControlPlane
    workdir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    def start(self) -> "JobSetController":
        pki = self.plane.pki
        sign_certificate(pki, "jobset-controller", "/CN=jobset-controller", "clientAuth")
        sign_certificate(pki, "jobset-webhook", "/CN=jobset-webhook", "serverAuth", "DNS:localhost,IP:127.0.0.1")
        certs = self.workdir / "jobset-webhook-certs"
        certs.mkdir(parents=True, exist_ok=True)
        (certs / "tls.crt").write_bytes((pki / "jobset-webhook.crt").read_bytes())
        (certs / "tls.key").write_bytes((pki / "jobset-webhook.key").read_bytes())
        self.plane.kubectl("apply", "--server-side", "-f", str(MANAGER_ROLE))
        self.plane.kubectl(
            "create", "clusterrolebinding", "jobset-manager", "--clusterrole=manager-role", "--user=jobset-controller"
        )
        webhook, metrics, health = free_port(), free_port(), free_port()
        config = self.workdir / "jobset-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "config.jobset.x-k8s.io/v1alpha1",
                    "kind": "Configuration",
                    "leaderElection": {"leaderElect": False},
                    "internalCertManagement": {"enable": False},
                    "webhook": {"host": "127.0.0.1", "port": webhook, "certDir": str(certs)},
                    "metrics": {"bindAddress": f"127.0.0.1:{metrics}"},
                    "health": {"healthProbeBindAddress": f"127.0.0.1:{health}"},
                }
            )
        )
        self.spawn(
            "jobset-controller",
            [
                str(self.plane.assets / BINARY),
                f"--kubeconfig={self.plane.client_kubeconfig('jobset-controller')}",
                f"--config={config}",
                "--zap-log-level=info",
            ],
        )
        self.wait("jobset-controller /readyz", lambda: _ok(f"http://127.0.0.1:{health}/readyz"))
        self.plane.apply(_webhooks(f"https://127.0.0.1:{webhook}", (pki / "ca.crt").read_bytes()))
        # The API server reads webhook configurations from its watch: a JobSet created before then skips them.
        self.wait("the webhooks to admit JobSets", self._webhooks_answer)
        return self

    def _webhooks_answer(self) -> bool:
        probe = {
            "apiVersion": "jobset.x-k8s.io/v1alpha2",
            "kind": "JobSet",
            "metadata": {"name": "probe", "namespace": "default"},
            "spec": {"replicatedJobs": [{"name": "w", "template": {"spec": {"template": {"spec": {
                "restartPolicy": "Never", "containers": [{"name": "c", "image": "i"}]}}}}}]},
        }  # fmt: skip
        code, answer = self.plane.request(
            "POST", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/default/jobsets?dryRun=All", probe
        )
        # The mutating webhook fills in the defaults: answered by the controller, not by the schema alone.
        return code == 201 and "successPolicy" in answer.get("spec", {})

    def stop(self) -> None:
        """The controller ended and its webhooks removed: with `failurePolicy: Fail`, JobSets would be refused after."""
        for kind in ("mutating", "validating"):
            self.plane.kubectl(
                "delete",
                f"{kind}webhookconfiguration",
                f"jobset-{kind}-webhook-configuration",
                "--ignore-not-found",
                check=False,
            )
        for process in self.processes.values():
            process.terminate()
        for process in self.processes.values():
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as answer:
        return bool(answer.status == 200)


def _webhooks(url: str, ca: bytes) -> list[dict]:
    """JobSet's webhook configurations (its config/webhook manifests), pointed at `url`."""
    bundle = base64.b64encode(ca).decode()

    def hook(kind: str, verb: str, group: str, version: str, resource: str, operations: list[str]) -> dict:
        path_group = group.replace(".", "-")
        webhook = {
            "name": f"{verb[0]}{kind}.kb.io",
            "admissionReviewVersions": ["v1"],
            "clientConfig": {"url": f"{url}/{verb}-{path_group}-{version}-{kind}", "caBundle": bundle},
            "failurePolicy": "Fail",
            "sideEffects": "None",
            "rules": [
                {"apiGroups": [group], "apiVersions": [version], "operations": operations, "resources": [resource]}
            ],
        }
        if kind == "pod":
            webhook["objectSelector"] = {
                "matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]
            }
        return webhook

    return [
        {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": f"{kind}WebhookConfiguration",
            "metadata": {"name": f"jobset-{kind.lower()}-webhook-configuration"},
            "webhooks": [
                hook(
                    name,
                    verb,
                    group,
                    version,
                    resource,
                    ["CREATE"] if name == "pod" or verb == "mutate" else ["CREATE", "UPDATE"],
                )
                for name, group, version, resource in JOBSET_WEBHOOKS
            ],
        }
        for kind, verb in (("Mutating", "mutate"), ("Validating", "validate"))
    ]


def started(plane: ControlPlane, workdir: Path) -> JobSetController:
    controller = JobSetController(plane, workdir)
    try:
        return controller.start()
    except Exception:
        controller.stop()
        raise
