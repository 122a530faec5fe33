// Persistent decode kernel for K = V = 128 with bulk (TMA) state copies, sm_90 and newer ("decode v2").
// OPT-IN ONLY (KDA_CUDA_DEC_V2=1|2): correct (tests/test_cuda_backend.py "bulk" variants pass on the H200) but
// about 2x SLOWER than delta_decode_kernel at B=256 (1.8 TB/s fp32 vs 4.0; see docs/cuda.md, decode session 4).
//
// One CTA of 512 threads per SM walks the (sequence, value head) items blockIdx.x, blockIdx.x + gridDim.x, ...
// An item is a whole head state (128 x 128, contiguous: 64 KB fp32, 32 KB bf16/fp16), copied into shared memory
// with cp.async.bulk (one instruction per 16 KB, completion counted on an mbarrier). NBUF buffers form a ring: while
// the CTA computes item j, the copies of items j+1 .. j+NBUF-1 are in flight, and the buffer of item j is refilled
// with item j+NBUF as soon as every thread has finished reading it. So an SM keeps (NBUF-1) heads of reads in
// flight at all times instead of alternating load / compute / store phases, and no block is ever launched or
// retired during the kernel (no tail of half-empty waves).
//
// Compute reads the head from shared memory twice (fp32 math, 16-byte accesses: a warp reads 512 contiguous
// bytes, conflict-free) and stores the new state straight to global memory from registers (16 bytes per lane,
// optionally with the streaming .cs hint).
//   K-first [K, V]: a lane holds E consecutive columns of NI rows (rows rg, rg + RG, ...); the sums over K go
//                   through shared memory (16 partial rows of 128) and three CTA barriers per item.
//   V-first [V, K]: the same lane tiling over [V, K], so a row (one column of V) lies in LPR lanes of one warp and
//                   the sums over K are shuffles; one CTA barrier per item (to release the buffer).
// Serving semantics are those of delta_decode_kernel: [N] or [N, C] pool indices with num_accepted_tokens, a
// negative read row skips the sequence (zero output, nothing written), a negative write row skips the write, no
// initial state (s_in == nullptr) reads zeros, in place or not.
#pragma once

#include "delta_recurrent_fwd.cuh"

