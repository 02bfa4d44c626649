#!/usr/bin/env bash
# The wheels a GPU machine of this workplace lacks to run the trainer from source (it has torch, fsspec, xxhash,
# prometheus-client, PyYAML; no registry): pydantic and what it needs, and orjson (the trainer config's JSON), for that machine's Python 3.12, into .whl/
# (ignored by git), at the versions the images pin. A device call carries .whl and installs them with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
# (see benchmarks/gpu_suite.py).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
pins=()
for name in pydantic pydantic-core annotated-types typing-inspection typing-extensions orjson; do
  pins+=("$(grep -i "^$name==" images/trainer-constraints.txt)")
done
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl "${pins[@]}"
ls -1 .whl
