"""Phase profile of our CPU kernels at 1 vs 2 threads, for telling the code's scaling losses from the machine's.

    python benchmarks/cpu/phase_profile.py prefill [--T 512] [--rounds 6]     # chunked forward, per phase
    python benchmarks/cpu/phase_profile.py decode [--H 32] [--rounds 1500]     # serving step: fork/join costs

Builds a small C++ driver with g++ against the venv's torch (about 15 s; nothing in build/ is touched) on a copy of
kernels_src/cpu:
* prefill: delta_chunk.h is instrumented (thread CPU time, CLOCK_THREAD_CPUTIME_ID, around each phase of a chunk:
  load of the chunk's rows, WY prep, the state GEMM pass(es), the intra-chunk solve, the state update, the output
  store) and chunk_fwd_entry runs for KDA and GDN at B=1 H=32 K=V=128 fp32, 1 and 2 threads alternating per round.
  Printed per phase: thread CPU per call summed over threads, and 2t/1t (median of per-round ratios): 1.00 = the
  phase costs the same on two cores as on one. CPU time leaves out waiting for the scheduler, so this stays
  readable on a loaded machine (what the neighbours do to caches and memory still enters, on both sides alike).
* decode: the fp32 serving step's parallel region (run_sequence per head, as recurrent_serve_impl) with wall-clock
  marks: when the worker starts after the region is entered, each thread's work, the end skew, the exit after the
  last task; calls where a task's CPU time is under 90 % of its wall time (preempted) are left out.
The instrumentation patterns are asserted: if delta_chunk.h changes, update them here.
"""
import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.utils.cpp_extension as cpp

ROOT = Path(__file__).resolve().parents[2]

HDR = """#include "delta_common.h"
#include <time.h>
namespace kda_prof {
struct alignas(64) Acc { double t[8]; };
inline Acc acc[2];
inline double tc() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec * 1e6 + t.tv_nsec * 1e-3; }
}
#define PROF_MARK(i) { const double _n = kda_prof::tc(); kda_prof::acc[at::get_thread_num()].t[i] += _n - _pl; _pl = _n; }
"""

EDITS = [  # (old, new) on delta_chunk.h
    ('#include "delta_common.h"\n', HDR),
    ("""  if constexpr (!PC) {
    GdnRows r;
    gdn_prep_chunk(b, Cp, r);""", """  double _pl = kda_prof::tc();
  if constexpr (!PC) {
    GdnRows r;
    gdn_prep_chunk(b, Cp, r);
    PROF_MARK(1)"""),
    ("""              [&](int64_t p) { pf(p, 2 * np); });
    residual_solve_intra();""", """              [&](int64_t p) { pf(p, 2 * np); });
    PROF_MARK(2)
    residual_solve_intra();
    PROF_MARK(4)"""),
    ("""              [&](int64_t p) { pf(np + p, 2 * np); });
  } else {
    prep_chunk_a(b, Cp);
    pf(0, 4);
    gemm<false>(Cp, Vp, Kp, 1.f, b.kg, Kp, 1, S, Vp, b.u, Vp);
    pf(1, 4);
    if (o) gemm<false>(Cp, Vp, Kp, sc, b.qg, Kp, 1, S, Vp, o, Vp);  // o = scale (Q Gam) S0; A_qk U added below
    pf(2, 4);
    residual_solve_intra();
    pf(3, 4);
    chunk_state(b, Cp, S);
  }""", """              [&](int64_t p) { pf(np + p, 2 * np); });
    PROF_MARK(5)
  } else {
    prep_chunk_a(b, Cp);
    pf(0, 4);
    PROF_MARK(1)
    gemm<false>(Cp, Vp, Kp, 1.f, b.kg, Kp, 1, S, Vp, b.u, Vp);
    pf(1, 4);
    PROF_MARK(2)
    if (o) gemm<false>(Cp, Vp, Kp, sc, b.qg, Kp, 1, S, Vp, o, Vp);  // o = scale (Q Gam) S0; A_qk U added below
    pf(2, 4);
    PROF_MARK(3)
    residual_solve_intra();
    pf(3, 4);
    PROF_MARK(4)
    chunk_state(b, Cp, S);
    PROF_MARK(5)
  }"""),
    ("""              load_chunk<T, PC, PC>(qp, kp, vp, gp, bp, d, s, hv, c0, Cc, Cp, b);
              // the next chunk""", """              double _pl = kda_prof::tc();
              load_chunk<T, PC, PC>(qp, kp, vp, gp, bp, d, s, hv, c0, Cc, Cp, b);
              PROF_MARK(0)
              // the next chunk"""),
    ("""              chunk_fwd_core<PC>(b, Cp, sc, states + j * KVp, b.o, pf);
              store_o(s, hv, c0, Cc);""", """              chunk_fwd_core<PC>(b, Cp, sc, states + j * KVp, b.o, pf);
              _pl = kda_prof::tc();
              store_o(s, hv, c0, Cc);
              PROF_MARK(6)"""),
]

