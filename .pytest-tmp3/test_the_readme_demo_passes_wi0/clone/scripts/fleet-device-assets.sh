#!/usr/bin/env bash
# What benchmarks/fleet_suite.py needs on a device machine (16 cores, no registry, no Kubernetes): the wheels of
# scripts/gpu-wheels.sh in .whl/, and etcd, kube-apiserver, kube-controller-manager and kubectl from
# $KUBEBUILDER_ASSETS (.tools/k8s by default: `bash scripts/install-test-tools.sh`) compressed by xz into .k8s-xz/
# (both ignored by git), with this machine's openssl beside them (the control plane's certificates are made with it,
# and a device machine may lack it; it needs libssl.so.3 there). Compressed they are 51 MB, where the four binaries
# are 264 MB and a call carries 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
assets="${KUBEBUILDER_ASSETS:-.tools/k8s}"
bash scripts/gpu-wheels.sh
grep -qx '/.k8s-xz/' .git/info/exclude || echo '/.k8s-xz/' >> .git/info/exclude
mkdir -p .k8s-xz
for name in etcd kube-apiserver kube-controller-manager kubectl; do
  if [ ! -x "$assets/$name" ]; then
    echo "no $assets/$name: bash scripts/install-test-tools.sh, or set KUBEBUILDER_ASSETS" >&2
    exit 1
  fi
  if [ ! -s ".k8s-xz/$name.xz" ] || [ "$assets/$name" -nt ".k8s-xz/$name.xz" ]; then
    xz -9e -T2 -c "$assets/$name" > ".k8s-xz/$name.xz.part" && mv ".k8s-xz/$name.xz.part" ".k8s-xz/$name.xz"
  fi
done
cp "$(command -v openssl)" .k8s-xz/openssl
du -ch .whl .k8s-xz | tail -1
