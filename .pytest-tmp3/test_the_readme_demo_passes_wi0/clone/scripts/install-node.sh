#!/usr/bin/env bash
# What the end-to-end tier's node needs (tests/kube_node.py), on Debian bookworm (the tier runs as root; without
# root the packages come with sudo):
# containerd, runc, the CNI plugins, iptables and conntrack from Debian (no service is started), and
# the kubelet, kube-scheduler, kube-proxy (scripts/install-k8s.sh) plus CoreDNS, the Kubeflow Training
# Operator controller and the pause binary from ../shared/k8s's extras, all into .tools/k8s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-k8s.sh >/dev/null
SHARED_K8S=${SHARED_K8S:-../shared/k8s}
TARGET=.tools/k8s
source scripts/lib/packages.sh
need_commands containerd runc ctr=containerd iptables conntrack /usr/lib/cni/bridge=containernetworking-plugins
if [ ! -x "$TARGET/coredns" ] || [ ! -x "$TARGET/training-operator" ] || [ ! -x "$TARGET/pause" ]; then
  tar -xJf "$SHARED_K8S"/extras-linux-amd64.tar.xz -C "$TARGET"
fi
echo "node: $(containerd --version | cut -d' ' -f3) runc $(runc --version | head -1 | cut -d' ' -f3)," \
  "$("$TARGET/kubelet" --version), coredns, training-operator, pause in $TARGET"