namespace kda_kernels {
namespace cuda {

constexpr int kBulkThreads = 512;
constexpr int kBulkWarps = kBulkThreads / 32;

template <typename S>
struct BulkGeo {
  static constexpr int E = 16 / static_cast<int>(sizeof(S));  // values per 16-byte chunk
  static constexpr int LPR = 128 / E;                          // lanes per 128-value row
  static constexpr int RPI = 32 / LPR;                         // rows per warp instruction (1 fp32, 2 bf16)
  static constexpr int RG = kBulkWarps * RPI;                  // row groups (a thread's rows are RG apart)
  static constexpr int NI = 128 / RG;                          // rows per thread
  static constexpr int HEAD = 128 * 128 * static_cast<int>(sizeof(S));
};

// NBUF per state width and variant (1: small ring, 2: large ring); both fit one CTA per SM (227 KB).
__host__ __device__ constexpr int bulk_nbuf(int esize, int variant) {
  return esize == 4 ? (variant == 1 ? 2 : 3) : (variant == 1 ? 3 : 6);
}

template <typename S, int NBUF>
struct BulkSmem {
  static constexpr int kRedP = NBUF * BulkGeo<S>::HEAD;  // float [16][128] partial sums of p (K-first)
  static constexpr int kRedO = kRedP + kBulkWarps * 128 * 4;  // float [16][128] partial sums of o (K-first)
  static constexpr int kDel = kRedO + kBulkWarps * 128 * 4;   // float [128] beta (v - p) (K-first)
  static constexpr int kInfo = kDel + 128 * 4;                // int64 [NBUF][2] read row, write row
  static constexpr int kBar = kInfo + NBUF * 16;              // uint64 [NBUF] mbarriers
  static constexpr int kBytes = kBar + NBUF * 8;
};

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// E values (fp32 math) as 16 bytes of S
template <typename S, int E>
__device__ __forceinline__ void bulk_store(S* dst, const float (&x)[E], bool cs) {
  if constexpr (sizeof(S) == 4) {
    const float4 v = make_float4(x[0], x[1], x[2], x[3]);
    if (cs) __stcs(reinterpret_cast<float4*>(dst), v);
    else *reinterpret_cast<float4*>(dst) = v;
  } else {
    uint32_t w[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if constexpr (std::is_same<S, __nv_bfloat16>::value) {
        __nv_bfloat162 h = __floats2bfloat162_rn(x[2 * e], x[2 * e + 1]);
        w[e] = *reinterpret_cast<uint32_t*>(&h);
      } else {
        __half2 h = __floats2half2_rn(x[2 * e], x[2 * e + 1]);
        w[e] = *reinterpret_cast<uint32_t*>(&h);
      }
    }
    const uint4 v = make_uint4(w[0], w[1], w[2], w[3]);
    if (cs) __stcs(reinterpret_cast<uint4*>(dst), v);
    else *reinterpret_cast<uint4*>(dst) = v;
  }
}

// PC: per-channel gate (KDA) or per-head gate (GDN); VF: V-first state layout; S: state storage dtype.
template <bool PC, bool VF, typename S, int NBUF>
__global__ void __launch_bounds__(kBulkThreads, 1) delta_decode_bulk_kernel(const FwdParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Gm = BulkGeo<S>;
  using L = BulkSmem<S, NBUF>;
  constexpr int E = Gm::E, LPR = Gm::LPR, RPI = Gm::RPI, RG = Gm::RG, NI = Gm::NI, HEAD = Gm::HEAD;
  constexpr int KK = 128;
  constexpr int kCopy = 16384;  // bytes per bulk copy instruction
  static_assert(HEAD % kCopy == 0, "bulk copy size");
  extern __shared__ __align__(128) unsigned char smem[];
  float* redp = reinterpret_cast<float*>(smem + L::kRedP);
  float* redo = reinterpret_cast<float*>(smem + L::kRedO);
  float* delv = reinterpret_cast<float*>(smem + L::kDel);
  int64_t* info = reinterpret_cast<int64_t*>(smem + L::kInfo);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + L::kBar);

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int sub = lane / LPR;          // which row of the warp instruction
  const int c0 = (lane % LPR) * E;     // first value of the lane's chunk within a row
  const int rg = warp * RPI + sub;     // the thread's rows: rg + i RG
  const int HV = p.HV, H = p.H, dt = p.in_dtype;
  const int64_t total = static_cast<int64_t>(p.N) * HV;
  constexpr int64_t head_elems = KK * KK;
  const int64_t row_elems = head_elems * HV;
  const int64_t grid = gridDim.x;
  const bool zero_in = p.s_in == nullptr;
  const bool hint_ld = (p.dec_hint & 1) != 0, hint_st = (p.dec_hint & 2) != 0;

