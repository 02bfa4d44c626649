#!/usr/bin/env bash
# Builds the operator and trainer images with podman (no Docker engine needed) and smoke-runs them:
#   the operator image prints `trainingrun --help` and, against an unreachable API, exits with a clear error;
#   the trainer image trains the CPU example for a few steps to a file:// checkpoint and exits 0, non-root.
# Base image: a local Debian bookworm with python3 from debootstrap (Docker Hub is unreachable here),
# passed as the BASE_IMAGE build arg; the CPU torch wheel of this machine goes in through wheels/.
# Podman settings for this machine (runc, vfs storage, chroot isolation) follow ../shared/TESTING.md.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/packages.sh
need_commands podman buildah runc debootstrap
VERSION=$(python3 -c 'import tomllib; print(tomllib.load(open("pyproject.toml","rb"))["project"]["version"])')
WORK=${BUILD_WORK:-$PWD/.tools/images}
BASE=localhost/debian-python:bookworm
mkdir -p "$WORK"
cat > "$WORK/containers.conf" <<EOF
[engine]
runtime="runc"
[containers]
default_ulimits=["nofile=1024:1024","nproc=1024:1024"]
EOF
cat > "$WORK/storage.conf" <<EOF
[storage]
driver="vfs"
graphroot="$WORK/storage"
runroot="$WORK/run"
EOF
export CONTAINERS_CONF="$WORK/containers.conf" CONTAINERS_STORAGE_CONF="$WORK/storage.conf"

if ! podman image exists "$BASE"; then
  echo "== base image $BASE (debootstrap)"
  rm -rf "$WORK/rootfs"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$WORK/rootfs" \
    http://deb.debian.org/debian >/dev/null
  tar -C "$WORK/rootfs" -c . | podman import --quiet - "$BASE" >/dev/null
fi
cp -f /opt/wheels/torch-2.13.0*.whl wheels/ 2>/dev/null || echo "no local torch wheel: the trainer build pulls torch from PyPI"
# This machine reaches PyPI through a TLS-intercepting proxy: give the builds the host's CA bundle.
CA_ARGS=()
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
  CA_ARGS=(-v /etc/ssl/certs/ca-certificates.crt:/etc/ssl/host-ca.crt:ro --build-arg PIP_CERT=/etc/ssl/host-ca.crt)
fi

# build IMAGE DOCKERFILE. Each RUN step re-executes a copy of the runtime sealed in a memfd; sealing it failed once on
# CI with EBUSY ("Close_Fd sealing memfd copy: Device or resource busy", a step that ran twice before): the step, not
# the image, was at fault, so such a failure builds the image once more. Any other failure fails at once.
build() {
  local log status
  log=$(mktemp)
  for try in 1 2; do
    echo "== building $1"
    status=0
    podman build --isolation chroot --layers=false -q "${CA_ARGS[@]}" -f "$2" --build-arg BASE_IMAGE="$BASE" \
      -t "$1" . 2>"$log" || status=$?
    cat "$log" >&2
    if [ "$status" = 0 ]; then rm -f "$log"; return 0; fi
    if [ "$try" = 2 ] || ! grep -q "sealing memfd copy" "$log"; then rm -f "$log"; return "$status"; fi
    echo "== $1: the runtime's memfd copy could not be sealed (EBUSY): building again"
  done
}
build "localhost/trainingrun-operator:$VERSION" Dockerfile.operator
build "localhost/trainingrun-trainer:$VERSION" Dockerfile.trainer
podman images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep trainingrun

fail() { echo "SMOKE FAILED: $*" >&2; exit 1; }

echo "== smoke: operator --help"
help=$(podman run --rm --network none "localhost/trainingrun-operator:$VERSION" --help)
echo "$help" | head -3
grep -q "operator" <<<"$help" || fail "trainingrun --help does not list the operator command"

echo "== smoke: operator in a pod without credentials"
set +e
out=$(timeout 120 podman run --rm --network none -e KUBERNETES_SERVICE_HOST=10.255.255.1 \
  -e KUBERNETES_SERVICE_PORT=443 "localhost/trainingrun-operator:$VERSION" operator --metrics-port 0 \
  --health-port 0 2>&1)
code=$?
set -e
echo "$out" | tail -1
echo "(exit $code)"
[ "$code" = 1 ] || fail "the operator without credentials should exit 1, exited $code"
grep -q "no Kubernetes credentials" <<<"$out" || fail "the operator did not say why it cannot start"

echo "== smoke: operator against an unreachable API (40 s of it at most; it retries, then exits 1 after about a minute)"
kubeconfig_dir=$(mktemp -d)
cat > "$kubeconfig_dir/config" <<EOF
apiVersion: v1
kind: Config
current-context: unreachable
clusters: [{name: unreachable, cluster: {server: "https://10.255.255.1:6443"}}]
users: [{name: smoke, user: {token: smoke}}]
contexts: [{name: unreachable, context: {cluster: unreachable, user: smoke}}]
EOF
chmod -R a+rX "$kubeconfig_dir"
out=$(timeout 40 podman run --rm --network none -v "$kubeconfig_dir:/kube:ro" -e KUBECONFIG=/kube/config \
  "localhost/trainingrun-operator:$VERSION" operator 2>&1 || true)
grep "cannot reach the Kubernetes API" <<<"$out" || { echo "$out" | tail -5; fail "no clear line about the API"; }

echo "== smoke: trainer, 5 CPU steps to file:// as a non-root user"
run_dir=$(mktemp -d)
cat > "$run_dir/config.yaml" <<EOF
trainer:
  maxSteps: 5
  logIntervalSteps: 1
  model: {classPath: trainingrun_trainer.models.CharTransformer, initArgs: {dim: 16, layers: 1, heads: 2, contextLength: 16}}
  data: {dataset: {classPath: trainingrun_trainer.data.SyntheticText, initArgs: {numSamples: 256, contextLength: 16}}, batchSize: 8}
checkpoint: {uri: "file:///tmp/ckpt", interval: {steps: 5}}
EOF
chmod -R a+rX "$run_dir"
trainer_script='echo "uid=$(id -u)" && python -m trainingrun_trainer.launch --module trainingrun_trainer && trainingrun checkpoints file:///tmp/ckpt'
out=$(podman run --rm --network none -v "$run_dir:/etc/trainingrun:ro" -e TRAININGRUN_CONFIG=/etc/trainingrun/config.yaml \
  -e TRAININGRUN_NAME=smoke -e PET_STANDALONE=1 -e PET_NPROC_PER_NODE=1 "localhost/trainingrun-trainer:$VERSION" \
  sh -c "$trainer_script" 2>&1) || { echo "$out"; fail "the trainer did not exit 0"; }
echo "$out" | tail -4
grep -q "^uid=1000$" <<<"$out" || fail "the trainer did not run as uid 1000"
grep -Eq "^ *5 +yes .*/step-00000005$" <<<"$out" || fail "no valid checkpoint at step 5 listed"
echo "== images built and smoke-tested"