PREFILL_CPP = r"""// Per-phase thread CPU time of the chunked forward (instrumented copy of delta_chunk.h), 1 vs 2 threads interleaved.
#include "delta_chunk.h"
#include <cstdio>
#include <algorithm>
#include <random>
using namespace kda_kernels::cpu;
static inline double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec * 1e-3; }
int main(int argc, char** argv) {
  const int T = atoi(argv[1]), rounds = atoi(argv[2]); const bool pc = atoi(argv[3]);
  const int64_t H = 32, K = 128, V = 128;
  std::mt19937 rng(0); std::normal_distribution<float> nd; std::uniform_real_distribution<float> ud;
  auto f32 = at::TensorOptions().dtype(at::kFloat);
  auto q = at::empty({1, T, H, K}, f32), k = at::empty({1, T, H, K}, f32), v = at::empty({1, T, H, V}, f32);
  auto g = pc ? at::empty({1, T, H, K}, f32) : at::empty({1, T, H}, f32);
  auto beta = at::empty({1, T, H}, f32), h0 = at::empty({1, H, K, V}, f32);
  for (auto* t : {&q, &v}) for (int64_t i = 0; i < t->numel(); ++i) t->data_ptr<float>()[i] = nd(rng);
  for (int64_t i = 0; i < h0.numel(); ++i) h0.data_ptr<float>()[i] = 0.01f * nd(rng);
  for (int64_t i = 0; i < g.numel(); ++i) g.data_ptr<float>()[i] = -0.1f * ud(rng);
  for (int64_t i = 0; i < beta.numel(); ++i) beta.data_ptr<float>()[i] = ud(rng);
  for (int64_t r = 0; r < T * H; ++r) {  // unit-norm k rows
    float* kr = k.data_ptr<float>() + r * K; float n = 0;
    for (int64_t c = 0; c < K; ++c) { kr[c] = nd(rng); n += kr[c] * kr[c]; }
    for (int64_t c = 0; c < K; ++c) kr[c] /= std::sqrt(n);
  }
  const char* names[7] = {"load", "prep", "pass1(u|[K;Q]S)", "pass o (KDA)", "solve", "state", "store"};
  std::vector<std::vector<double>> ph[3];  // [n][call][phase + 7: total cpu, 8: wall]
  for (int rnd = 0; rnd < rounds; ++rnd)
    for (int n : (rnd % 2 ? std::vector<int>{2, 1} : std::vector<int>{1, 2})) {
      at::set_num_threads(n);
      for (int rep = 0; rep < 2; ++rep) {
        for (auto& a : kda_prof::acc) std::fill(a.t, a.t + 8, 0.0);
        double w0 = now();
        if (pc) chunk_fwd_entry<true>("x", q, k, v, g, beta, 0.088, h0, std::nullopt);
        else chunk_fwd_entry<false>("x", q, k, v, g, beta, 0.088, h0, std::nullopt);
        double w = now() - w0;
        if (rep == 0) continue;
        std::vector<double> r(9, 0.0);
        for (int t = 0; t < 2; ++t) for (int i = 0; i < 7; ++i) r[i] += kda_prof::acc[t].t[i];
        for (int i = 0; i < 7; ++i) r[7] += r[i];
        r[8] = w;
        ph[n].push_back(r);
      }
    }
  auto med = [](std::vector<double> x) { std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  printf("%s T=%d, %d rounds, thread CPU time per call summed over threads (us; median), 2t/1t = median of per-round ratios\n", pc ? "KDA" : "GDN", T, rounds);
  for (int i = 0; i < 9; ++i) {
    std::vector<double> a, b, rr;
    for (size_t j = 0; j < ph[1].size(); ++j) { a.push_back(ph[1][j][i]); b.push_back(ph[2][j][i]); if (ph[1][j][i] > 0) rr.push_back(ph[2][j][i] / ph[1][j][i]); }
    if (med(a) <= 0) continue;
    printf("  %-18s 1t %10.1f   2t %10.1f   2t/1t %.3f\n", i < 7 ? names[i] : (i == 7 ? "sum of phases" : "wall"), med(a), med(b), rr.empty() ? 0 : med(rr));
  }
}
"""

