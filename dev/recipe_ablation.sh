#!/usr/bin/env bash
# The recipe ablation at equal steps: one data set (the trainer comparison's 1,152 chat records, greedy answers of
# SmolLM2-135M-Instruct), one held-out replay split (shard 0, 128 records; never MT-bench), 190 steps a run, one
# setting changed a row, each row with seeds 0 and 1; then the table (held-out replay acceptance length at k = 5 and
# per position).
# Usage: dev/recipe_ablation.sh WORK_DIR [ROW ...]   (default: every row below, in order)
# Rows already trained and evaluated are skipped, so a rerun continues where a stopped one ended (a row stopped while
# training starts again). Rows: ce (the defaults), lk (--loss lk), mixed (--loss mixed), layers5 (--feature-layers 5,
# features captured at five layers into their own directory), freeze-head (--freeze-head). All from scratch: the
# shipped draft was trained on records of these files, so its held-out replay here would not be held out.
set -euo pipefail
WORK=$1; shift
HERE=$(cd "$(dirname "$0")" && pwd)
ROWS=("$@")
[ ${#ROWS[@]} -gt 0 ] || ROWS=(ce lk mixed layers5 freeze-head)
SEEDS=(0 1)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$WORK"
lscpu | grep -E "Model name" ; grep -o -w -E "avx2|avx512f|avx512_bf16|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo

# The data: records, three-layer features, the draft vocabulary (skipped once complete: the comparison's other
# layout is written last; a stopped run resumes at its first missing feature shard).
[ -f "$WORK/data/speculators/dataset_info.json" ] || python "$HERE/compare_speculators/make_data.py" --out "$WORK/data" --records 1152 \
    --per-shard 128 | tee "$WORK/make_data.log"

options() {  # the train options of a row
    case $1 in
        ce) echo "" ;;
        lk) echo "--loss lk" ;;
        mixed) echo "--loss mixed" ;;
        layers5) echo "--feature-layers 5" ;;
        freeze-head) echo "--freeze-head" ;;
        *) echo "unknown row $1" >&2; exit 2 ;;
    esac
}

for seed in "${SEEDS[@]}"; do  # every row once, then every row again with the next seed
    for row in "${ROWS[@]}"; do
        name="$row-s$seed"
        features=data/features
        extra=(--skip-features)
        if [ "$row" = layers5 ]; then  # its own features, captured by the run itself (same shards, same hold-out)
            features=data/features5
            extra=(--per-shard 128)
        fi
        # shellcheck disable=SC2046
        ( cd "$WORK" && mkdir -p "$name" && cp -n data/vocab.pt "$name/vocab.pt" \
          && { [ -f "$name/draft/config.json" ] || hf-eagle3 train --data data/responses --features-dir "$features" \
                "${extra[@]}" --out "$name" --draft-vocab-size 8192 --epochs 1000 --max-steps 190 \
                --holdout-shards 1 --select-by last --save-dtype float32 --seed "$seed" $(options "$row") \
                > "$name.log" 2>&1; } \
          && { [ -f "eval_${name}_draft.json" ] || hf-eagle3 evaluate --draft "$name/draft" --features-dir "$features" \
                --holdout-shards 1 --k 5 --json-out "eval_${name}_draft.json" > "eval_${name}_draft.log" 2>&1; } )
        echo "$name done"
    done
done

specs=()
for row in "${ROWS[@]}"; do
    for seed in "${SEEDS[@]}"; do
        [ -f "$WORK/eval_${row}-s${seed}_draft.json" ] && specs+=("${row}-s${seed}=${row}-s${seed}/draft")
    done
done
python "$HERE/compare_speculators/table.py" "$WORK" "${specs[@]}" | tee "$WORK/table.md"
