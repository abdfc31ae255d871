#!/usr/bin/env bash
# The GPU check of hf-eagle3's decoding (one GPU, no network, well under 10 minutes): `hf-eagle3 bench --oracle` on a
# random-weight target of Llama-3.1-8B's shape in bfloat16 with the llama3-8b acceptance profile (the EAGLE-3
# authors' draft for Llama-3.1-8B-Instruct on MT-bench) and a draft of the published draft's shape (hidden 4096,
# draft vocabulary 32k), chains k = 1..7, "auto" and two trees. Writes oracle.md (the table for docs/benchmarks.md)
# and oracle.json to $OUT (default bench_out/gpu).
#
# The machine needs torch with CUDA and transformers >= 5.20 (see pyproject.toml). When it has an older transformers,
# bring the wheel along: run dev/device/fetch_wheels.sh here first, carry .whl, and this script installs it.
#
# Test it at small scale on a CPU:  SHAPE=tiny DEVICE=cpu DTYPE=float32 PROMPTS=1 NEW=16 bash dev/device/oracle_check.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench_out/gpu}
SHAPE=${SHAPE:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
DTYPE=${DTYPE:-bfloat16}
PROMPTS=${PROMPTS:-4}
NEW=${NEW:-128}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
mkdir -p "$OUT"
$PY - <<'PY' | tee "$OUT/environment.txt"
import platform, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "python", platform.python_version())
print("gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY
$PY -c "import sys; from hf_eagle3.cli import main; sys.exit(main(sys.argv[1:]))" bench \
  --oracle llama3-8b --synthetic "$SHAPE" --dtype "$DTYPE" --device "$DEVICE" \
  --ks 1,2,3,4,5,6,7 --tree-shapes 4x4x8,8x6x32 --num-prompts "$PROMPTS" --max-new-tokens "$NEW" \
  --prompt-tokens 256 --draft-vocab-size 32000 --out-dir "$OUT" 2>&1 | tee "$OUT/log.txt"