DECODE_CPP = r"""// Instrumented replica of the fp32 decode serve path (recurrent_serve_impl's direct branch) for 1 vs 2 threads.
#include "delta_recurrent.h"
#include <time.h>
#include <cstdio>
#include <random>
#include <algorithm>
using namespace kda_kernels::cpu;
static inline double now() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec * 1e6 + t.tv_nsec * 1e-3; }
static inline double tcpu() { timespec t; clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t); return t.tv_sec * 1e6 + t.tv_nsec * 1e-3; }
struct Rec { double entry, exit, st[2], en[2], c0[2], c1[2]; int used[2]; };
int main(int argc, char** argv) {
  const int H = argc > 1 ? atoi(argv[1]) : 32, rounds = argc > 2 ? atoi(argv[2]) : 10, per = argc > 3 ? atoi(argv[3]) : 200;
  const bool pc = argc > 4 ? atoi(argv[4]) : 1;
  const int64_t K = 128, V = 128, KV = K * V;
  Dims d{1, 1, H, K, H, V, 1};
  std::vector<Seq> seqs{{0, 0, 1}};
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> q(H * K), k(H * K), v(H * V), g(H * K), beta(H), o(H * V), pool(H * KV);
  for (auto* x : {&q, &k, &v, &g, &pool}) for (auto& e : *x) e = nd(rng);
  for (int h = 0; h < H; ++h) { float s = 0; for (int c = 0; c < K; ++c) s += k[h*K+c]*k[h*K+c]; for (int c = 0; c < K; ++c) k[h*K+c] /= std::sqrt(s); }
  for (auto& e : g) e = -std::log1p(std::exp(-e));
  for (auto& e : pool) e *= 0.01f;
  for (auto& e : beta) e = 0.5f;
  const float sc = 1.f / std::sqrt(128.f);
  std::vector<Rec> recs[3];
  const int64_t grain = item_grain(seqs, KV);
  auto call = [&](Rec& r) {
    r.used[0] = r.used[1] = 0;
    r.entry = now();
    at::parallel_for(0, H, grain, [&](int64_t b, int64_t e) {
      const int t = at::get_thread_num();
      r.st[t] = now(); r.c0[t] = tcpu(); r.used[t] = 1;
      DenormalGuard guard;
      for (int64_t item = b; item < e; ++item) {
        float* row = pool.data() + item * KV;
        if (pc) run_sequence<float, true>(q.data(), k.data(), v.data(), g.data(), beta.data(), sc, d, seqs[0], item, row, o.data(), [](int64_t, const float*, int64_t, int64_t, int64_t) {});
        else run_sequence<float, false>(q.data(), k.data(), v.data(), g.data(), beta.data(), sc, d, seqs[0], item, row, o.data(), [](int64_t, const float*, int64_t, int64_t, int64_t) {});
      }
      r.c1[t] = tcpu(); r.en[t] = now();
    });
    r.exit = now();
  };
  std::vector<double> pair;  // per clean round: per-head CPU at 2 threads / at 1 thread
  for (int rnd = 0; rnd < rounds; ++rnd) {
    Rec rr[3];
    for (int n : (rnd % 2 ? std::vector<int>{2, 1} : std::vector<int>{1, 2})) {
      at::set_num_threads(n);
      Rec r; for (int i = 0; i < per; ++i) call(r);
      call(r); recs[n].push_back(r); rr[n] = r;
    }
    bool ok = true;
    for (int n : {1, 2}) for (int t = 0; t < n; ++t) if (rr[n].used[t] && (rr[n].c1[t] - rr[n].c0[t]) < 0.9 * (rr[n].en[t] - rr[n].st[t])) ok = false;
    if (ok && rr[2].used[1]) pair.push_back((rr[2].c1[0] - rr[2].c0[0] + rr[2].c1[1] - rr[2].c0[1]) / (rr[1].c1[0] - rr[1].c0[0]));
  }
  auto med = [](std::vector<double> x) { if (x.empty()) return -1.0; std::sort(x.begin(), x.end()); return x[x.size() / 2]; };
  { std::vector<double> x = pair; std::sort(x.begin(), x.end()); if (!x.empty()) printf("work inflation (2t CPU of both tasks / 1t CPU), %zu clean rounds: median %.3f  p25 %.3f  p75 %.3f\n", x.size(), x[x.size()/2], x[x.size()/4], x[3*x.size()/4]); }
  auto mn = [](std::vector<double> x) { return x.empty() ? -1.0 : *std::min_element(x.begin(), x.end()); };
  for (int n : {1, 2}) {
    std::vector<double> tot, w0, w1, s1, endskew, tail, cpu0, cpu1; int clean = 0;
    for (auto& r : recs[n]) {
      bool ok = true;
      for (int t = 0; t < n; ++t) if (r.used[t] && (r.c1[t] - r.c0[t]) < 0.9 * (r.en[t] - r.st[t])) ok = false;
      if (!ok) continue;
      ++clean;
      tot.push_back(r.exit - r.entry); w0.push_back(r.en[0] - r.st[0]); cpu0.push_back(r.c1[0] - r.c0[0]);
      if (n == 2 && r.used[1]) { w1.push_back(r.en[1] - r.st[1]); cpu1.push_back(r.c1[1]-r.c0[1]); s1.push_back(r.st[1] - r.entry); endskew.push_back(r.en[1] - r.en[0]); tail.push_back(r.exit - std::max(r.en[0], r.en[1])); }
    }
    printf("H=%d %s n=%d: %d/%zu clean calls. total min %.1f med %.1f | main work med %.1f (%.2f/head) | ", H, pc ? "kda" : "gdn", n, clean, recs[n].size(), mn(tot), med(tot), med(w0), med(w0) / (n == 2 ? (H + 1) / 2 : H));
    if (n == 2) printf("worker work med %.1f, worker start after entry med %.1f min %.1f, worker end - main end med %.1f, exit after last end med %.1f", med(w1), med(s1), mn(s1), med(endskew), med(tail));
    printf("\n");
  }
}
"""


