#!/usr/bin/env bash
# The held-out split the shipped SmolLM2-135M draft never trained on, with the target's greedy answers and their
# features (the target in bfloat16, as for the shipped data, on every machine): DIR/prompts.jsonl
# (dev/unseen_prompts.py, 128 prompts), DIR/responses, DIR/features. Skipped when
# DIR/features is complete (written last); a stopped run starts again from nothing.
# Usage: dev/unseen_split.sh DIR [SHARED]   (SHARED: the folder of chat_prompts.jsonl and train_prompts.jsonl,
# default the repository's ../shared/data)
set -euo pipefail
DIR=$1
HERE=$(cd "$(dirname "$0")" && pwd)
SHARED=${2:-$(dirname "$HERE")/../shared/data}
[ -f "$DIR/features/target_head.pt" ] && exit 0
rm -rf "$DIR/features.part" "$DIR/responses"  # the features are written with the answers: both again
python "$HERE/unseen_prompts.py" --shared "$SHARED" --out "$DIR/prompts.jsonl" --count 128
HF_HUB_OFFLINE=1 hf-eagle3 prepare --prompts "$DIR/prompts.jsonl" --out "$DIR/responses" --max-new-tokens 256 --dtype bfloat16 \
    --features-dir "$DIR/features.part" > "$DIR/prepare.log" 2>&1
mv "$DIR/features.part" "$DIR/features"
