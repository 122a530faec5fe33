"""The worst error / tolerance per knob value and gradient from the lines a GPU test appends to its error file
(tests/test_cuda_state_fwd_bf16.py's STATE_FWD_BF16_ERRS: "... KNOB=V: dq ERR (RATIO) dk ERR (RATIO) ...").

    python3 benchmarks/cuda/worst_errs.py ERRS_FILE [KNOB]      # KNOB defaults to STATE_FWD
"""
import os
import re
import sys


def main():
    path = sys.argv[1]
    knob = sys.argv[2] if len(sys.argv) > 2 else "STATE_FWD"
    worst = {}
    for line in open(path) if os.path.exists(path) else []:
        m = re.search(knob + r"=(\d+): (.*)", line)
        if not m:
            continue
        for name, ratio in re.findall(r"(\w+) \S+ \(([0-9.]+)\)", m.group(2)):
            key = (m.group(1), name)
            worst[key] = max(worst.get(key, 0.0), float(ratio))
    if not worst:
        print(f"no {knob}= lines in {path}")
    for v in sorted({k[0] for k in worst}, key=int):
        print(f"worst err/tol {knob}={v}: " + " ".join(f"{n} {worst[(v, n)]:.3f}" for n in
                                                        ("dq", "dk", "dv", "dg", "dbeta", "dh0") if (v, n) in worst))


if __name__ == "__main__":
    main()