def build(src_dir, name, code):
    (src_dir / f"{name}.cpp").write_text(code)
    lib = Path(torch.__file__).parent / "lib"
    cmd = ["g++", "-O3", "-std=c++17", "-fopenmp", "-mavx2", "-mfma", "-DCPU_KERNEL", "-DKDA_NAMESPACE=phase_profile",
           f"-I{src_dir}", f"-I{ROOT / 'torch-ext'}", *[f"-I{p}" for p in cpp.include_paths()],
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", "-w", str(src_dir / f"{name}.cpp"),
           "-o", str(src_dir / name), f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch", "-ltorch_cpu"]
    subprocess.run(cmd, check=True)
    return src_dir / name


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["prefill", "decode"])
    ap.add_argument("--T", type=int, default=512)
    ap.add_argument("--H", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--families", default="kda,gdn")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="phase_profile_") as tmp:
        src = Path(tmp)
        for f in (ROOT / "kernels_src" / "cpu").iterdir():
            shutil.copy(f, src / f.name)
        if args.what == "prefill":
            text = (src / "delta_chunk.h").read_text()
            for old, new in EDITS:
                assert text.count(old) == 1, f"phase_profile.py: pattern not found once in delta_chunk.h:\n{old}"
                text = text.replace(old, new)
            (src / "delta_chunk.h").write_text(text)
            exe = build(src, "prefill", PREFILL_CPP)
            for fam in args.families.split(","):
                subprocess.run([str(exe), str(args.T), str(args.rounds or 6), "1" if fam == "kda" else "0"], check=True)
        else:
            exe = build(src, "decode", DECODE_CPP)
            for fam in args.families.split(","):
                subprocess.run([str(exe), str(args.H), str(args.rounds or 1500), "2", "1" if fam == "kda" else "0"],
                               check=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
