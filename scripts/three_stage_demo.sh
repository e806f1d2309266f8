#!/usr/bin/env bash
# The seed's three-stage recipe (general -> reasoning -> annealing) at toy scale on the CPU, in minutes:
# prepares English, Chinese, code and a curated slice from ../shared/corpus (or $CORPUS) with one shared
# tokenizer, then runs configs/recipes/three_stage_demo.yaml with 2 processes through `llmtrain launch`.
# Output: runs/three_stage (metrics.jsonl with a `stage` per row, events.jsonl with stage_start/stage_end,
# a checkpoint at each boundary, loss.png with the boundaries marked).
#   bash scripts/three_stage_demo.sh            # after `make demo` or `pip install -e .`
set -euo pipefail
cd "$(dirname "$0")/.."
CORPUS=${CORPUS:-../shared/corpus}
DATA=runs/three_stage/data
LLMTRAIN=${LLMTRAIN:-.venv/bin/llmtrain}
[ -x "$LLMTRAIN" ] || LLMTRAIN=llmtrain
for f in en zh code; do
  if [ ! -f "$CORPUS/$f.jsonl.gz" ]; then
    echo "error: $CORPUS/$f.jsonl.gz not found; set CORPUS to a folder with en/zh/code .jsonl.gz files" >&2
    exit 2
  fi
done
mkdir -p "$DATA"
if [ ! -f "$DATA/tok.manifest.json" ]; then  # one 8k byte-level BPE for all four datasets
  "$LLMTRAIN" prepare --input "$CORPUS/en.jsonl.gz" "$CORPUS/zh.jsonl.gz" "$CORPUS/code.jsonl.gz" \
    --max-documents 3000 --train-tokenizer 8192 --output "$DATA/tok"
fi
TOK=$(ls "$DATA"/tok*.tokenizer.json | head -1)
for f in en zh code; do
  [ -f "$DATA/$f.manifest.json" ] || "$LLMTRAIN" prepare --input "$CORPUS/$f.jsonl.gz" --tokenizer "$TOK" \
    --clean --max-documents 4000 --output "$DATA/$f"
done
[ -f "$DATA/curated.manifest.json" ] || "$LLMTRAIN" prepare --input "$CORPUS/en.jsonl.gz" --tokenizer "$TOK" \
  --clean --filter --dedup near --max-documents 80 --output "$DATA/curated"
"$LLMTRAIN" launch configs/recipes/three_stage_demo.yaml --nproc-per-node 2 "$@"
