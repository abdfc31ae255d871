#!/usr/bin/env bash
# The recipe ablation at equal steps: one training set (the trainer comparison's 1,152 chat records, greedy answers of
# SmolLM2-135M-Instruct), 190 steps a run, one setting changed a row, each row with seeds 0 and 1; then the table
# (held-out replay acceptance length at k = 5 and per position). Never MT-bench.
# Usage: dev/recipe_ablation.sh WORK_DIR [ROW ...]   (default: every row below, in order)
# Rows already trained and evaluated are skipped, so a rerun continues where a stopped one ended (a row stopped while
# training starts again).
# From scratch, scored on the training set's held-out shard 0 (128 records): ce (the defaults), lk (--loss lk), mixed
# (--loss mixed), layers5 (--feature-layers 5, features captured at five layers into their own directory),
# freeze-head (--freeze-head).
# From the shipped draft (--init-draft examples/drafts/smollm2-135m-eagle3, its vocabulary and layers), scored on 128
# prompts that draft never trained on (dev/unseen_split.sh): shipped (the shipped draft itself, not trained),
# shipped-ce, shipped-lk, shipped-mixed, shipped-lr3 (--lr 3e-4), shipped-lr1 (--lr 1e-4). The shipped draft trained on the training set's
# records too, so shard 0 is not held out from it.
# SEEDS (default "0 1") are the seeds, in order; SHARED (default: the repository's ../shared/data) holds chat_prompts.jsonl and train_prompts.jsonl.
set -euo pipefail
WORK=$1; shift
HERE=$(cd "$(dirname "$0")" && pwd)
REPO=$(dirname "$HERE")
SHARED=${SHARED:-$REPO/../shared/data}
SHIPPED=$REPO/examples/drafts/smollm2-135m-eagle3
ROWS=("$@")
[ ${#ROWS[@]} -gt 0 ] || ROWS=(ce lk mixed layers5 freeze-head shipped shipped-ce shipped-lk shipped-mixed shipped-lr3 shipped-lr1)
read -r -a SEEDS <<< "${SEEDS:-0 1}"  # SEEDS="1" runs only that seed
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"
lscpu | grep -E "Model name" ; grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo

# The training set: records, three-layer features, the draft vocabulary (skipped once complete: the comparison's
# other layout is written last; a stopped run resumes at its first missing feature shard).
[ -f "$WORK/data/speculators/dataset_info.json" ] || python "$HERE/compare_speculators/make_data.py" --out "$WORK/data" --records 1152 \
    --per-shard 128 | tee "$WORK/make_data.log"

# The split the shipped draft never saw (dev/unseen_split.sh): only when a shipped row is asked for.
[[ " ${ROWS[*]} " != *" shipped"* ]] || "$HERE/unseen_split.sh" "$WORK/unseen" "$SHARED"

options() {  # the train options of a row
    case $1 in
        ce|shipped-ce) echo "" ;;
        lk|shipped-lk) echo "--loss lk" ;;
        mixed|shipped-mixed) echo "--loss mixed" ;;
        shipped-lr3) echo "--lr 3e-4" ;;
        shipped-lr1) echo "--lr 1e-4" ;;
        layers5) echo "--feature-layers 5" ;;
        freeze-head) echo "--freeze-head" ;;
        *) echo "unknown row $1" >&2; exit 2 ;;
    esac
}

for seed in "${SEEDS[@]}"; do  # every row once, then every row again with the next seed
    for row in "${ROWS[@]}"; do
        name="$row-s$seed"
        if [ "$row" = shipped ]; then  # the starting point, scored once
            [ "$seed" = 0 ] && { [ -f "$WORK/eval_shipped_draft.json" ] || hf-eagle3 evaluate --draft "$SHIPPED" \
                --features-dir "$WORK/unseen/features" --shards all --k 5 --json-out "$WORK/eval_shipped_draft.json" \
                > "$WORK/eval_shipped_draft.log" 2>&1; }
            continue
        fi
        features=data/features
        extra=(--skip-features --draft-vocab-size 8192)
        scored=(--features-dir data/features --holdout-shards 1)
        case $row in
            layers5)  # its own features, captured by the run itself (same shards, same hold-out)
                features=data/features5; extra=(--per-shard 128 --draft-vocab-size 8192); scored=(--features-dir "$features" --holdout-shards 1) ;;
            shipped-*)
                extra=(--skip-features --init-draft "$SHIPPED"); scored=(--features-dir unseen/features --shards all) ;;
        esac
        # shellcheck disable=SC2046
        ( cd "$WORK" && mkdir -p "$name" && { [[ $row == shipped-* ]] || cp -n data/vocab.pt "$name/vocab.pt"; } \
          && { [ -f "$name/draft/config.json" ] || hf-eagle3 train --data data/responses --features-dir "$features" \
                "${extra[@]}" --out "$name" --epochs 1000 --max-steps 190 \
                --holdout-shards 1 --select-by last --save-dtype float32 --seed "$seed" $(options "$row") \
                > "$name.log" 2>&1; } \
          && { [ -f "eval_${name}_draft.json" ] || hf-eagle3 evaluate --draft "$name/draft" "${scored[@]}" \
                --k 5 --json-out "eval_${name}_draft.json" > "eval_${name}_draft.log" 2>&1; } )
        echo "$name done"
    done
done

specs=()
for row in "${ROWS[@]}"; do
    [ -f "$WORK/eval_shipped_draft.json" ] && [ "$row" = shipped ] && specs+=("shipped=shipped/draft")
    for seed in 0 1 2 3; do  # every seed run so far
        [ -f "$WORK/eval_${row}-s${seed}_draft.json" ] && specs+=("${row}-s${seed}=${row}-s${seed}/draft")
    done
done
python "$HERE/compare_speculators/table.py" "$WORK" "${specs[@]}" | tee "$WORK/table.md"
