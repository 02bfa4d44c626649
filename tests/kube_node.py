"""A single Kubernetes node beside a test ControlPlane (tests/kube_cluster.py): pods run for real.

containerd + runc (Debian's packages), the kubelet, kube-scheduler and kube-proxy (iptables mode) from
$KUBEBUILDER_ASSETS, a bridge CNI for pods (10.244.0.0/24), and CoreDNS on the host as the cluster DNS
(Service kube-system/kube-dns, 10.96.0.10). No registry is reachable here: images are imported into
containerd's `k8s.io` namespace from OCI archives (scripts/e2e-images.sh writes them) and pods use
local names. Follows ../shared/k8s/README.md ("A node that runs pods"), including two quirks of
these VMs: containerd must clamp oom_score_adj (`restrict_oom_score_adj`: no CAP_SYS_RESOURCE here),
and the kubelet must be told that cgroup v1 is fine.

The node changes the host (an address on `lo`, a bridge, iptables chains, sysctls, mounts below
/var/lib/kubelet): it needs root, runs one at a time, and `stop()` puts all of it back. Its fixed
addresses are those of the recipe so a leftover from a crashed run is recognisable.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import grpc
import yaml

from kube_cluster import ControlPlane, ProcessGroup

NODE_NAME = "e2e-node"
NODE_IP = "10.250.0.1"
POD_CIDR = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"
DNS_SERVICE_IP = "10.96.0.10"
PAUSE_IMAGE = "localhost/k8s-test/pause:3.10"
CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
#: Host packages the node needs (Debian bookworm); scripts/install-node.sh installs them.
HOST_TOOLS = ("containerd", "runc", "ctr", "iptables", "iptables-save", "iptables-restore", "conntrack")
NODE_BINARIES = ("kubelet", "kube-scheduler", "kube-proxy", "coredns")
SYSCTLS = ("net.ipv4.ip_forward", "net.bridge.bridge-nf-call-iptables")
HOW_TO_GET = "run `bash scripts/install-node.sh` as root (Debian packages + ../shared/k8s extras into .tools/k8s)"


def missing_for_node(assets: Optional[str]) -> list[str]:
    missing = [tool for tool in HOST_TOOLS if not shutil.which(tool)]
    if not os.path.exists("/usr/lib/cni/bridge"):
        missing.append("/usr/lib/cni/bridge (containernetworking-plugins)")
    missing += [b for b in NODE_BINARIES if not assets or not os.access(Path(assets) / b, os.X_OK)]
    if os.geteuid() != 0:
        missing.append("root")
    return missing


def _run(*args: str, check: bool = True, input: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, check=check, input=input, timeout=120)


def containerd_config(cni_dir: Path) -> str:
    return f"""version = 2
root = "/var/lib/containerd"
state = "/run/containerd"
[grpc]
  address = "{CONTAINERD_SOCKET}"
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{PAUSE_IMAGE}"
    disable_apparmor = true
    # No CAP_SYS_RESOURCE in these VMs: runc cannot lower oom_score_adj, so clamp it to containerd's own.
    restrict_oom_score_adj = true
    enable_selinux = false
    [plugins."io.containerd.grpc.v1.cri".containerd]
      snapshotter = "overlayfs"
      default_runtime_name = "runc"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = false
    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "{cni_dir}"
      max_conf_num = 1
