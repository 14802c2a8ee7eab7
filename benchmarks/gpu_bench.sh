#!/usr/bin/env bash
# The GPU benchmark of issue 34 in one device call: the GPT-2-small workload (d=768, 12 layers, 12 heads, vocab
# 32768, 8x256 tokens, AdamW, world size 1) for every mode of benchmarks/gpu.py, fp32 and bf16 autocast:
#
#   OUT=/some/dir bash benchmarks/gpu_bench.sh                      # fp32 (start-up is read cold in fp32)
#   OUT=/some/dir bash benchmarks/gpu_bench.sh bf16 --warm-modes ''  # the bf16 autocast half
#   OUT=/some/dir bash benchmarks/gpu_bench.sh fp32,bf16             # both in one run: 16 compiles side by side
#
# Arguments after the precision go to `python -m benchmarks.gpu` (--modes, --parallel, --warm-modes, ...).
# Cold compiles run side by side, every timed step alone on the GPU, and a budget (BUDGET_S, default 540 s) stops
# new work in time (benchmarks/gpu.py says how). Writes under $OUT: results_<precision>.json, gpu_<...>.md (the
# BENCHMARKS.md block; `python -m benchmarks.gpu --render $OUT/results_*.json --markdown BENCHMARKS.md` puts it
# there) and logs_<...>.tgz (each job's log and result). Give the device call about 60 s more than BUDGET_S.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export OUT=${OUT:-$PWD/gpu_out}
PY=${PYTHON:-python3}
precision=${1:-fp32}
shift $(($# > 0 ? 1 : 0))
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>&1 | head -n 2
"$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available())'
exec "$PY" -m benchmarks.gpu --precision "$precision" --out-dir "$OUT" --budget-s "${BUDGET_S:-540}" "$@"
