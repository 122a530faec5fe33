#!/usr/bin/env bash
# Create .venv (if missing) with the pinned requirements. Used by scripts/test.sh, scripts/demo.sh and CI.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch, kernels, transformers, pytest, hypothesis, matplotlib" 2>/dev/null \
   || [ requirements.txt -nt .venv/.requirements-installed ]; then
  echo "[setup] installing requirements.txt (torch 2.13 CPU, kernels 0.17.2, transformers 5.22.2, ...)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -r requirements.txt
  touch .venv/.requirements-installed
fi
echo "[setup] .venv ready: $(.venv/bin/python -c 'import torch, kernels, transformers; print("torch", torch.__version__, "| kernels", kernels.__version__, "| transformers", transformers.__version__)')"
