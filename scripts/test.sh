#!/usr/bin/env bash
# The test command of README.md: set up .venv, build every variant this machine can build, run the test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k kda -x).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
echo "[test] building variants"
.venv/bin/python scripts/build.py
echo "[test] running tests"
# tests load the variants just built in build/ instead of rebuilding them per source hash (tests/conftest.py)
export KDA_TEST_BUILD_DIR=build
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider -rs "$@"
