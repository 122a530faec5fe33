// Test kernels for the emulator itself (tests/test_metal_emu.py): semantics of the shimmed metal_stdlib subset,
// and planted bugs the harness must report:
//   -DKDA_PLANT_MISSING_BARRIER  drops the barrier between threadgroup-memory writes and reads of other threads
//   -DKDA_PLANT_OOB              reads one element past the end of the input buffer
//   -DKDA_PLANT_DIVERGENT        calls simd_sum in lane-divergent control flow
#include <metal_stdlib>
using namespace metal;

struct SelftestParams {
  int n;
};

// out[i] = sum over the threadgroup of x, computed through threadgroup memory (one partial per simdgroup)
kernel void emu_selftest_tg_reduce(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                                   constant SelftestParams& p [[buffer(2)]],
                                   uint tid [[thread_index_in_threadgroup]], uint sg [[simdgroup_index_in_threadgroup]],
                                   uint lane [[thread_index_in_simdgroup]], uint nsg [[simdgroups_per_threadgroup]],
                                   uint3 tgp [[threadgroup_position_in_grid]],
                                   uint3 ntg [[threads_per_threadgroup]]) {
  threadgroup float part[32];
  const uint i = tgp.x * ntg.x + tid;
#ifdef KDA_PLANT_OOB
  float val = x[i + 1];  // planted: the last thread reads past the end
#else
  float val = int(i) < p.n ? x[i] : 0.0f;
#endif
  val = simd_sum(val);
  if (lane == 0) part[sg] = val;
#ifndef KDA_PLANT_MISSING_BARRIER
  threadgroup_barrier(mem_flags::mem_threadgroup);
#endif
  if (tid == 0) {
    float acc = 0.0f;
    for (uint s = 0; s < nsg; ++s) acc += part[s];
    out[tgp.x] = acc;
  }
}

// Every simd collective and conversion the kernels may use; results per lane in out[op * 64 + thread].
kernel void emu_selftest_simd(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                              device half* hout [[buffer(2)]], device bfloat* bout [[buffer(3)]],
                              uint tid [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]]) {
  const float a = x[tid];
  const uint N = 64;
  out[0 * N + tid] = simd_sum(a);
  out[1 * N + tid] = simd_prefix_inclusive_sum(a);
  out[2 * N + tid] = simd_prefix_exclusive_sum(a);
  out[3 * N + tid] = simd_shuffle(a, ushort((lane * 7) % 32));
  out[4 * N + tid] = simd_broadcast(a, ushort(5));
  out[5 * N + tid] = simd_shuffle_xor(a, ushort(3));
  out[6 * N + tid] = simd_max(a);
  out[7 * N + tid] = simd_min(a);
  out[8 * N + tid] = float(simd_sum(int(lane)));
  out[9 * N + tid] = simd_shuffle_down(a, ushort(1));
#ifdef KDA_PLANT_DIVERGENT
  if (lane < 16) out[10 * N + tid] = simd_sum(a);  // planted: only half the lanes reach the collective
#endif
  hout[tid] = half(a * 3.3f);
  bout[tid] = bfloat(a * 3.3f);
}

// simdgroup matrices: out0 = A * B + C, out1 = A^T (transposed load), out2 = B stored transposed; one simdgroup.
kernel void emu_selftest_matrix(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                                device const float* c [[buffer(2)]], device float* out [[buffer(3)]],
                                uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];
  simdgroup_float8x8 ma, mb, mc, md;
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8);
  simdgroup_load(mc, c, 8);
  simdgroup_multiply_accumulate(md, ma, mb, mc);
  simdgroup_store(md, out, 8);
  simdgroup_load(md, a, 8, ulong2(0, 0), true);
  simdgroup_store(md, out + 64, 8);
  simdgroup_store(mb, tile, 8, ulong2(0, 0), true);
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[128 + lane] = tile[lane];
  out[160 + lane] = tile[32 + lane];
}
