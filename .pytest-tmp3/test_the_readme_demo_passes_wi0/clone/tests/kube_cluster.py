"""A real Kubernetes control plane for tests: etcd, kube-apiserver and kube-controller-manager.

The binaries come from the folder named by KUBEBUILDER_ASSETS (the envtest convention): `.ci/run`
unpacks ../shared/k8s/kubernetes-v1.36.2-linux-amd64.tar.xz there; `setup-envtest` folders work
too once kube-controller-manager is added beside them. Everything runs on free loopback ports with a
fresh data and PKI folder, RBAC on (`Node,RBAC`), ServiceAccount tokens signed, and the controller
manager running the garbage collector and the ServiceAccount controllers, so tests see what a
cluster does: defaults checked against CEL rules, strict field validation, RBAC escalation checks,
ownerReferences cascading, status subresource semantics, Pod admission (`dryRun=All`).

Used by the session fixture `kube_cluster` (tests/conftest.py) and by benchmarks/operator_reconcile.py.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import yaml

ASSETS_ENV = "KUBEBUILDER_ASSETS"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kubectl")
HOW_TO_GET = (
    f"set {ASSETS_ENV} to a folder with {', '.join(BINARIES)}: `bash scripts/install-test-tools.sh` "
    "puts them in .tools/k8s, which `make test` uses"
)
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"
READY_TIMEOUT_SECONDS = 120


def missing_binaries(assets: Optional[str]) -> list[str]:
    if not assets:
        return list(BINARIES)
    return [b for b in BINARIES if not os.access(Path(assets) / b, os.X_OK)]


#: Kubeflow Training Operator v1.9.0's PyTorchJob CRD, relative to the repository.
PYTORCHJOB_CRD = Path("tests/fixtures/kubeflow.org_pytorchjobs.v1.9.0.yaml")
JOBSET_CRD = Path("tests/fixtures/jobset.x-k8s.io_jobsets.v0.9.1.yaml")


def started_for_benchmark(workdir: Path) -> "ControlPlane":
    """A control plane from $KUBEBUILDER_ASSETS with the CRDs installed; a benchmark without the binaries exits saying
    how to get them."""
    assets = os.environ.get(ASSETS_ENV)
    missing = missing_binaries(assets)
    if missing:
        raise SystemExit(f"needs {', '.join(missing)}: {HOW_TO_GET}")
    plane = ControlPlane(Path(str(assets)), workdir / "cluster").start()
    try:
        return plane.install_crds()
    except BaseException:
        plane.stop()
        raise


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def sign_certificate(folder: Path, name: str, subject: str, usage: str, sans: str = "") -> None:
    """`<name>.crt` and `<name>.key` in `folder`, signed by its CA (`ca.crt`, `ca.key`) for `usage` (serverAuth,
    clientAuth) with the subject alternative names `sans`."""
    _openssl(
        "req",
        "-new",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        "-subj",
        subject,
        cwd=folder,
    )
    ext = [
        "basicConstraints=CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ] + ([f"subjectAltName={sans}"] if sans else [])
    (folder / f"{name}.ext").write_text("\n".join(ext) + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        f"{name}.crt",
        "-days",
        "30",
        "-extfile",
        f"{name}.ext",
        cwd=folder,
    )


def make_pki(folder: Path, node: Optional[tuple[str, str]] = None) -> None:
    """A CA, the API server's serving certificate, client certificates for the admin (system:masters)
    and the controller manager, and the ServiceAccount token key pair; with `node` (its name and
    address) also the node's: the kubelet's client and serving certificates, the scheduler's,
    kube-proxy's, the DNS server's and the API server's client certificate for kubelets."""
    folder.mkdir(parents=True, exist_ok=True)
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "30",
        "-subj",
        "/CN=trainingrun-test-ca",
        cwd=folder,
    )

    def sign(name: str, subject: str, usage: str, sans: str = "") -> None:
        sign_certificate(folder, name, subject, usage, sans)

    node_ip = f",IP:{node[1]}" if node else ""
    sign(
        "apiserver",
        "/CN=kube-apiserver",
        "serverAuth",
        "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,"
        f"DNS:localhost,IP:127.0.0.1,IP:10.96.0.1{node_ip}",
    )
    sign("admin", "/O=system:masters/CN=kubernetes-admin", "clientAuth")
    sign("controller-manager", "/CN=system:kube-controller-manager", "clientAuth")
    if node:
        name, address = node
        sign("kubelet-client", f"/O=system:nodes/CN=system:node:{name}", "clientAuth")
        sign(
            "kubelet-serving",
            f"/O=system:nodes/CN=system:node:{name}",
            "serverAuth",
            f"DNS:{name},DNS:localhost,IP:127.0.0.1,IP:{address}",
        )
        sign("scheduler", "/CN=system:kube-scheduler", "clientAuth")
        sign("kube-proxy", "/CN=system:kube-proxy", "clientAuth")
        sign("dns", "/CN=e2e-dns", "clientAuth")
        sign("apiserver-kubelet-client", "/O=system:masters/CN=kube-apiserver-kubelet-client", "clientAuth")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=folder)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=folder)


