#!/bin/bash
# Staged deduplication (`llmtrain prepare --dedup ...`) on Slurm: each stage is an array job, one array task per
# stage task, chained with afterok dependencies. The stage boundaries are files in the work folder
# (.OUTPUT.work/staged/ on a filesystem every node sees), so this is only a driver: any scheduler that can run
# `llmtrain prepare <same flags> --stage S --task K` for every K, stage after stage, does the same.
#
#   P=64 B=256 scripts/prepare_staged_slurm.sh            # submits the five jobs (run it on the login node)
#
# Stages: 1 screen (P tasks), 2 pairs (B tasks), 3 components (1), 4 tokenize (P), 5 write (1). A failed or
# preempted task can be resubmitted as is (`sbatch --array=K ...` with the same variables): finished tasks
# (a marker stats/S-KKKKK.json) are skipped, a stage refuses to start before the one it reads is finished,
# and every task must be given the same --partitions and --buckets. `llmtrain prepare --plan $INPUT` suggests B.
# Edit INPUT / OUTPUT / TOKENIZER / OPTIONS, or pass them in the environment.
set -euo pipefail

INPUT=${INPUT:-"/data/raw/*.jsonl.zst"}
OUTPUT=${OUTPUT:-/data/tokens/web}
TOKENIZER=${TOKENIZER:-/data/tokenizers/tokenizer.json}
OPTIONS=${OPTIONS:-"--clean --filter --dedup near --pack bestfit --seq-length 4096 --num-shards 64"}
P=${P:-64}              # partitions: tasks of stages 1 and 4 (memory per task: a chunk, whatever the size)
B=${B:-256}             # buckets: tasks of stage 2 (memory per task: ~64 bytes x documents x 21 / B)
MEM=${MEM:-8G}          # per task; stage 3 (components) holds the duplicate pairs: give it more
MEM_COMPONENTS=${MEM_COMPONENTS:-64G}
TIME=${TIME:-12:00:00}
mkdir -p logs

# shellcheck disable=SC2086 # INPUT and OPTIONS are word-split on purpose
LLMTRAIN=${LLMTRAIN:-llmtrain}   # the llmtrain executable (e.g. /path/to/.venv/bin/llmtrain)
STAGE_CMD="$LLMTRAIN prepare --input $INPUT --output $OUTPUT --tokenizer $TOKENIZER $OPTIONS --partitions $P --buckets $B"

submit() {  # submit STAGE ARRAY MEM [DEPENDENCY] -> job id
    local stage=$1 array=$2 mem=$3 dep=${4:-}
    sbatch --parsable --job-name="prepare-s$stage" --array="$array" --cpus-per-task=1 --mem="$mem" \
        --time="$TIME" --output="logs/prepare-s${stage}-%A_%a.out" ${dep:+--dependency=afterok:$dep} \
        --wrap="$STAGE_CMD --stage $stage --task \$SLURM_ARRAY_TASK_ID"
}

s1=$(submit 1 "0-$((P - 1))" "$MEM")
s2=$(submit 2 "0-$((B - 1))" "$MEM" "$s1")
s3=$(submit 3 0 "$MEM_COMPONENTS" "$s2")
s4=$(submit 4 "0-$((P - 1))" "$MEM" "$s3")
s5=$(submit 5 0 "$MEM" "$s4")
echo "submitted: screen $s1, pairs $s2, components $s3, tokenize $s4, write $s5"
