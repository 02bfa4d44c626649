#!/usr/bin/env bash
# What the end-to-end tier's node needs (tests/kube_node.py), as root on Debian bookworm:
# containerd, runc, the CNI plugins, iptables and conntrack from Debian (no service is started), and
# the kubelet, kube-scheduler, kube-proxy (scripts/install-k8s.sh) plus CoreDNS, the Kubeflow Training
# Operator controller and the pause binary from ../shared/k8s's extras, all into .tools/k8s.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-k8s.sh >/dev/null
SHARED_K8S=${SHARED_K8S:-../shared/k8s}
TARGET=.tools/k8s
need=()
for tool in containerd runc ctr iptables conntrack; do command -v "$tool" >/dev/null || need+=("$tool"); done
[ -x /usr/lib/cni/bridge ] || need+=(cni)
if [ ${#need[@]} -gt 0 ]; then
  SUDO=$([ "$(id -u)" = 0 ] && echo "" || echo "sudo")
  $SUDO apt-get update -qq
  # policy-rc.d: install containerd without starting it (the tier starts its own, with its own config).
  had_policy=0; [ -e /usr/sbin/policy-rc.d ] && had_policy=1
  [ $had_policy = 1 ] || printf '#!/bin/sh\nexit 101\n' | $SUDO tee /usr/sbin/policy-rc.d >/dev/null
  $SUDO chmod +x /usr/sbin/policy-rc.d
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends containerd runc \
    containernetworking-plugins iptables conntrack >/dev/null
  [ $had_policy = 1 ] || $SUDO rm -f /usr/sbin/policy-rc.d
fi
if [ ! -x "$TARGET/coredns" ] || [ ! -x "$TARGET/training-operator" ] || [ ! -x "$TARGET/pause" ]; then
  tar -xJf "$SHARED_K8S"/extras-linux-amd64.tar.xz -C "$TARGET"
fi
echo "node: $(containerd --version | cut -d' ' -f3) runc $(runc --version | head -1 | cut -d' ' -f3)," \
  "$("$TARGET/kubelet" --version), coredns, training-operator, pause in $TARGET"
