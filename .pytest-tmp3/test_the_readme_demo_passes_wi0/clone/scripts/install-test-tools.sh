#!/usr/bin/env bash
# Everything `make test` uses beyond Python, so that no test is skipped: promtool and prometheus (Debian's
# `prometheus`), Helm 4 and Helm 3 (scripts/install-helm.sh), and the real Kubernetes binaries with openssl for
# the real-API tier (scripts/install-k8s.sh, from ../shared/k8s). Installs only what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/packages.sh
need_commands promtool=prometheus prometheus
echo "== $(promtool --version 2>&1 | head -1)"
bash scripts/install-helm.sh
bash scripts/install-k8s.sh
