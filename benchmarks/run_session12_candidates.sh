#!/bin/bash
# Session 12, the candidate call (one H200): main with four branches merged behind knobs, defaults unchanged --
#   retire12 (scan3 / split / scan5 retired, unknown knob values refused, one GDN gate-prefix scan shared with
#   grad3_gdn), fwdbf12 (scan7: the forward scan on bf16 operands, KDA_CUDA_CHUNK_SCAN=10 / 11), sbwd12 (state_bwd3
#   on bf16 operands, KDA_CUDA_CHUNK_BWD_STATE_BWD=9 / 10), dec12 (K-first 16-bit-pool decode, KDA_CUDA_DEC_KF16=1..4).
#   build -> the new GPU tests in one pytest run -> per-kernel times of the forward scans and the backward state
#   kernels (the defaults' rows also check retire12's shared gate prefix) -> decode sweep -> public fwd / fwd+bwd.
# The steps are the helpers' benchmarks/cuda/cand12_*.sh, merged so the call fits its time (retire12's own tests run
# in the verification call with every other CUDA test file).
source "$(dirname "$0")/cuda/device_env.sh"
LOG="$OUT/all.log"
CALL_S=${CALL_S:-560}
left() { echo $(( CALL_S - SECONDS )); }
log_machine "$LOG"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-150} build_cuda 16
echo "== build took ${BUILD_S}s" | tee -a "$LOG"
mkdir -p "$OUT/fwdbf12" "$OUT/sbwd12" "$OUT/dec12"
SCAN7_ERRS="$OUT/fwdbf12/errs.txt" timeout -k 5 160 python3 -m pytest -q -n 14 -p no:cacheprovider -rfEP \
  tests/test_cuda_scan7.py tests/test_cuda_state_bwd_bf16.py tests/test_cuda_decode_kf16.py > "$OUT/tests.log" 2>&1
echo "pytest exit $? at ${SECONDS}s: $(grep -E '[0-9]+ (passed|failed)' "$OUT/tests.log" | tail -1)" | tee -a "$LOG"
grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -30
cp "$OUT/tests.log" "$OUT/sbwd12/tests.log"
python3 - "$OUT/fwdbf12/errs.txt" <<'PY'
import os, re, sys
rows = []
if os.path.exists(sys.argv[1]):
    for line in open(sys.argv[1]):
        m = re.match(r"SCAN7_ERR (.*): 10 (\S+) 11 (\S+) 8 (\S+)", line.strip())
        if m:
            rows.append((float(m.group(2)), float(m.group(3)), float(m.group(4)), m.group(1)))
print(f"fwdbf12 error / tolerance, {len(rows)} records; worst of each (10, 11, 8):",
      [max((r[i] for r in rows), default=None) for i in range(3)])
for r in sorted(rows, reverse=True)[:6]:
    print(f"  10 {r[0]:.3f}  11 {r[1]:.3f}  8 {r[2]:.3f}  {r[3]}")
PY
python3 - "$OUT/tests.log" <<'PY'
import re, sys
worst = {}
for line in open(sys.argv[1]):
    m = re.search(r"\[state_bwd bf16\] (\S+) (\S+) (\S+) KDA_CUDA_CHUNK_BWD_STATE_BWD=(\d+): (.*)", line)
    if m:
        for n, e, r in re.findall(r"(\w+) (\S+) \((\S+)\)", m.group(5)):
            k = (m.group(4), n)
            if float(r) > worst.get(k, (0, ""))[0]:
                worst[k] = (float(r), f"{m.group(1)} {m.group(2)} {m.group(3)} err {e}")
for k in sorted(worst):
    print(f"STATE_BWD={k[0]} {k[1]}: worst error/bound {worst[k][0]:.3f} ({worst[k][1]})")
PY
timeout -k 5 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd --scans 8,10,11 > "$OUT/fwdbf12/kernel_times.json" \
  2> "$OUT/fwdbf12/kernel_times.err"
echo "fwd profile exit $? at ${SECONDS}s" | tee -a "$LOG"
python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/fwdbf12/kernel_times.json"
timeout -k 5 50 python3 benchmarks/cuda/profile_chunk.py --phases bwd --bwd-state-bwd 4,9,10 \
  > "$OUT/sbwd12/kernel_times.json" 2> "$OUT/sbwd12/kernel_times.err"
echo "bwd profile exit $? at ${SECONDS}s" | tee -a "$LOG"
python3 benchmarks/cuda/profile_chunk.py --summarize "$OUT/sbwd12/kernel_times.json"
OUT="$OUT/dec12" timeout -k 5 100 python3 benchmarks/cuda/bench_cuda.py --prefix cuda_decode_session12_dec12 \
  --decode-only --sweep12 --rep 60 --sweep-rep 40 --batches 256,64,1 > "$OUT/dec12/bench.log" 2>&1
echo "dec12 bench exit $? at ${SECONDS}s" | tee -a "$LOG"
grep -E "sweep12_summary" "$OUT/dec12/bench.log" | cut -c1-400 | head -20
BENCH_NO_FLA=1 BENCH_CHUNK_SCAN=8,10,11 BENCH_SHAPES=B1_T8192,varlen OUT="$OUT/fwdbf12" \
  timeout -k 5 $(( $(left) > 130 ? 50 : 30 )) python3 benchmarks/cuda/bench_chunk_fwd.py > "$OUT/fwdbf12/bench_fwd.log" 2>&1
echo "fwd bench exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/fwdbf12/bench_fwd.log" | cut -c1-240
BENCH_OURS_VARIANTS="KDA_CUDA_CHUNK_BWD_STATE_BWD=9;KDA_CUDA_CHUNK_BWD_STATE_BWD=10" BENCH_SHAPES=B1_T8192 \
  BENCH_SKIP_RECURRENT=1 BENCH_PHASES=ours OUT="$OUT/sbwd12" timeout -k 5 $(( $(left) - 10 )) \
  python3 benchmarks/cuda/bench_chunk_bwd.py > "$OUT/sbwd12/bench_bwd.log" 2>&1
echo "bwd bench exit $? at ${SECONDS}s" | tee -a "$LOG"; grep '^{' "$OUT/sbwd12/bench_bwd.log" | cut -c1-260
tar czf /tmp/results.tgz -C "$OUT" --exclude=build.log . && find "$OUT" -type f ! -name build.log -delete \
  && mv /tmp/results.tgz "$OUT/results.tgz"
