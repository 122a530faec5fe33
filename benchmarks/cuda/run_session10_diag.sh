#!/bin/bash
# Session 10, second call (one H200): which part of the public varlen fwd+bwd breaks CUDA graph capture
# (test_public_api_captures_in_cuda_graphs[*-chunk_varlen] failed in the first call; session 9's benchmark captured
# a larger varlen fwd+bwd).
source "$(dirname "$0")/device_env.sh"
BUILD_TIMEOUT=250 build_cuda 16
timeout 200 python3 benchmarks/cuda/diag_capture.py > "$OUT/diag_capture.log" 2>&1
echo "diag exit $?" >> "$OUT/diag_capture.log"
cat "$OUT/diag_capture.log"
