#!/usr/bin/env python3
"""Plot a context-parallel benchmark JSON (benchmark_cp.py): speedup of W ranks over one device per family,
sequence length and mode, for each schedule (relay / affine) and rank-0 share, with the affine schedule's bound
(1 + c) / c that its per-rank costs imply.

    python benchmarks/cp/plot_cp.py benchmarks/cp/results/cp_h200_x2_<stamp>.json   # writes <same name>.png
"""
import json
import sys
from pathlib import Path


def bound(entry, single_ms, T):
    """Speedup limit of the affine-map scheme on 2 ranks: rank 0 runs the plain op (cost 1 per token), the
    other the transition at width K + V (cost c per token); balanced shares give (1 + c) / c."""
    b = entry["bounds"]
    if len(b) != 3 or not single_ms:
        return None
    per_tok_single = single_ms / T
    c = entry["per_rank_ms"][1] / max(1, b[2] - b[1]) / per_tok_single
    return (1 + c) / c, c


def main(path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = json.loads(Path(path).read_text())
    rows = [r for r in d["results"] if "cp" in r and "single" in r and "ms" in r["single"]]
    labels, shares, bars, bounds = [], {}, {}, []
    for r in rows:
        labels.append(f"{r['family']} {r['mode']}\nT={r['T'] // 1024}k")
        best = None
        for e in r["cp"]:
            key = f"{e.get('schedule', 'affine')} {e['share']}"  # results before session 6: affine only
            bars.setdefault(key, []).append(e.get("speedup", 0.0))
            shares.setdefault(key, []).append(e["rank0_fraction"])
            if e["share"] == "auto" and e.get("schedule", "affine") == "affine":
                best = bound(e, r["single"]["ms"], r["T"])
        bounds.append(best[0] if best else None)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    n = len(bars)
    width = 0.8 / max(1, n)
    for i, (share, ys) in enumerate(bars.items()):
        xs = [j + (i - (n - 1) / 2) * width for j in range(len(ys))]
        ax.bar(xs, ys, width, label=share)
        for x, y in zip(xs, ys):
            ax.text(x, y + 0.02, f"{y:.2f}", ha="center", fontsize=7)
    for j, b in enumerate(bounds):
        if b:
            ax.plot([j - 0.4, j + 0.4], [b, b], "k:", lw=1, label="affine (1+c)/c bound" if j == 0 else None)
    ax.axhline(1.8, color="r", lw=1, ls="--", label="target 1.8x")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(f"speedup, {d['meta']['world']} GPUs vs 1")
    ax.set_title(f"context parallel, {d['meta']['device']} x{d['meta']['world']} (NCCL), B=1 H=16 HV=32 K=V=128 "
                 f"{rows[0]['dtype'] if rows else ''}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", ncol=4)
    ax.set_ylim(0, 2.2)
    fig.tight_layout()
    out = Path(path).with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
