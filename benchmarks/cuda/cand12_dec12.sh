#!/bin/bash
# Session 12, helper dec12: KDA_CUDA_DEC_KF16=1..4 (delta_decode_kf16_kernel, kernels_src/cuda/delta_decode_kf16.cuh):
# the decode kernel for K-first 2-byte (bf16 / fp16) pools, K = V = 128, with 4 one-warp items per block whose
# 128 x 64 state tile is copied as whole 128-byte rows (=2: whole-row stores too; =3 / =4: as 1 / 2 with p
# reduce-scattered), against the default (LEAN cfg 1).
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT/dec12. About 100 s in all (hard caps 75 + 100 s).
#   1. GPU tests, ~40 s: tests/test_cuda_decode_kf16.py (KF16=1..4 vs the default and vs the float64 reference, both
#      families, bf16/fp16 pools, bf16/fp32 inputs, B 1/3/64/256 with skipped slots, GVA, [N, C] indices with
#      num_accepted_tokens, the API with inplace_final_state on/off, other pools unchanged, bad values refused) and
#      the CPU emulation tests/test_cuda_kf16_emu.py. Expected: all pass.
#   2. bench_cuda.py --sweep12, ~55 s: one process, B = 256, 64, 1 (H16 HV32 K=V=128, graphs): fla 0.6.0's fp32 row,
#      our default rows, then K-first bf16 / fp16 pools with KDA_CUDA_DEC_KF16 = 0 1 2 3 4 4 3 2 1 0; the summary rows
#      "<fam>_decode_sweep12_summary" give each value's mean graph ms and fla_fp32_ms / ours ("x_fla").
# Decides: kda serve_bf16_pool:kf1..kf4 x_fla at B=256 against kf0 (session 10/11: 1.72-1.74x; issue #5 wants
# >= 1.8x). The best KF16 value becomes the default for K-first 2-byte pools if it is faster than kf0 at B=256 and 64
# for both families and both pool dtypes (not slower at B=1 beyond the drift between the two kf0 rows) and the
# tests pass. (Not the default as long as it is not measured.)
D="$OUT/dec12"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 8"
timeout -k 5 75 python3 -m pytest -q $XD -p no:cacheprovider -rfE tests/test_cuda_decode_kf16.py \
  tests/test_cuda_kf16_emu.py > "$D/tests.log" 2>&1
echo "dec12 pytest exit $?" >> "$D/tests.log"; tail -3 "$D/tests.log"; grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
OUT="$D" timeout -k 5 100 python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session12_dec12 --decode-only \
  --sweep12 --rep 60 --sweep-rep 40 --batches 256,64,1 > "$D/bench.log" 2>&1
echo "dec12 bench exit $?"; grep -E "sweep12_summary|\"fla_0.6.0\"|ours_serve_bf16_pool" "$D/bench.log" | head -40
