#!/bin/bash
# Run `llmtrain prepare` as a Slurm array: task I of N processes partition I/N (every N-th input document),
# then one dependent job merges the partitions back into input order (cross-partition dedup, packing, sharding):
# without near dedup, the same shard bytes as one `llmtrain prepare` of the same inputs (docs/data.md).
#
#   sbatch --array=0-15 scripts/prepare_slurm_array.sh            # 16 partitions
#   sbatch --dependency=afterok:<array job id> --export=ALL,MERGE=1 scripts/prepare_slurm_array.sh
#
# Edit INPUT / OUTPUT / TOKENIZER / OPTIONS below (or set them in the environment sbatch passes on). A failed or preempted task can be resubmitted as is: finished
# input files of its partition are skipped.
# This is the two-phase path (phase 2, the merge, holds every signature in one process: ~1.5 KB per document).
# For a corpus beyond a few million documents use scripts/prepare_staged_slurm.sh (bounded memory per task).
#SBATCH --job-name=llmtrain-prepare
#SBATCH --cpus-per-task=16
#SBATCH --mem=64G
#SBATCH --time=24:00:00
#SBATCH --output=logs/prepare-%A_%a.out
set -euo pipefail

INPUT=${INPUT:-"/data/raw/*.jsonl.zst"}
OUTPUT=${OUTPUT:-/data/tokens/web}
TOKENIZER=${TOKENIZER:-/data/tokenizers/tokenizer.json}
OPTIONS=${OPTIONS:-"--clean --filter --dedup near --pack bestfit --seq-length 4096"}
NUM_SHARDS=${NUM_SHARDS:-64}
LLMTRAIN=${LLMTRAIN:-llmtrain}   # the llmtrain executable (e.g. /path/to/.venv/bin/llmtrain)

if [[ "${MERGE:-0}" == "1" ]]; then
    srun "$LLMTRAIN" merge --output "$OUTPUT" --num-shards "$NUM_SHARDS"
else
    N=${SLURM_ARRAY_TASK_COUNT:?run as an array job (sbatch --array=0-N)}
    I=${SLURM_ARRAY_TASK_ID:?}
    # shellcheck disable=SC2086 # OPTIONS and INPUT are word-split on purpose
    srun "$LLMTRAIN" prepare --input $INPUT --output "$OUTPUT" --tokenizer "$TOKENIZER" $OPTIONS \
        --workers "$SLURM_CPUS_PER_TASK" --partition "$I/$N"
fi
