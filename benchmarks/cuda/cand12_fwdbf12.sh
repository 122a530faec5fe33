#!/bin/bash
# Session 12, helper fwdbf12: the bf16-operand forward scan delta_chunk_scan7_kernel (KDA_CUDA_CHUNK_SCAN=10,
# kernels_src/cuda/delta_chunk_scan7.cuh) with the preps' bf16 w / u0 (gdn_chunk_prep2 / kda_chunk_prep2, WB
# instances), against the default scan6 (8). Assumes the CUDA variant is built and `source benchmarks/cuda/
# device_env.sh` was done; writes under $OUT/fwdbf12. About 120 s in all.
#   1. GPU tests (float64 reference at DESIGN.md section 6 for both scans, error ratios recorded in errs.txt; long
#      runs of 64 / 128 chunks, varlen mix, graphs, staged forward, fallbacks) + the CPU emulation: ~60 s
#   2. per-kernel times, forward, scans 8 / 10 in one process (B1 T8192 H16 HV32 K=V=128 bf16): ~20 s
#   3. bench_chunk_fwd.py, scans 8 / 10, B1 T8192, with fla (issue #6's comparison), eager + graphs: ~35 s
# Decides: profile_chunk's fwd_scan10 rows (scan7 kernel time vs scan6's 0.300 ms; the prep rows: the WB preps
# should be no slower, KDA 0.571 / GDN 0.227) and bench_chunk_fwd's graph times (KDA / GDN forward vs 0.864 /
# 0.546 ms at scan 8; issue #6 targets KDA <= 0.45, GDN <= 0.28 ms). Default-worthy if every scan7 error in
# errs.txt is within section 6 (the tests pass) with margin (ratio well under 1, say <= 0.7) and the forward is
# faster for both families.
D="$OUT/fwdbf12"
mkdir -p "$D"
XD=""; python3 -c "import xdist" 2>/dev/null && XD="-n 14"
rm -f "$D/errs.txt"
SCAN7_ERRS="$D/errs.txt" timeout -k 5 90 python3 -m pytest -q $XD -p no:cacheprovider -rfE -s \
  tests/test_cuda_scan7.py tests/test_cuda_scan7_emu.py > "$D/tests.log" 2>&1
echo "fwdbf12 pytest exit $?" >> "$D/tests.log"; tail -3 "$D/tests.log"; grep -E "^FAILED|^ERROR" "$D/tests.log" | head -20
echo "fwdbf12 largest scan7 error ratios (o / state):"
python3 - "$D/errs.txt" <<'PY'
import re, sys
rows = []
for line in open(sys.argv[1]) if __import__("os").path.exists(sys.argv[1]) else []:
    m = re.search(r"SCAN7_ERR (.*): scan7 (\S+) \((\S+) of tol\) scan6 (\S+) \((\S+)\)", line)
    if m:
        rows.append((float(m.group(3)), float(m.group(5)), m.group(1)))
rows.sort(reverse=True)
print(f"{len(rows)} records; worst 8 (scan7 ratio, scan6 ratio, case):")
for r in rows[:8]:
    print(f"  {r[0]:.2f}  {r[1]:.2f}  {r[2]}")
PY
timeout -k 5 40 python3 benchmarks/cuda/profile_chunk.py --phases fwd --scans 8,10 > "$D/kernel_times.json" \
  2> "$D/kernel_times.err"
echo "fwdbf12 profile exit $?"; python3 benchmarks/cuda/profile_chunk.py --summarize "$D/kernel_times.json"
BENCH_CHUNK_SCAN=8,10 BENCH_SHAPES=B1_T8192 OUT="$D" timeout -k 5 60 \
  python3 benchmarks/cuda/bench_chunk_fwd.py > "$D/bench_fwd.log" 2>&1
echo "fwdbf12 bench exit $?"; grep -E "scan(8|10)" "$D/bench_fwd.log" | tail -8
