#!/usr/bin/env bash
# The images the end-to-end tier's node runs, as OCI archives in .tools/e2e-images/ (tests/e2e imports
# them into containerd; no registry is reachable here). Run after scripts/build-images.sh, with the same
# BUILD_WORK (its podman storage holds the trainer, the operator and the Debian base image):
#   trainingrun-operator.oci.tar, trainingrun-trainer.oci.tar   our images, as built
#   pause.oci.tar              the pod sandbox (static pause from ../shared/k8s extras)
#   training-operator.oci.tar  the Kubeflow Training Operator v1.9.0 controller (../shared/k8s extras)
#   jobset.oci.tar             the JobSet controller v0.9.1 (.tools/k8s/jobset-controller, from ../shared/k8s), as
#                              user 65532: its Deployment sets runAsNonRoot
#   debian.oci.tar             Kubeflow's init container image: its `nslookup` must succeed on any answer,
#                              which Debian's busybox nslookup does not (a shim over getent instead)
# Names are those ../shared/k8s/recipe/tests/training-operator-standalone.yaml and
# ../shared/k8s/recipe/jobset/jobset-v0.9.1-in-cluster.yaml refer to.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
WORK=${BUILD_WORK:-$PWD/.tools/images}
OUT=${E2E_IMAGES:-$PWD/.tools/e2e-images}
K8S=.tools/k8s
export CONTAINERS_CONF="$WORK/containers.conf" CONTAINERS_STORAGE_CONF="$WORK/storage.conf"
[ -f "$CONTAINERS_STORAGE_CONF" ] || { echo "e2e-images.sh: run scripts/build-images.sh first (BUILD_WORK=$WORK)" >&2; exit 1; }
[ -x "$K8S/pause" ] || { echo "e2e-images.sh: run scripts/install-node.sh first" >&2; exit 1; }
mkdir -p "$OUT"
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

# from_binary NAME BINARY PATH_IN_IMAGE IMAGE [USER]: an image of one static binary (and a /tmp) as its entrypoint
from_binary() {
  local root="$scratch/$1"
  mkdir -p "$root/tmp" && chmod 1777 "$root/tmp"
  cp "$2" "$root$3"
  tar -C "$root" -c . | podman import --quiet --change "ENTRYPOINT [\"$3\"]" --change "USER ${5:-0}" - "$4" >/dev/null
}
from_binary pause "$K8S/pause" /pause localhost/k8s-test/pause:3.10
from_binary training-operator "$K8S/training-operator" /manager localhost/k8s-test/training-operator:v1.9.0
from_binary jobset "$K8S/jobset-controller" /manager localhost/k8s-test/jobset:v0.9.1 65532
printf 'FROM localhost/debian-python:bookworm\nRUN printf "#!/bin/sh\\nexec getent hosts \\"\\$1\\"\\n" > /usr/local/bin/nslookup && chmod 755 /usr/local/bin/nslookup\n' \
  > "$scratch/Containerfile"
podman build --isolation chroot -q -f "$scratch/Containerfile" -t localhost/k8s-test/debian:bookworm "$scratch" >/dev/null

save() {
  rm -f "$OUT/$1.oci.tar"
  podman save --quiet --format oci-archive -o "$OUT/$1.oci.tar" "$2"
  echo "$2 $1.oci.tar" >> "$OUT/images.txt.new"
}
: > "$OUT/images.txt.new"
save pause localhost/k8s-test/pause:3.10
save training-operator localhost/k8s-test/training-operator:v1.9.0
save jobset localhost/k8s-test/jobset:v0.9.1
save debian localhost/k8s-test/debian:bookworm
save trainingrun-operator "localhost/trainingrun-operator:$VERSION"
save trainingrun-trainer "localhost/trainingrun-trainer:$VERSION"
# images.txt: "NAME ARCHIVE" per line, what tests/e2e imports under which name
mv "$OUT/images.txt.new" "$OUT/images.txt"
ls -la "$OUT"
