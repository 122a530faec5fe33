#!/bin/bash
# Session 11, branch dec11 (issue #5, decode at the bandwidth limit): KDA_CUDA_DEC_LEAN=3, the LEAN decode kernels with
# the state tile brought into shared memory by Hopper bulk copies (cp.async.bulk + an mbarrier per warp) for K-first
# fp32 cfg 2, K-first 2-byte cfg 1 and V-first fp32 cfg 0 (other cfgs / V-first 2-byte pools run LEAN=1's kernels), and
# KDA_CUDA_DEC_IDX=1, the serving op's pool-row index loads through the read-only path (ld.global.nc) with LEAN=1 or 3.
# Assumes the CUDA variant is built from this branch and `source benchmarks/cuda/device_env.sh` was done; writes under
# $OUT. One H200.
#   1. the new tests (LEAN=3 / IDX=1 bit-identical to LEAN=1 and against the float64 reference; the _l3 / _i1 decode
#      variants; the knobs' bad values; ~430 tests, -n 14): ~40-60 s
#   2. the A/B in one process: bench_cuda.py decode at B=256 and 64, fla 0.6.0 + our core op + every pool kind at the
#      defaults (LEAN=1), then per batch/family the sweep rows s1_l1, s1_l3, s1_l1_i1, s1_l3_i1, s1_l1_again,
#      s1_l3_again (core op and every pool kind, CUDA graphs), the 4 GB copy at start and end and the same-size
#      elementwise copies: ~60-90 s (fla's Triton compile on a fresh machine included)
# Decides: at B=256 the rows core_fwd:s1_l3 vs core_fwd:s1_l1 (fp32 target 4.1 TB/s: <= 0.2619 ms) and
# serve_fp32_pool / serve_bf16_pool / serve_fp32_pool_vfirst :s1_l3 vs :s1_l1, both families; the _again rows give the
# drift (the bf16_pool_vfirst rows run the same kernel in l1 and l3, the core_fwd rows the same in l1 and l1_i1: noise
# floors). IDX: serve_*:s1_l1_i1 vs :s1_l1 (and l3_i1 vs l3); it targets the pools' 3.4 % gap to the core op. A knob
# value becomes the default for a pool kind if it is faster there by more than the drift at B=256 and not slower at B=64.
mkdir -p "$OUT"
T0=$(date +%s)
echo "== tests (LEAN=3) at $(( $(date +%s) - T0 ))s"
timeout 90 python3 -m pytest -q -n 14 -p no:cacheprovider tests/test_cuda_backend.py \
  -k "lean_bulk or lean_bad_value or _l3 or _i1" > "$OUT/tests_dec11.log" 2>&1; tail -3 "$OUT/tests_dec11.log"
echo "== bench at $(( $(date +%s) - T0 ))s"
timeout 150 python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session11_dec11 --decode-only --sweep11 \
  --rep 50 --sweep-rep 20 --batches 256,64 > "$OUT/bench_dec11.log" 2>&1
grep -E '"d2d_copy|ew_copy|ew_inplace|s1_l|default_again' "$OUT/bench_dec11.log" | cut -c1-200
echo "== done at $(( $(date +%s) - T0 ))s"
