#!/usr/bin/env bash
# The prepared GPU check of issues 17 and 18, for one H100 / H200 (about 10 minutes). On the device machine,
# from the repository root:
#
#     bash scripts/gpu_checks.sh          # logs and results under $OUT (else /tmp/gpu_checks)
#
# It uses the machine's own python3 (a CUDA build of torch) with this checkout's src/ first on PYTHONPATH.
# torchao (FP8) is used when importable, or when carried as wheels in .whl/ (installed into /tmp/site); without
# it the FP8 rows report the error. Each part has its own time limit so a slow one cannot take the others' time:
#   mfu   bench/gpu_mfu.py: Llama 1B and 3B shapes, seq 4096, bf16, compile, flash SDPA, with the planner's
#         tokens/s per GPU for the same run and its error (issue 18: >= 50% MFU bf16)
#   fp8   bench/gpu_fp8_check.py: 1B with train.fp8 none / tensorwise / rowwise (issue 18: FP8 >= 1.3x bf16)
#   long  bench/long_context.py: flex with document masks vs SDPA's plain causal flash step, bf16, seq 8k-32k
#         (issue 17: flex >= 0.8x the causal speed at equal tokens)
set -uo pipefail
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  python3 -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1
} | tee "$OUT/env.txt"

part() {  # part NAME SECONDS COMMAND...: run with a limit, log to $OUT/NAME.log, rc to summary.txt
  local name=$1 limit=$2
  shift 2
  echo "== $name: $*" | tee -a "$OUT/summary.txt"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name rc ${PIPESTATUS[0]}" | tee -a "$OUT/summary.txt"
}

part mfu 210 python3 bench/gpu_mfu.py --sizes 1b,3b --seq 4096 --steps 8 --warmup 3
part fp8 200 python3 bench/gpu_fp8_check.py --size 1b --seq 4096 --steps 8 --warmup 4 --json "$OUT/fp8.json"
part long 150 python3 bench/long_context.py --seqs 8192 16384 32768 --kinds causal_step flex --bf16 \
  --dim 2048 --heads 16 --layers 4 --no-loss