  // pool rows of item it: read row, write row (not serving: the sequence)
  auto rows_of = [&](int64_t it, int64_t& in_row, int64_t& out_row) {
    const int64_t n = it / HV;
    in_row = out_row = n;
    if (p.serve) {
      if (p.idx_cols == 0) {
        in_row = out_row = p.idx[n];
      } else {
        const int start_col = p.num_accepted ? static_cast<int>(p.num_accepted[n]) - 1 : 0;
        in_row = p.idx[n * p.idx_cols + start_col];
        out_row = p.idx[n * p.idx_cols];
      }
    }
  };
  // thread 0: record item it's rows for buffer b and start its copy (or complete the phase without one)
  auto issue = [&](int64_t it, int b, int64_t in_row, int64_t out_row) {
    info[2 * b] = in_row;
    info[2 * b + 1] = out_row;
    const unsigned bar = smem_addr(&bars[b]);
    if (zero_in || in_row < 0) {
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
      return;
    }
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(HEAD) : "memory");
    const int hv = static_cast<int>(it % HV);
    const char* src = reinterpret_cast<const char*>(p.s_in) + (in_row * row_elems + hv * head_elems) * sizeof(S);
    const unsigned dst = smem_addr(smem + b * HEAD);
    uint64_t pol = 0;
    if (hint_ld) asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(pol));
#pragma unroll
    for (int c = 0; c < HEAD; c += kCopy) {
      if (hint_ld)
        asm volatile(
            "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], "
            "%4;" ::"r"(dst + c), "l"(src + c), "r"(kCopy), "r"(bar), "l"(pol)
            : "memory");
      else
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                         dst + c),
                     "l"(src + c), "r"(kCopy), "r"(bar)
                     : "memory");
    }
  };

  if (tid == 0) {
#pragma unroll
    for (int b = 0; b < NBUF; ++b)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(&bars[b])) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();
  if (tid == 0) {
    for (int b = 0; b < NBUF; ++b) {
      const int64_t it = blockIdx.x + b * grid;
      if (it >= total) break;
      int64_t in_row, out_row;
      rows_of(it, in_row, out_row);
      issue(it, b, in_row, out_row);
    }
  }

  // chunk (row r, values c0 .. c0 + E) of buffer b as fp32
  auto get = [&](int b, int r, float (&x)[E]) {
    if (zero_in) {
#pragma unroll
      for (int e = 0; e < E; ++e) x[e] = 0.f;
    } else {
      dec_load_state<S, E>(reinterpret_cast<const S*>(smem + b * HEAD) + r * KK + c0, x, E, true);
    }
  };

  for (int j = 0;; ++j) {
    const int64_t it = blockIdx.x + j * grid;
    if (it >= total) break;  // uniform over the CTA
    const int b = j % NBUF;
    const unsigned parity = static_cast<unsigned>(j / NBUF) & 1u;
    const int64_t itn = it + NBUF * grid;  // the item that refills buffer b after this one
    int64_t nin = -1, nout = -1;
    if (tid == 0 && itn < total) rows_of(itn, nin, nout);  // index loads in flight during this item
    const int64_t tok = it / HV;                           // one token per sequence
    const int hv = static_cast<int>(it % HV), h = hv / (HV / H);
    const int64_t qk_off = (tok * H + h) * KK, hv_off = (tok * HV + hv) * KK;
    const float beta = p.beta[tok * HV + hv];
    const float g0 = PC ? 0.f : p.g[tok * HV + hv];

    // this item's small inputs (issued before waiting for the state)
    float qv[VF ? E : NI], kv[VF ? E : NI], dv[VF ? E : NI];
    float vv[VF ? NI : 1];
    if constexpr (VF) {
      dec_load_in<E>(p.q, qk_off + c0, dt, E, true, qv, 0.f);
      dec_load_in<E>(p.k, qk_off + c0, dt, E, true, kv, 0.f);
      if (PC) dec_load_in<E>(p.g, hv_off + c0, kF32, E, true, dv, 0.f);
#pragma unroll
      for (int i = 0; i < NI; ++i) vv[i] = load_in(p.v, hv_off + rg + i * RG, dt);
    } else {
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int r = rg + i * RG;
        qv[i] = load_in(p.q, qk_off + r, dt);
        kv[i] = load_in(p.k, qk_off + r, dt);
        if (PC) dv[i] = p.g[hv_off + r];
      }
      vv[0] = tid < KK ? load_in(p.v, hv_off + tid, dt) : 0.f;
    }

    {  // wait for the head's bytes (or the empty phase)
      const unsigned bar = smem_addr(&bars[b]);
      unsigned done = 0;
      do {
        asm volatile(
            "{\n .reg .pred P;\n mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\n selp.u32 %0, 1, 0, P;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
      } while (!done);
    }
    const int64_t in_row = info[2 * b], out_row = info[2 * b + 1];
    const bool live = in_row >= 0;  // uniform
    S* dst = live && out_row >= 0 ? reinterpret_cast<S*>(p.s_out) + out_row * row_elems + hv * head_elems : nullptr;

    if (!live) {
      if (tid < KK) store_in(p.o, hv_off + tid, dt, 0.f);
    } else if constexpr (VF) {
      // ---- V-first: row r = column r of V; the lane's values are rows c0 .. c0 + E of K
#pragma unroll
      for (int e = 0; e < E; ++e) dv[e] = expf(PC ? dv[e] : g0);
      float kd[E];
#pragma unroll
      for (int e = 0; e < E; ++e) kd[e] = kv[e] * dv[e];
      float pr[NI];
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        float x[E];
        get(b, rg + i * RG, x);
        float a = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) a = fmaf(x[e], kd[e], a);
        pr[i] = a;
      }
