#!/usr/bin/env bash
# Multi-node launch with torchrun's elastic agent (the equivalent of the seed's pretrain.sh / msrun_pretrain_70b.sh).
# Run the same command on every node:   bash scripts/launch_multinode_torchrun.sh CONFIG.yaml [overrides...]
# NNODES may be MIN:MAX for an elastic job: after losing a node the job restarts on the remaining ones
# (resharding the checkpoint on load) up to MAX_RESTARTS times. With a fixed NNODES, losing a node ends the job
# (exit 1 on the other nodes; rerun to resume from the newest checkpoint). See docs/launch.md.
set -euo pipefail
CONFIG=${1:?usage: $0 CONFIG.yaml [section.key=value ...]}; shift
NNODES=${NNODES:-4}                 # e.g. 4 or 3:4
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the rendezvous host}
MASTER_PORT=${MASTER_PORT:-29500}
MAX_RESTARTS=${MAX_RESTARTS:-3}
LLMTRAIN=${LLMTRAIN:-llmtrain}      # the llmtrain executable (e.g. /path/to/.venv/bin/llmtrain)
"$LLMTRAIN" launch "$CONFIG" --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --max-restarts "$MAX_RESTARTS" "$@"
