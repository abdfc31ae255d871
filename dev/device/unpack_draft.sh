#!/usr/bin/env bash
# Join the pieces dev/device/train_draft.sh wrote to $OUT (model.safetensors.part-*, draft_meta.tar with config.json,
# generation_config.json, training_summary.json, train_log.jsonl and SHA256SUMS, and log.txt; the small files may also
# lie loose beside the parts) into a draft directory, check it, and print the command that measures it on MT-bench.
#
#   bash dev/device/unpack_draft.sh FILES_DIR [DRAFT_DIR]     (DRAFT_DIR default: runs/gpu-draft, git-ignored)
set -euo pipefail
cd "$(dirname "$0")/../.."
SRC=${1:?usage: unpack_draft.sh FILES_DIR [DRAFT_DIR]}
DST=${2:-runs/gpu-draft}
PY=${PYTHON:-python3}
ls "$SRC"/model.safetensors.part-* >/dev/null
mkdir -p "$DST"
cat "$SRC"/model.safetensors.part-* > "$DST/model.safetensors"
if [ -f "$SRC/draft_meta.tar" ]; then tar -xf "$SRC/draft_meta.tar" -C "$DST"; fi
for f in config.json generation_config.json training_summary.json train_log.jsonl SHA256SUMS log.txt; do
  if [ -f "$SRC/$f" ]; then cp "$SRC/$f" "$DST/"; fi
done
(cd "$DST" && sha256sum -c SHA256SUMS)
$PY - "$DST" <<'PY'
import json, sys
from pathlib import Path
from hf_eagle3 import Eagle3DraftModel
d = Path(sys.argv[1])
draft = Eagle3DraftModel.from_pretrained(str(d))
print(f"loaded {d}: {sum(p.numel() for p in draft.parameters()) / 1e6:.1f} M parameters")
s = d / "training_summary.json"
if s.exists():
    summary = json.loads(s.read_text())
    print("records", summary.get("records"), "train minutes", round(summary.get("train_minutes_this_run", 0), 2),
          "holdout per-step accuracy", [round(a, 3) for a in summary.get("holdout", {}).get("acc", [])])
PY
cat <<EOF

Measure it (greedy, k = 5, MT-bench turn 1 of FastChat's question.jsonl, here mt_bench.jsonl; compare with
examples/drafts/smollm2-135m-eagle3):
  python examples/offline_inference_eagle3.py --dataset mt_bench.jsonl --num_spec_tokens 5 \\
      --max_new_tokens 256 --draft $DST
EOF
