#!/bin/bash
# Session 11, helper scan11: the opt-in scans delta_chunk_scan6_kernel<KP, false / true> (KDA_CUDA_CHUNK_SCAN=8 / 9,
# kernels_src/cuda/delta_chunk_scan6.cuh) against the default scan5 (7). Assumes the CUDA variant is built and
# `source benchmarks/cuda/device_env.sh` was done; writes under $OUT/scan11. About 100 s in all.
#   1. GPU tests (bit-equality with scan5, float64 reference, varlen mix with empty sequences, graphs): ~45 s
#   2. per-kernel times, forward, scans 7 / 8 / 9 in one process (B1 T8192 H16 HV32 K=V=128 bf16): ~20 s
#   3. bench_chunk_fwd.py, scans 7 / 8 / 9, B1 T8192 and the varlen mix, no fla, eager + graphs: ~35 s
# Decides: profile_chunk's fwd_scan8 / fwd_scan9 scan kernel time vs fwd_scan7 (0.346 ms at session 11), and the
# graph times of bench_chunk_fwd (GDN B1 T8192 0.573 ms, varlen 2.95 ms at scan 7). The default would move to the
# faster of 8 / 9 if the tests pass (bit-equal to 7) and it is faster at both shapes for both families.
D="$OUT/scan11"
mkdir -p "$D"
timeout -k 5 75 python3 -m pytest -q -n 8 -p no:cacheprovider -rfE tests/test_cuda_scan6.py tests/test_cuda_scan6_emu.py \
  > "$D/tests.log" 2>&1
echo "scan11 pytest exit $?" >> "$D/tests.log"; tail -3 "$D/tests.log"; grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
timeout -k 5 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd --scans 7,8,9 > "$D/kernel_times.json" \
  2> "$D/kernel_times.err"
echo "scan11 profile exit $?"; python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
BENCH_CHUNK_SCAN=7,8,9 BENCH_NO_FLA=1 BENCH_SHAPES=B1_T8192,varlen OUT="$D" timeout -k 5 60 \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$D/bench_fwd.log" 2>&1
echo "scan11 bench exit $?"; grep -E "scan[789]" "$D/bench_fwd.log" | tail -14