def kubeconfig(server: str, ca_file: Path, user: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "test",
        "clusters": [
            {
                "name": "test",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca_file.read_bytes()).decode(),
                },
            }
        ],
        "users": [{"name": "test", "user": user}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
    }


class ProcessGroup:
    """Background processes of a test cluster, each logging to `<workdir>/<component>.log`: started by
    `spawn`, awaited by `wait` (which fails at once, with the log's tail, when one of them dies)."""

    workdir: Path
    processes: dict[str, subprocess.Popen]

    def log(self, component: str) -> Path:
        return self.workdir / f"{component}.log"

    def spawn(self, component: str, argv: list[str]) -> None:
        with open(self.log(component), "wb") as log:
            # A session of its own: a test killed by Ctrl-C does not take the servers with it mid-write.
            self.processes[component] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def wait(self, what: str, ready: Any) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while True:
            for component, process in self.processes.items():
                if process.poll() is not None:
                    raise RuntimeError(
                        f"{component} exited with {process.returncode} while waiting for {what}:\n"
                        + self.tail(component)
                    )
            try:
                if ready():
                    return
            except OSError:  # not listening yet (URLError and SSLError are OSErrors too)
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"timed out after {READY_TIMEOUT_SECONDS}s waiting for {what}:\n"
                    + "\n".join(self.tail(c) for c in self.processes)
                )
            time.sleep(0.1)

    def tail(self, component: str, lines: int = 40) -> str:
        path = self.log(component)
        text = path.read_text(errors="replace").splitlines()[-lines:] if path.exists() else []
        return f"--- {component} ---\n" + "\n".join(text)


