#!/usr/bin/env bash
# From a fresh clone: create .venv from requirements.txt if missing, then run demo.py (build, release into a
# local hub cache, load offline, run Kimi-Linear and Qwen3-Next on kda-kernels). Arguments go to demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    echo "==> creating .venv and installing requirements.txt (torch, kernels, transformers, ...)"
    python3 -m venv .venv
    .venv/bin/pip install -r requirements.txt
fi
exec .venv/bin/python demo.py "$@"
