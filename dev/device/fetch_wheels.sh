#!/usr/bin/env bash
# Download (here, where the package registry is reachable) the wheels that dev/device/gpu_check.py and
# dev/device/oracle_check.sh install on a GPU machine without network whose transformers is older than this checkout's
# floor: transformers (the version installed here) and the packages its import checks that such a machine may lack or
# hold too old (huggingface-hub 2.x and its HTTP stack, regex), for CPython 3.12 on x86-64, about 18 MB.
# The folder .whl must be ignored by git (echo /.whl/ >> .git/info/exclude) and carried to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
version() { python3 -c "import importlib.metadata as m; print(m.version('$1'))"; }
PLATFORMS="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS -d .whl \
  "transformers==$(version transformers)" "huggingface-hub==$(version huggingface-hub)" "httpx2==$(version httpx2)" \
  "httpcore2==$(version httpcore2)" "truststore==$(version truststore)" "idna==$(version idna)" \
  "anyio==$(version anyio)" "click==$(version click)" "regex==$(version regex)"
ls -la .whl
