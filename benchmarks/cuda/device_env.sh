#!/bin/bash
# Sourced by the device-call scripts (benchmarks/cuda/run_*.sh, benchmarks/run_h200x2.sh): the repository root as
# working directory, unbuffered Python, $OUT, the wheels in ${WHL:-.whl} (flash-linear-attention 0.6.0, which the
# GPU machine lacks) on PYTHONPATH, and build_cuda.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/kda_out}; mkdir -p "$OUT"
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# (a copy of a branch under .dev/NAME finds the repository root's .whl two levels up)
if [ -z "${WHL:-}" ]; then WHL=.whl; [ -d .whl ] || { [ -d ../../.whl ] && WHL=../../.whl; }; fi
if ls $WHL/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $WHL/*.whl \
    && export PYTHONPATH=/tmp/site
fi

# build_cuda [JOBS]: the CUDA variant for ${KDA_ARCHS:-9.0} with ptxas resource lines, log in $OUT/build.log, at
# most $BUILD_TIMEOUT seconds when that is set; exits the calling script when the build fails (so call it
# directly, not in a pipeline), sets BUILD_S to the seconds it took.
build_cuda() {
  local t0
  t0=$(date +%s)
  TORCH_CUDA_ARCH_LIST=${KDA_ARCHS:-9.0} KDA_CUDA_PTXAS_VERBOSE=1 ${BUILD_TIMEOUT:+timeout $BUILD_TIMEOUT} \
    python3 scripts/build.py --backends cuda --jobs "${1:-16}" > "$OUT/build.log" 2>&1 \
    || { tail -30 "$OUT/build.log"; echo BUILD FAILED; exit 1; }
  BUILD_S=$(( $(date +%s) - t0 ))
  echo "build took ${BUILD_S}s"
}

# log_machine FILE: the header of a device log -- date, the GPUs (driver, SM clock), nvcc, torch / CUDA / Triton, and
# flash-linear-attention's version when its wheels are on the path -- appended to FILE.
log_machine() {
  { date -u; nvidia-smi --query-gpu=index,name,driver_version,clocks.sm --format=csv; nvcc --version | tail -1;
    python3 -c 'import torch,triton;print(torch.__version__, torch.version.cuda, triton.__version__)';
    python3 -c 'import fla; print("fla", fla.__version__)' 2>&1 | tail -1; } >> "$1" 2>&1
}