"""


def cni_config(ipam_dir: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": "e2e-pods",
        "plugins": [
            {
                "type": "bridge",
                "bridge": "cni0",
                "isGateway": True,
                "ipMasq": False,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "dataDir": str(ipam_dir),
                    "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(pki: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "tlsCertFile": str(pki / "kubelet-serving.crt"),
        "tlsPrivateKeyFile": str(pki / "kubelet-serving.key"),
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "cgroupDriver": "cgroupfs",
        "failCgroupV1": False,  # these VMs have cgroup v1 only; kubelet >= 1.35 refuses it unless told
        "failSwapOn": False,
        "clusterDNS": [DNS_SERVICE_IP],
        "clusterDomain": "cluster.local",
        "resolvConf": "",  # no upstream DNS here
        "serializeImagePulls": False,
        # Images are imported by hand: never garbage-collect them.
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "1%",
            "nodefs.inodesFree": "1%",
            "imagefs.available": "1%",
        },
        "rotateCertificates": False,
        "serverTLSBootstrap": False,
        # Quick status so tests see pods and nodes change within seconds.
        "syncFrequency": "5s",
        "nodeStatusUpdateFrequency": "5s",
        "fileCheckFrequency": "5s",
    }


def kube_proxy_config(kubeconfig_path: Path) -> dict[str, Any]:
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig_path)},
        "hostnameOverride": NODE_NAME,
        "mode": "iptables",
        "clusterCIDR": POD_CIDR,
        "bindAddress": "127.0.0.1",
        "healthzBindAddress": "127.0.0.1:10256",
        "metricsBindAddress": "127.0.0.1:10249",
        "nodePortAddresses": [f"{NODE_IP}/32"],
        "conntrack": {"maxPerCore": 0, "min": 0},  # leave the host's conntrack sysctls alone
        "iptables": {"syncPeriod": "30s", "minSyncPeriod": "0s"},
    }


def corefile(dns_kubeconfig: Path) -> str:
    return f"""cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {{
    bind {NODE_IP}
    errors
    ready 127.0.0.1:18181
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {dns_kubeconfig}
        pods insecure
        ttl 5
    }}
    cache 5
}}
"""


def cluster_dns_objects() -> list[dict[str, Any]]:
    """The DNS server's read access, and Service kube-system/kube-dns pointing at it on the host."""
    return [
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "e2e-dns"},
            "rules": [
                {
                    "apiGroups": [""],
                    "resources": ["services", "endpoints", "pods", "namespaces"],
                    "verbs": ["get", "list", "watch"],
                },
                {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["get", "list", "watch"]},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "e2e-dns"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "e2e-dns"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "e2e-dns"}],
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
            "spec": {
                "clusterIP": DNS_SERVICE_IP,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53},
                ],
            },
        },
        {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "kube-dns-host",
                "namespace": "kube-system",
                "labels": {
                    "kubernetes.io/service-name": "kube-dns",
                    "endpointslice.kubernetes.io/managed-by": "trainingrun-e2e",
                },
            },
            "addressType": "IPv4",
            "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}, "nodeName": NODE_NAME}],
            "ports": [
                {"name": "dns", "port": 53, "protocol": "UDP"},
                {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
            ],
        },
    ]


def _without_our_chains(dump: str) -> str:
    """An iptables-save dump less the chains kube-proxy, the kubelet and CNI plugins make (KUBE-*, CNI-*)
    and every rule in or jumping to them; everyone else's rules stay."""
    ours = re.compile(r"^(KUBE-|CNI-)")
    kept = []
    for line in dump.splitlines():
        if line.startswith(":") and ours.match(line[1:]):
            continue
        if line.startswith("-A "):
            parts = line.split()
            target = next((parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("-j", "-g")), "")
            if ours.match(parts[1]) or ours.match(target):
                continue
        kept.append(line)
    return "\n".join(kept) + "\n"


