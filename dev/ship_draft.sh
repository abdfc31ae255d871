#!/usr/bin/env bash
# The next shipped SmolLM2-135M draft: the shipped draft trained further on its own data (the response files in
# examples/data), every checkpoint scored on 128 prompts it never trained on (dev/unseen_prompts.py; answered
# greedily by the target here), training ended by early stopping (2 hours of training that add less than 0.03
# held-out acceptance length) or by the 16-hour budget, the best checkpoint saved. Never MT-bench: that is measured
# once, on the draft this writes, for the model card.
# Usage: dev/ship_draft.sh WORK_DIR        (resumable: rerun it to continue the feature pass or the training)
# LR (required: the peak learning rate the ablation's rows from the shipped draft chose; the trainer's 1e-3 takes
# the shipped draft below its start), LOSS (default ce) and SHARED (default: the repository's ../shared/data) set
# the run.
set -euo pipefail
WORK=$1
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
SHARED=${SHARED:-$REPO/../shared/data}
LOSS=${LOSS:-ce}
LR=${LR:?set LR, the peak learning rate (docs/experiments/recipe_ablation.md, rows from the shipped draft)}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"
lscpu | grep -E "Model name" ; grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo

"$HERE/unseen_split.sh" "$WORK/unseen" "$SHARED"  # the held-out split

# The feature pass over the shipped data (resumed at its first missing shard), then training (resumed at its last
# checkpoint); the run says why it ended and which checkpoint it saved.
hf-eagle3 train --data "$REPO/examples/data/smollm2-135m-instruct-responses" --out "$WORK/train" \
    --init-draft "$REPO/examples/drafts/smollm2-135m-eagle3" --per-shard 512 \
    --holdout-shards 0 --holdout-features "$WORK/unseen/features" --epochs 1000 --max-minutes 960 \
    --save-every 100 --stop-gain 0.03 --stop-window 120 --loss "$LOSS" --lr "$LR" --save-dtype bfloat16 \
    2>&1 | tee -a "$WORK/train.log"
hf-eagle3 evaluate --draft "$WORK/train/draft" --features-dir "$WORK/unseen/features" --shards all --k 5 \
    --json-out "$WORK/eval_unseen.json"
