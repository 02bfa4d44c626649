#!/usr/bin/env bash
# The wheels a GPU machine of this workplace lacks to run the trainer and the operator from source (it has torch,
# fsspec, xxhash, prometheus-client, PyYAML, aiohttp, click; no registry): pydantic and what it needs, orjson (the
# trainer config's JSON and the operator's API client), and kopf with what it needs, for that machine's Python
# ($WHEEL_PYTHON, 3.12 by default), into .whl/ (ignored by git), at the versions the images pin. A device call carries
# .whl and installs them with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (see benchmarks/gpu_suite.py and benchmarks/fleet_suite.py).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .git/info
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions orjson; do
  pins+=("$(grep -i "^$name==" images/trainer-constraints.txt)")
done
for name in kopf python-json-logger iso8601 jsonpatch jsonpointer; do
  pins+=("$(grep -i "^$name==" images/operator-constraints.txt)")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
ls -1 .whl