@dataclass
class ControlPlane(ProcessGroup):
    """One etcd + kube-apiserver + kube-controller-manager, started by `start()`, ended by `stop()`."""

    assets: Path
    workdir: Path
    #: (name, address) of a node that will join (tests/kube_node.py): the API server then listens on
    #: every address and advertises this one, which pods reach through the `kubernetes` Service.
    node: Optional[tuple[str, str]] = None
    server: str = ""
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _contexts: dict[bool, ssl.SSLContext] = field(default_factory=dict, repr=False)

    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    def start(self) -> "ControlPlane":
        started = time.monotonic()
        make_pki(self.pki, self.node)
        etcd_port, etcd_peer, api_port, kcm_port = free_port(), free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{api_port}"
        pki = self.pki
        self.spawn(
            "etcd",
            [
                str(self.assets / "etcd"),
                "--name",
                "test",
                "--data-dir",
                str(self.workdir / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--advertise-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
                "--initial-cluster",
                f"test=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ],
        )
        node_flags = (
            [
                "--bind-address=0.0.0.0",
                f"--advertise-address={self.node[1]}",
                f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                "--kubelet-preferred-address-types=InternalIP",
            ]
            if self.node
            else ["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"]
        )
        self.spawn(
            "kube-apiserver",
            [
                str(self.assets / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                f"--secure-port={api_port}",
                *node_flags,
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=Node,RBAC",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-account-issuer={SERVICE_ACCOUNT_ISSUER}",
                "--enable-bootstrap-token-auth=false",
                "--profiling=false",
                "--v=1",
            ],
        )
        self.client_kubeconfig("admin")
        self.wait("kube-apiserver /readyz", lambda: self.get_raw("/readyz") == "ok")
        kcm_config = self.client_kubeconfig("controller-manager")
        self.spawn(
            "kube-controller-manager",
            [
                str(self.assets / "kube-controller-manager"),
                f"--kubeconfig={kcm_config}",
                f"--authentication-kubeconfig={kcm_config}",
                f"--authorization-kubeconfig={kcm_config}",
                "--bind-address=127.0.0.1",
                f"--secure-port={kcm_port}",
                "--leader-elect=false",
                "--use-service-account-credentials=true",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--controllers=*",
                "--concurrent-gc-syncs=5",
                "--profiling=false",
                "--v=1",
            ],
        )
        # The default ServiceAccount appears once the controllers run (the garbage collector with them).
        self.wait(
            "the default ServiceAccount",
            lambda: self.kubectl("-n", "default", "get", "serviceaccount", "default", check=False).returncode == 0,
        )
        self.startup_seconds = time.monotonic() - started
        return self

    def client_kubeconfig(self, certificate: str) -> Path:
        """A kubeconfig that authenticates with the PKI's client certificate `certificate`."""
        path = self.workdir / f"{certificate}.kubeconfig"
        path.write_text(
            yaml.safe_dump(
                kubeconfig(
                    self.server,
                    self.pki / "ca.crt",
                    {
                        "client-certificate-data": base64.b64encode(
                            (self.pki / f"{certificate}.crt").read_bytes()
                        ).decode(),
                        "client-key-data": base64.b64encode((self.pki / f"{certificate}.key").read_bytes()).decode(),
                    },
                )
            )
        )
        return path

    def stop(self) -> None:
        for component in ("kube-controller-manager", "kube-apiserver", "etcd"):
            process = self.processes.pop(component, None)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        shutil.rmtree(self.workdir / "etcd", ignore_errors=True)

    # ------------------------------------------------------------ talking to it

    def ssl_context(self, admin: bool = True) -> ssl.SSLContext:
        """TLS to the API server (as the admin, by client certificate, unless `admin` is False); made once."""
        if admin not in self._contexts:
            context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
            if admin:
                context.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
            self._contexts[admin] = context
        return self._contexts[admin]

    def get_raw(self, path: str) -> str:
        with urllib.request.urlopen(self.server + path, context=self.ssl_context(), timeout=5) as response:
            return response.read().decode()

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        token: Optional[str] = None,
        content_type: str = "application/json",
    ) -> tuple[int, dict[str, Any]]:
        """One API call as the admin (or as the holder of `token`): (status code, decoded answer)."""
        context = self.ssl_context(admin=not token)
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.server + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, context=context, timeout=30) as response:
                return response.status, json.loads(response.read() or b"{}")
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")

    def kubectl(
        self, *args: str, input: Optional[str] = None, check: bool = True, kubeconfig_file: Optional[Path] = None
    ) -> subprocess.CompletedProcess:
        command = [str(self.assets / "kubectl"), f"--kubeconfig={kubeconfig_file or self.admin_kubeconfig}", *args]
        result = subprocess.run(command, input=input, capture_output=True, text=True, timeout=120)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result

    def apply(self, documents: Any, *extra: str) -> subprocess.CompletedProcess:
        text = documents if isinstance(documents, str) else yaml.safe_dump_all(list(documents))
        return self.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", *extra, input=text)

    def operator_env(self) -> dict[str, str]:
        """The environment of an operator process logged in as the cluster's admin, without its HTTP ports."""
        return {
            **os.environ,
            "KUBECONFIG": str(self.admin_kubeconfig),
            "TRAININGRUN_OPERATOR_METRICS_PORT": "0",
            "TRAININGRUN_OPERATOR_HEALTH_PORT": "0",
        }

    def install_crds(self) -> "ControlPlane":
        """The project's CRDs (kopf's peering ones included), Kubeflow's PyTorchJob CRD and JobSet's, as a user would
        install them (`kubectl apply --server-side`), once served."""
        repo = Path(__file__).resolve().parent.parent
        crds = repo / "manifests" / "crds"
        self.kubectl(
            "apply", "--server-side", "-f", str(crds), "-f", str(repo / PYTORCHJOB_CRD), "-f", str(repo / JOBSET_CRD)
        )
        for name in (
            "trainingruns.trainingrun.dev",
            "pytorchjobs.kubeflow.org",
            "jobsets.jobset.x-k8s.io",
            "kopfpeerings.kopf.dev",
        ):
            self.wait_established(name)
        return self

    def wait_established(self, crd_name: str, timeout: float = 60.0) -> None:
        """Until the CRD is served. (`kubectl wait` fails outright when it looks before the CRD has any
        conditions: "status.conditions accessor error".)"""
        deadline = time.monotonic() + timeout
        while True:
            code, crd = self.request("GET", f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{crd_name}")
            conditions = (crd.get("status") or {}).get("conditions") or [] if code == 200 else []
            if any(c["type"] == "Established" and c["status"] == "True" for c in conditions):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"CRD {crd_name} not Established after {timeout}s: {conditions}")
            time.sleep(0.1)

    def create_namespace(self, name: str) -> str:
        self.kubectl("create", "namespace", name)
        return name

    def token(
        self,
        namespace: str,
        service_account: str,
        audience: Optional[str] = None,
        pod: Optional[tuple[str, str]] = None,
    ) -> str:
        """A token of the ServiceAccount (TokenRequest); with `pod` (name, uid), bound to that pod, as the
        kubelet's projected tokens are."""
        args = ["-n", namespace, "create", "token", service_account, "--duration=2h"]
        if audience:
            args.append(f"--audience={audience}")
        if pod:
            args += ["--bound-object-kind=Pod", f"--bound-object-name={pod[0]}", f"--bound-object-uid={pod[1]}"]
        return self.kubectl(*args).stdout.strip()

    def token_kubeconfig(self, path: Path, token: str) -> Path:
        """A kubeconfig that authenticates with `token` only (as a pod's ServiceAccount would)."""
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.pki / "ca.crt", {"token": token})))
        return path


#: (apiVersion, kind) -> plural, for the kinds tests create through `dry_run_create`/`create`.
PLURALS = {
    ("v1", "ConfigMap"): "configmaps",
    ("v1", "Service"): "services",
    ("v1", "ServiceAccount"): "serviceaccounts",
    ("v1", "Pod"): "pods",
    ("v1", "Secret"): "secrets",
    ("v1", "Event"): "events",
    ("rbac.authorization.k8s.io/v1", "Role"): "roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "rolebindings",
    ("kubeflow.org/v1", "PyTorchJob"): "pytorchjobs",
    ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobsets",
    ("batch/v1", "Job"): "jobs",
    ("trainingrun.dev/v1alpha1", "TrainingRun"): "trainingruns",
}


def collection(obj: dict[str, Any], namespace: str) -> str:
    api_version, kind = obj["apiVersion"], obj["kind"]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{PLURALS[(api_version, kind)]}"


def refusal(answer: dict[str, Any]) -> str:
    """The API server's message for a refused request, causes included."""
    causes = [f"{c.get('field', '')}: {c.get('message', '')}" for c in (answer.get("details") or {}).get("causes", [])]
    return "\n".join([answer.get("message", "")] + causes)
