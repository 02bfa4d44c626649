#!/usr/bin/env bash
# Unpacks the real Kubernetes binaries (etcd, kube-apiserver, kube-controller-manager, kubectl, ...) and the JobSet
# controller (jobset-controller v0.9.1) that ../shared/k8s ships into .tools/k8s, for the real-API test tier
# (tests/real_api/). Point
# KUBEBUILDER_ASSETS at .tools/k8s (`make test` does when it exists), or at any folder with the same binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED_K8S=${SHARED_K8S:-../shared/k8s}
TARGET=.tools/k8s
if [ -x "$TARGET/kube-apiserver" ] && [ -x "$TARGET/kube-controller-manager" ] && [ -x "$TARGET/jobset-controller" ]; then
  "$TARGET/kube-apiserver" --version
  exit 0
fi
archive=$(ls "$SHARED_K8S"/kubernetes-v*-linux-amd64.tar.xz 2>/dev/null | head -1 || true)
if [ -z "$archive" ]; then
  echo "install-k8s.sh: no $SHARED_K8S/kubernetes-v*-linux-amd64.tar.xz; set SHARED_K8S to its folder" >&2
  exit 1
fi
source scripts/lib/packages.sh
need_commands openssl xz=xz-utils  # openssl makes the test PKI
mkdir -p "$TARGET"
tar -xJf "$archive" -C "$TARGET"
jobset=$(ls "$SHARED_K8S"/jobset-v*-linux-amd64.tar.xz 2>/dev/null | head -1 || true)
if [ -z "$jobset" ]; then
  echo "install-k8s.sh: no $SHARED_K8S/jobset-v*-linux-amd64.tar.xz; set SHARED_K8S to its folder" >&2
  exit 1
fi
tar -xJf "$jobset" -C "$TARGET" jobset-controller
"$TARGET/kube-apiserver" --version
