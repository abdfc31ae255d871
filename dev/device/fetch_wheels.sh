#!/usr/bin/env bash
# Download (here, where the package registry is reachable) the wheels dev/device/oracle_check.sh installs on a GPU
# machine without network: the transformers this checkout is tested with (pure Python, about 12 MB). The folder .whl
# must be ignored by git (echo /.whl/ >> .git/info/exclude) and carried to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${TRANSFORMERS_VERSION:-$(python3 -c "import transformers; print(transformers.__version__)")}
python3 -m pip download --no-deps --only-binary=:all: -d .whl "transformers==$VERSION"
ls -la .whl
