#!/usr/bin/env bash
# One ablation run of hf-eagle3's trainer on the comparison's data (run.sh step 1 made it), step-matched with the
# default run (190 steps), then its held-out replay; the table: table.py WORK NAME=NAME/draft ...
# Usage: dev/compare_speculators/ablate.sh WORK_DIR NAME [train options ...], e.g. ablate.sh /work/cmp lr1e-3 --lr 1e-3
# Steps are matched rather than minutes, so a run is unaffected by other work on the machine; the held-out shard is
# the one run.sh holds out (shard 0), never MT-bench.
set -euo pipefail
WORK=$1; NAME=$2; shift 2
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$WORK"
mkdir -p "$NAME" && cp -n data/vocab.pt "$NAME/vocab.pt"
[ -f "$NAME/draft/config.json" ] || hf-eagle3 train --data data/responses --features-dir data/features \
    --skip-features --out "$NAME" --draft-vocab-size 8192 --epochs 1000 --max-steps 190 \
    --holdout-shards 1 --select-by last --save-dtype float32 "$@" > "$NAME.log" 2>&1
[ -f "eval_${NAME}_draft.json" ] || hf-eagle3 evaluate --draft "$NAME/draft" --features-dir data/features \
    --holdout-shards 1 --k 5 --json-out "eval_${NAME}_draft.json" > "eval_${NAME}_draft.log" 2>&1