@dataclass
class Node(ProcessGroup):
    """The node's processes beside `plane` (started with `node_address=NODE_IP`); `start()`, `stop()`."""

    plane: ControlPlane
    workdir: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    _sysctls_before: dict[str, str] = field(default_factory=dict)

    def start(self) -> "Node":
        started = time.monotonic()
        self.workdir.mkdir(parents=True, exist_ok=True)
        pki = self.plane.pki
        self._cleanup_host()  # whatever a crashed run left
        _run("ip", "addr", "add", f"{NODE_IP}/32", "dev", "lo")
        for key in SYSCTLS:
            self._sysctls_before[key] = _run("sysctl", "-n", key).stdout.strip()
            _run("sysctl", "-qw", f"{key}=1")

        cni_dir = self.workdir / "cni"
        cni_dir.mkdir(exist_ok=True)
        (cni_dir / "10-e2e.conflist").write_text(json.dumps(cni_config(self.workdir / "ipam"), indent=1))
        (self.workdir / "containerd.toml").write_text(containerd_config(cni_dir))
        Path("/run/containerd").mkdir(parents=True, exist_ok=True)
        self.spawn("containerd", ["/usr/bin/containerd", "--config", str(self.workdir / "containerd.toml")])
        # The socket answers before the CRI plugin has finished starting, and the kubelet exits on
        # "server is not initialized yet": wait for the call the kubelet makes first.
        self.wait("containerd's CRI service", self._cri_serving)

        kubeconfigs = {
            name: self.plane.client_kubeconfig(name) for name in ("scheduler", "kube-proxy", "kubelet-client", "dns")
        }
        self.spawn(
            "kube-scheduler",
            [
                str(self.plane.assets / "kube-scheduler"),
                f"--kubeconfig={kubeconfigs['scheduler']}",
                f"--authentication-kubeconfig={kubeconfigs['scheduler']}",
                f"--authorization-kubeconfig={kubeconfigs['scheduler']}",
                "--bind-address=127.0.0.1",
                "--secure-port=10259",
                "--leader-elect=false",
                "--v=1",
            ],
        )
        (self.workdir / "kubelet.yaml").write_text(yaml.safe_dump(kubelet_config(pki)))
        Path("/var/lib/kubelet").mkdir(parents=True, exist_ok=True)
        self.spawn(
            "kubelet",
            [
                str(self.plane.assets / "kubelet"),
                f"--config={self.workdir / 'kubelet.yaml'}",
                f"--kubeconfig={kubeconfigs['kubelet-client']}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={NODE_IP}",
                "--v=1",
            ],
        )
        (self.workdir / "kube-proxy.yaml").write_text(yaml.safe_dump(kube_proxy_config(kubeconfigs["kube-proxy"])))
        self.spawn(
            "kube-proxy",
            [str(self.plane.assets / "kube-proxy"), f"--config={self.workdir / 'kube-proxy.yaml'}", "--v=1"],
        )
        self.plane.apply(cluster_dns_objects())
        (self.workdir / "Corefile").write_text(corefile(kubeconfigs["dns"]))
        self.spawn("coredns", [str(self.plane.assets / "coredns"), "-conf", str(self.workdir / "Corefile")])

        self.wait("kubelet /healthz", lambda: self._http_ok("http://127.0.0.1:10248/healthz"))
        self.wait("kube-proxy /healthz", lambda: self._http_ok("http://127.0.0.1:10256/healthz"))
        self.wait("CoreDNS /ready", lambda: self._http_ok("http://127.0.0.1:18181/ready"))
        self.wait(f"node {NODE_NAME} Ready", self._node_ready)
        self.startup_seconds = time.monotonic() - started
        return self

    # ------------------------------------------------------------ using it

    def ctr(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return _run("ctr", "--address", CONTAINERD_SOCKET, "-n", "k8s.io", *args, check=check)

    def import_image(self, archive: Path, name: str) -> None:
        """Load an OCI archive (podman save --format oci-archive) into the node under `name`."""
        # containerd's store outlives the node: an older build goes first, and synchronously: removed with the garbage
        # collection that follows in the background, the blobs the import found present (the same layer, built again)
        # went from under it ("content digest ... not found", seen in a clean-clone CI run).
        # A node started after another on this host can still miss a blob its store lists (seen importing the same
        # archive into the second node of a CI run, after the first had taken it): the blob's record is removed, so
        # that the next import writes it from the archive, and the import is tried again, at most twice.
        said = []
        for _ in range(3):
            self.ctr("images", "rm", "--sync", name, check=False)
            imported = self.ctr("images", "import", "--index-name", name, str(archive), check=False)
            said.append(imported.stderr.strip())
            missing = re.search(r"content digest (sha256:[0-9a-f]{64}): not found", imported.stderr)
            if imported.returncode == 0 or not missing:
                break
            self.ctr("content", "rm", missing.group(1), check=False)
            # the CRI's references by image id (`sha256:<config>`) pin an older build's records too
            stale = [ref for ref in self.ctr("images", "ls", "-q").stdout.split() if ref.startswith("sha256:")]
            if stale:
                self.ctr("images", "rm", "--sync", *stale, check=False)
        assert imported.returncode == 0, f"ctr images import {archive}: {' / '.join(said)}"
        listed = self.ctr("images", "ls", "-q").stdout.split()
        assert name in listed, f"{archive} imported, but containerd has no image {name}: {listed}"

    # ------------------------------------------------------------ stopping

    def stop(self) -> None:
        """Pods first (so CNI and the kubelet tear them down while the API is up), then the processes,
        then what the node changed on the host."""
        scheduler = self.processes.pop("kube-scheduler", None)
        self._terminate(scheduler)
        if self._alive("kubelet"):
            self.plane.kubectl(
                "delete",
                "pods",
                "--all",
                "--all-namespaces",
                "--grace-period=0",
                "--force",
                "--wait=false",
                check=False,
            )
            deadline = time.monotonic() + 20
            while self.ctr("tasks", "ls", "-q", check=False).stdout.strip() and time.monotonic() < deadline:
                time.sleep(0.2)
        self._terminate(self.processes.pop("kubelet", None))
        if self._alive("containerd"):
            for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
                self.ctr("tasks", "delete", "-f", task, check=False)
            for container in self.ctr("containers", "ls", "-q", check=False).stdout.split():
                self.ctr("containers", "delete", container, check=False)
        for name in list(self.processes):
            self._terminate(self.processes.pop(name))
        self._cleanup_host()
        for key, value in self._sysctls_before.items():
            _run("sysctl", "-qw", f"{key}={value}", check=False)

    def _cleanup_host(self) -> None:
        for shim_pid in Path("/run/containerd/io.containerd.runtime.v2.task/k8s.io").glob("*/shim.pid"):
            try:
                os.kill(int(shim_pid.read_text()), 9)
            except (ValueError, ProcessLookupError):
                pass
        mounts = [line.split()[1] for line in Path("/proc/mounts").read_text().splitlines()]
        for mount in sorted(
            (
                m
                for m in mounts
                if m.startswith(("/var/lib/kubelet/", "/run/containerd/io.containerd", "/run/netns/cni-"))
            ),
            reverse=True,
        ):
            _run("umount", "-l", mount, check=False)
        for leftover in Path("/run/netns").glob("cni-*"):
            leftover.unlink(missing_ok=True)
        shutil.rmtree("/var/lib/kubelet/pods", ignore_errors=True)
        shutil.rmtree("/run/containerd/io.containerd.runtime.v2.task/k8s.io", ignore_errors=True)
        _run("ip", "link", "del", "cni0", check=False)
        _run("ip", "addr", "del", f"{NODE_IP}/32", "dev", "lo", check=False)
        dump = _run("iptables-save", check=False).stdout
        if re.search(r"(KUBE-|CNI-)", dump):
            _run("iptables-restore", input=_without_our_chains(dump), check=False)
        for args in (("-d", "10.96.0.0/16"), ("-s", POD_CIDR), ("-d", POD_CIDR)):
            _run("conntrack", "-D", *args, check=False)
        for cgroup in Path("/sys/fs/cgroup").glob("*/kubepods"):
            for folder in sorted((p for p in cgroup.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                try:
                    folder.rmdir()
                except OSError:
                    pass

    # ------------------------------------------------------------ helpers

    def _alive(self, component: str) -> bool:
        process = self.processes.get(component)
        return process is not None and process.poll() is None

    @staticmethod
    def _terminate(process: Optional[subprocess.Popen]) -> None:
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    @staticmethod
    def _cri_serving() -> bool:
        """RuntimeService.Version answers (an empty VersionRequest is zero bytes; the reply is not parsed)."""
        with grpc.insecure_channel(f"unix://{CONTAINERD_SOCKET}") as channel:
            version = channel.unary_unary("/runtime.v1.RuntimeService/Version")
            try:
                version(b"", timeout=2)
            except grpc.RpcError:
                return False
            return True

    @staticmethod
    def _http_ok(url: str) -> bool:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200

    def _node_ready(self) -> bool:
        code, node = self.plane.request("GET", f"/api/v1/nodes/{NODE_NAME}")
        conditions = (node.get("status") or {}).get("conditions") or [] if code == 200 else []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)
