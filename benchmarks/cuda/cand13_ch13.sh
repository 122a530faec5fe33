#!/bin/bash
# Session 13 round 2, branch ch13 (for the candidate call): KDA's per-channel grad stage, grad3_ch2's F5 instance,
# KDA_CUDA_CHUNK_BWD_CH=5 (grad3_ch2_kernel<true, true>, delta_chunk_bwd_grad3_ch2.cuh; opt-in, 2 stays the
# default; 1 / 3 / 4 still refused as retired, other values refused as unknown). The same floating-point operations
# on the same operands in the same order; fewer integer / shuffle instructions: compile-time dA copy offsets,
# 64-bit row addresses formed once (pointer bumps) for the q / k / g loads and the dq / dk / dg stores, the expf
# select without a branch, the 16 rows' dRg . k warp sums as one transposed butterfly (16 shuffles instead of 80,
# each level adding the same two partial sums as warp_sum). Claimed bit-identical to =2.
# Checked without a GPU (nvcc 13.0, sm_90a, cuobjdump -sass): grad3_ch2_kernel<true, false> (the default) has
# main's SASS instruction for instruction; F5 168 registers (3 blocks per SM, as the default), 16 B spills (default
# 24 B); FFMA 848 / FMUL 783 in both, FADD 568 -> 504 (the 64 fewer butterfly adds), SHFL 80 -> 16, IMAD 561 -> 72,
# IADD3 529 -> 364, LEA 395 -> 182; static 5872 -> 4192 instructions; issued per warp by SASS path lengths (full
# chunk) ~7 000 -> ~5 650 (-19 %).
# Assumes the CUDA variant is built and `source benchmarks/cuda/device_env.sh` was done; one H200; writes under
# $OUT/ch13. About 80-120 s in all.
#  (1) tests, ~40-80 s with -n 14; all must pass:
#      tests/test_cuda_grad3_ch5.py: every gradient (dq, dk, dv, dg, dbeta, dh0) torch.equal between =5 and =2
#      (bf16 / fp16 / fp32 subset, T 1 / 63 / 65 / 1000 / 2048, varlen with empty sequences, GVA 2H / 4H / 8H,
#      with and without state, gates at -20 and -1e4, odd K / V, V 64 and > 128), the default run-to-run
#      deterministic, =5 against the float64 reference, each value's instance by the profiler's kernel names
#      (<true, true> for 5, <true, false> for 2 and unset), unknown values refused, GDN unaffected. A torch.equal failure
#      in dbeta only points at the transposed butterfly (row mapping); in dq / dk / dg at the row addressing.
#      Plus the retired / unknown backward knob tests (the CH knob is now read by env_choice).
#  (2) per-kernel times of the KDA backward in one process, ~20 s: rows bwd (default), bwd_ch2 (a second sample of
#      the default, for the noise), bwd_ch5. Expected grad3_ch2_kernel<true, true> ~0.80-0.87 ms against
#      grad3_ch2_kernel<true, false> ~0.93 (B1 T8192 H16 HV32 K=V=128 bf16); the other kernels unchanged. If =5 is
#      not at least ~4 % faster than both default rows, it is not worth keeping.
D="$OUT/ch13"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
timeout -k 5 150 python3 -m pytest -q $XD -p no:cacheprovider -rfE tests/test_cuda_grad3_ch5.py \
  "tests/test_cuda_chunk_bwd.py::test_retired_bwd_knob_values_are_refused" \
  "tests/test_cuda_chunk_bwd.py::test_unknown_bwd_knob_values_are_refused" \
  "tests/test_cuda_chunk_bwd.py::test_chunk_bwd_ch2_reference" > "$D/tests.log" 2>&1
echo "ch13 tests exit $?: $(tail -1 "$D/tests.log")"
grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
timeout -k 5 90 python3 benchmarks/cuda/profile_chunk.py --phases bwd --families kda --bwd-ch 2,5 \
  > "$D/kernel_times.json" 2> "$D/kernel_times.err"
echo "ch13 profile exit $?"
python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
python3 benchmarks/cuda/profile_chunk.py --kernels "$D/kernel_times.json" grad3_ch2