#pragma unroll
      for (int off = LPR / 2; off >= 1; off /= 2)
#pragma unroll
        for (int i = 0; i < NI; ++i) pr[i] += __shfl_xor_sync(0xffffffffu, pr[i], off);
      float ov[NI];
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int r = rg + i * RG;
        const float del = beta * (vv[i] - pr[i]);
        float x[E];
        get(b, r, x);
        float a = 0.f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
          x[e] = fmaf(x[e], dv[e], kv[e] * del);
          a = fmaf(x[e], qv[e], a);
        }
        ov[i] = a;
        if (dst != nullptr) bulk_store<S, E>(dst + r * KK + c0, x, hint_st);
      }
#pragma unroll
      for (int off = LPR / 2; off >= 1; off /= 2)
#pragma unroll
        for (int i = 0; i < NI; ++i) ov[i] += __shfl_xor_sync(0xffffffffu, ov[i], off);
      if (lane % LPR == 0) {
#pragma unroll
        for (int i = 0; i < NI; ++i) store_in(p.o, hv_off + rg + i * RG, dt, p.scale * ov[i]);
      }
    } else {
      // ---- K-first: row r of K; the lane's values are columns c0 .. c0 + E of V
#pragma unroll
      for (int i = 0; i < NI; ++i) dv[i] = expf(PC ? dv[i] : g0);
      float pr[E];
#pragma unroll
      for (int e = 0; e < E; ++e) pr[e] = 0.f;
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        float x[E];
        get(b, rg + i * RG, x);
        const float kd = kv[i] * dv[i];
#pragma unroll
        for (int e = 0; e < E; ++e) pr[e] = fmaf(x[e], kd, pr[e]);
      }
      if constexpr (RPI == 2) {
#pragma unroll
        for (int e = 0; e < E; ++e) pr[e] += __shfl_xor_sync(0xffffffffu, pr[e], 16);
      }
      if (sub == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 4)
          *reinterpret_cast<float4*>(&redp[warp * KK + c0 + e]) = make_float4(pr[e], pr[e + 1], pr[e + 2], pr[e + 3]);
      }
      __syncthreads();
      if (tid < KK) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < kBulkWarps; ++w) a += redp[w * KK + tid];
        delv[tid] = beta * (vv[0] - a);
      }
      __syncthreads();
      float del[E], ov[E];
#pragma unroll
      for (int e = 0; e < E; e += 4) {
        const float4 d4 = *reinterpret_cast<const float4*>(&delv[c0 + e]);
        del[e] = d4.x; del[e + 1] = d4.y; del[e + 2] = d4.z; del[e + 3] = d4.w;
      }
#pragma unroll
      for (int e = 0; e < E; ++e) ov[e] = 0.f;
#pragma unroll
      for (int i = 0; i < NI; ++i) {
        const int r = rg + i * RG;
        float x[E];
        get(b, r, x);
#pragma unroll
        for (int e = 0; e < E; ++e) {
          x[e] = fmaf(x[e], dv[i], kv[i] * del[e]);
          ov[e] = fmaf(x[e], qv[i], ov[e]);
        }
        if (dst != nullptr) bulk_store<S, E>(dst + r * KK + c0, x, hint_st);
      }
      if constexpr (RPI == 2) {
#pragma unroll
        for (int e = 0; e < E; ++e) ov[e] += __shfl_xor_sync(0xffffffffu, ov[e], 16);
      }
      if (sub == 0) {
#pragma unroll
        for (int e = 0; e < E; e += 4)
          *reinterpret_cast<float4*>(&redo[warp * KK + c0 + e]) = make_float4(ov[e], ov[e + 1], ov[e + 2], ov[e + 3]);
      }
    }
    // every read of buffer b (and, K-first, every partial of o) is done: refill b, then sum o
    __syncthreads();
    if (tid == 0 && itn < total) issue(itn, b, nin, nout);
    if constexpr (!VF) {
      if (live && tid < KK) {
        float a = 0.f;
#pragma unroll
        for (int w = 0; w < kBulkWarps; ++w) a += redo[w * KK + tid];
        store_in(p.o, hv_off + tid, dt, p.scale * a);
      }
    }
  }
#endif  // __CUDA_ARCH__ >= 900
}

}  // namespace cuda
}  // namespace kda_kernels
