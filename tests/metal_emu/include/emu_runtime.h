// CPU emulation runtime for Metal compute kernels (tests only). See tests/metal_emu/README in docs/metal.md.
// Every thread of a threadgroup is a fiber; the fibers of one threadgroup run on one OS thread and switch only
// at synchronisation points (threadgroup_barrier, simdgroup_barrier, simd_* collectives), which the runtime
// implements as real rendezvous: nobody passes until every participant has arrived.
#pragma once
#include <cstdint>

namespace emu {

struct Vec3 {
  unsigned x, y, z;
};

// What the [[...]] position attributes of a kernel's parameters receive.
struct ThreadPos {
  Vec3 threadgroup_position_in_grid;
  Vec3 thread_position_in_threadgroup;
  Vec3 thread_position_in_grid;
  Vec3 threads_per_threadgroup;
  Vec3 threadgroups_per_grid;
  unsigned thread_index_in_threadgroup;
  unsigned thread_index_in_simdgroup;
  unsigned simdgroup_index_in_threadgroup;
  unsigned simdgroups_per_threadgroup;
  unsigned threads_per_simdgroup;
};

enum class Coll : int {
  Sum = 1,
  PrefixIncl,
  PrefixExcl,
  Shuffle,
  Broadcast,
  Max,
  Min,
  ShuffleDown,
  ShuffleUp,
  ShuffleXor,
  SgBarrier,
};
enum class Tag : int { F32 = 1, I32, U32 };

// A simd collective over the 32 lanes of the calling thread's simdgroup. All 32 lanes must call it with the same
// op from the same source line; the runtime reports divergence or deadlock and aborts.
uint64_t simd_collective(Coll op, Tag tag, uint64_t payload, unsigned arg, const char* file, int line);
void threadgroup_barrier(const char* file, int line);
unsigned current_lane();
// Every simdgroup_matrix operation of a lane calls this once. It counts the lane's matrix operations (lanes of a
// simdgroup must agree at every rendezvous: uniform control flow) and returns the simdgroup's 256-byte record of
// that operation; *first is true for the first lane to get there, which computes (and, for stores, writes) the
// result; the other lanes copy it. Lanes thus see one matrix value, computed once, as on the GPU.
void* matrix_memo(bool* first);
[[noreturn]] void fail(const char* fmt, ...);

typedef void (*KernelFn)(void** bufs, const ThreadPos& tp);

struct ParamInfo {
  int index;          // [[buffer(index)]], or -1 for position attributes
  const char* name;   // parameter name in the .metal source
  const char* type;   // parameter type as written (after preprocessing)
  const char* attr;   // attribute text
};
struct KernelInfo {
  const char* name;
  KernelFn fn;
  const ParamInfo* params;
  int nparams;
};
struct Register {
  Register(const KernelInfo& info);
};

}  // namespace emu
