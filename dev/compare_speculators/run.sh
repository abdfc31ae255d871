#!/usr/bin/env bash
# hf-eagle3's trainer against speculators' own, same data, same draft vocabulary, the same minutes on this machine.
# Usage: dev/compare_speculators/run.sh WORK_DIR MINUTES SPECULATORS_PYTHON MT_BENCH_JSONL
#   WORK_DIR: scratch space (features ~2.5 GB); MINUTES: training budget of each trainer;
#   SPECULATORS_PYTHON: a python with speculators 0.9.0 (the .ci/run recipe builds .ci/specvenv);
#   MT_BENCH_JSONL: FastChat's MT-bench question.jsonl (decoded acceptance, measured once per draft at the end).
# Steps already done (their outputs exist) are skipped, so a rerun continues.
set -euo pipefail
WORK=$1; MINUTES=$2; SPEC=$3; MTBENCH=$4
HERE=$(cd "$(dirname "$0")" && pwd)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
VERIFIER=$(python -c "from hf_eagle3.smollm2 import smollm2_path; print(smollm2_path())")
mkdir -p "$WORK" && cd "$WORK"
lscpu | grep -E "Model name|^Flags" | sed 's/^Flags:/Flags:/' | tr ' ' '\n' | grep -E "Model|name|avx512_bf16|amx|avx2$" | tr '\n' ' '; echo

# 1. 1,152 records (chat prompts, greedy answers): shard 0 (128 records) held out for both trainers.
[ -f data/speculators/dataset_info.json ] || python "$HERE/make_data.py" --out data --records 1152 --per-shard 128 \
    | tee data/make_data.log
RATIO=$(grep -o -- "--train-data-ratio [0-9.]*" data/make_data.log | cut -d' ' -f2)

# 2. hf-eagle3 at its defaults (vocabulary given, last weights kept: shard 0 is the comparison's held-out set).
if [ ! -f hf/draft/config.json ]; then
    mkdir -p hf && cp data/vocab.pt hf/vocab.pt
    /usr/bin/time -f "hf-eagle3 wall %e s" hf-eagle3 train --data data/responses --features-dir data/features \
        --skip-features --out hf --draft-vocab-size 8192 --epochs 1000 --max-minutes "$MINUTES" \
        --holdout-shards 1 --select-by last --save-dtype float32 2>&1 | tee hf.log
fi

# 3. speculators at its defaults (CPU launcher: device and autocast only; eager loss, sdpa attention, no workers),
#    its step count set from its own step timer in a short calibration run, so that it trains MINUTES minutes.
if [ ! -f spec/done ]; then
    COMMON=(--verifier-name-or-path "$VERIFIER" --data-path data/speculators --d2t-path data/d2t.npy
            --t2d-path data/t2d.npy --loss-implementation eager --draft-attn-impl sdpa --num-workers 0
            --on-missing raise --train-data-ratio "$RATIO" --no-resume-from-checkpoint)
    rm -rf spec_calibrate
    "$SPEC" "$HERE/train_speculators_cpu.py" "${COMMON[@]}" --save-path spec_calibrate --max-steps 4 --epochs 1 \
        > spec_calibrate.log 2>&1
    # its own per-step timer (profile/step_ms), steps 1-3: start-up and validation are left out, as for hf-eagle3
    CAL=$(grep -o "profile/step_ms=[0-9.e+]*" spec_calibrate.log | tail -3 | cut -d= -f2 \
          | python -c "import sys; v = [float(x) for x in sys.stdin]; print(sum(v) / len(v) / 1000)")
    STEPS=$(python -c "print(max(1, round($MINUTES * 60 / $CAL)))")
    echo "speculators: $CAL s a step -> --max-steps $STEPS"
    # After --max-steps it still takes one step, a validation and a checkpoint in every remaining epoch: the run is
    # stopped once the checkpoint of step STEPS is written, and that checkpoint is the one compared.
    "$SPEC" "$HERE/train_speculators_cpu.py" "${COMMON[@]}" --save-path spec --max-steps "$STEPS" > spec.log 2>&1 &
    PID=$!
    until grep -qs "\"global_step\": $STEPS}" spec/[0-9]*/training_state.json; do
        kill -0 $PID 2>/dev/null || break
        sleep 10
    done
    sleep 10 && kill $PID 2>/dev/null || true
    grep -ls "\"global_step\": $STEPS}" spec/[0-9]*/training_state.json | head -1 | xargs dirname > spec/done
fi
SPEC_DRAFT=$(cat spec/done)

# 4. Both drafts loaded the same way in hf-eagle3: held-out replay (per position) and decoded MT-bench turn 1.
for name in hf/draft "$SPEC_DRAFT"; do
    tag=$(echo "$name" | tr '/' '_')
    [ -f "eval_$tag.json" ] || hf-eagle3 evaluate --draft "$name" --features-dir data/features --holdout-shards 1 \
        --k 5 --json-out "eval_$tag.json"
    [ -f "mtbench_$tag.json" ] || python "$HERE/../../examples/offline_inference_eagle3.py" --dataset "$MTBENCH" \
        --num_prompts 80 --num_spec_tokens 5 --max_new_tokens 128 --draft "$name" --json_out "mtbench_$tag.json"
done
