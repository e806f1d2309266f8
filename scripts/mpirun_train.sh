#!/usr/bin/env bash
# mpirun (Open MPI) launch without torchrun, as in the seed's pretrain.sh: MPI starts one process per device and
# this script maps Open MPI's rank variables onto the ones torch.distributed reads (no elastic restarts here).
#   mpirun -n 32 --hostfile hosts -x MASTER_ADDR=node0 -x MASTER_PORT=29500 bash scripts/mpirun_train.sh CONFIG.yaml
set -euo pipefail
export RANK=${OMPI_COMM_WORLD_RANK:?run under mpirun}
export WORLD_SIZE=${OMPI_COMM_WORLD_SIZE}
export LOCAL_RANK=${OMPI_COMM_WORLD_LOCAL_RANK}
export LOCAL_WORLD_SIZE=${OMPI_COMM_WORLD_LOCAL_SIZE}
export MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR} MASTER_PORT=${MASTER_PORT:-29500}
exec python -m llmtrain.cli train "$@"
