#!/usr/bin/env bash
# mpirun (Open MPI, MPICH) launch without torchrun, as in the seed's pretrain.sh: MPI starts one process per
# device; `llmtrain train` reads the MPI rank variables itself (llmtrain.distributed.env, docs/launch.md), so this
# script only finds the llmtrain executable (the one of this checkout's .venv first, then $LLMTRAIN, then PATH) and
# is equivalent to `mpirun ... llmtrain train CONFIG.yaml`. No elastic restarts here: rerun the same command (exit
# code 75 = preempted and saved) to resume.
#   mpirun -n 32 --hostfile hosts -x MASTER_ADDR=node0 -x MASTER_PORT=29500 bash scripts/mpirun_train.sh CONFIG.yaml
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
if [[ -n ${LLMTRAIN:-} ]]; then
  exe=$LLMTRAIN
elif [[ -x $here/.venv/bin/llmtrain ]]; then
  exe=$here/.venv/bin/llmtrain
elif command -v llmtrain >/dev/null 2>&1; then
  exe=llmtrain
else
  echo "mpirun_train.sh: no llmtrain executable: set LLMTRAIN=/path/to/venv/bin/llmtrain or install llmtrain" >&2
  exit 2
fi
exec "$exe" train "$@"
