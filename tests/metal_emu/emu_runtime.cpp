// CPU emulation runtime for Metal compute kernels: fiber scheduler, simd collectives, barriers, and a job runner
// that allocates buffers, executes launches (raw launches, or a host plan from kernels_src/metal/delta_plan.h)
// and dumps results. This file is compiled WITHOUT sanitizer instrumentation: its own bookkeeping is invisible
// to ThreadSanitizer/AddressSanitizer, which then only see the kernels' memory accesses. Happens-before between
// threads of a threadgroup is reported to ThreadSanitizer only where Metal guarantees it (barriers), so a
// missing barrier is a data race that TSan reports deterministically (the schedule itself is deterministic).
#include "emu_runtime.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifdef EMU_TSAN
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
}
#define TSAN_ACQUIRE(a) __tsan_acquire((void*)(a))
#define TSAN_RELEASE(a) __tsan_release((void*)(a))
#else
#define TSAN_ACQUIRE(a) ((void)0)
#define TSAN_RELEASE(a) ((void)0)
#endif

#if !defined(__x86_64__)
#error "the emulator's fiber switch is written for x86-64"
#endif

// void emu_ctx_switch(void** save_sp, void* load_sp): saves callee-saved registers on the current stack, stores
// the stack pointer to *save_sp, switches to load_sp and restores the registers saved there.
extern "C" void emu_ctx_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl emu_ctx_switch
  .type emu_ctx_switch,@function
emu_ctx_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_ctx_switch,.-emu_ctx_switch
  .section .note.GNU-stack,"",@progbits
  .text
)");

namespace emu {

namespace {

std::map<std::string, KernelInfo>& registry() {
  static std::map<std::string, KernelInfo> r;
  return r;
}

enum State { RUN = 0, WAIT_SIMD = 1, WAIT_BAR = 2, DONE = 3 };
constexpr size_t kStack = 512 * 1024;

struct Fiber {
  void* sp = nullptr;
  char* map = nullptr;  // guard page + stack
  void* tsan = nullptr;
  unsigned tid = 0, lane = 0, sg = 0;
  int state = DONE;
  long mm = 0;  // simdgroup matrix operations executed
  ThreadPos pos{};
};

struct SimdSlot {
  int arrived = 0;
  Coll op{};
  Tag tag{};
  const char* file = nullptr;
  int line = 0;
  long mm = 0;
  unsigned sgb_epoch = 0;  // completed simdgroup_barrier instances
  uint64_t in[32];
  unsigned arg[32];
  uint64_t out[32];
};

struct LaunchDesc {
  const KernelInfo* k;
  void** bufs;
  Vec3 grid, tg;
};

struct MemoEntry {
  bool done;
  alignas(16) char bytes[256];
};

struct Worker {
  std::vector<std::unique_ptr<Fiber>> fibers;
  std::vector<std::vector<MemoEntry>> memo;  // per simdgroup, indexed by the lanes' matrix-op counter
  std::vector<SimdSlot> simds;
  void* sched_sp = nullptr;
  void* sched_tsan = nullptr;
  Fiber* cur = nullptr;
  unsigned nthreads = 0;
  int bar_arrived = 0;
  unsigned bar_epoch = 0;  // completed threadgroup_barrier instances
  const char* bar_file = nullptr;
  int bar_line = 0;
  // Per-threadgroup sync addresses: [parity] threadgroup barrier, [2 + 2 * sg + parity] simdgroup barrier.
  // Consecutive barrier instances alternate between two addresses: a thread resuming from instance k acquires
  // only what was released at instance k, not the releases of threads that already reached instance k + 1.
  char* sync = nullptr;
  const LaunchDesc* L = nullptr;
  Vec3 gpos{};
  char group_token = 0;  // happens-before from one threadgroup to the next on this worker (they reuse memory)
};

thread_local Worker* tW = nullptr;
char g_launch_start, g_launch_end;  // addresses used as happens-before tokens between host and kernels
std::string g_drop_barrier;         // "file:line" of a barrier to drop (harness self-test only)

const char* base_name(const char* p) {
  const char* s = std::strrchr(p, '/');
  return s ? s + 1 : p;
}

void to_sched(Worker* w, Fiber* f) {
#ifdef EMU_TSAN
  __tsan_switch_to_fiber(w->sched_tsan, 1 /* no sync */);
#endif
  emu_ctx_switch(&f->sp, w->sched_sp);
}

void to_fiber(Worker* w, Fiber* f) {
  w->cur = f;
#ifdef EMU_TSAN
  __tsan_switch_to_fiber(f->tsan, 1 /* no sync */);
#endif
  emu_ctx_switch(&w->sched_sp, f->sp);
  w->cur = nullptr;
}

[[noreturn]] void fiber_entry() {
  Worker* w = tW;
  Fiber* f = w->cur;
  TSAN_ACQUIRE(&g_launch_start);
  // The fibers of the previous threadgroup on this worker used the same threadgroup storage (the emulator's
  // artifact; on the GPU each threadgroup has its own), so order them before this one.
  TSAN_ACQUIRE(&w->group_token);
  w->L->k->fn(w->L->bufs, f->pos);
  f->state = DONE;
  TSAN_RELEASE(&w->group_token);
  TSAN_RELEASE(&g_launch_end);
  to_sched(w, f);
  __builtin_unreachable();
}

void init_stack(Fiber* f) {
  if (!f->map) {
    size_t page = size_t(sysconf(_SC_PAGESIZE));
    void* m = mmap(nullptr, kStack + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) fail("mmap of a fiber stack failed");
    mprotect(m, page, PROT_NONE);  // guard page: a stack overflow faults instead of corrupting memory
    f->map = (char*)m;
#ifdef EMU_TSAN
    f->tsan = __tsan_create_fiber(0);
#endif
  }
  size_t page = size_t(sysconf(_SC_PAGESIZE));
  uintptr_t top = (uintptr_t)(f->map + page + kStack) & ~uintptr_t(15);
  void** p = (void**)top;
  *--p = nullptr;                     // fake return address of fiber_entry (keeps the ABI alignment)
  *--p = (void*)&fiber_entry;         // where emu_ctx_switch's `ret` goes
  for (int i = 0; i < 6; ++i) *--p = nullptr;  // rbp rbx r12 r13 r14 r15
  f->sp = p;
}

const char* state_name(int s) {
  switch (s) {
    case RUN: return "runnable";
    case WAIT_SIMD: return "waiting in a simd collective";
    case WAIT_BAR: return "waiting at threadgroup_barrier";
    default: return "returned";
  }
}

void run_group(Worker* w, Vec3 gpos) {
  const LaunchDesc& L = *w->L;
  w->gpos = gpos;
  w->bar_arrived = 0;
  w->bar_epoch = 0;
  for (auto& s : w->simds) {
    s.arrived = 0;
    s.sgb_epoch = 0;
  }
  w->memo.resize(w->simds.size());
  for (auto& m : w->memo) m.clear();
  w->sync = (char*)std::malloc(2 + 2 * w->simds.size());  // fresh addresses: no happens-before between threadgroups
  for (unsigned t = 0; t < w->nthreads; ++t) {
    Fiber* f = w->fibers[t].get();
    f->tid = t;
    f->lane = t % 32;
    f->sg = t / 32;
    f->state = RUN;
    f->mm = 0;
    ThreadPos& p = f->pos;
    p.threadgroup_position_in_grid = gpos;
    p.threads_per_threadgroup = L.tg;
    p.threadgroups_per_grid = L.grid;
    p.thread_position_in_threadgroup = Vec3{t % L.tg.x, (t / L.tg.x) % L.tg.y, t / (L.tg.x * L.tg.y)};
    p.thread_position_in_grid = Vec3{gpos.x * L.tg.x + p.thread_position_in_threadgroup.x,
                                     gpos.y * L.tg.y + p.thread_position_in_threadgroup.y,
                                     gpos.z * L.tg.z + p.thread_position_in_threadgroup.z};
    p.thread_index_in_threadgroup = t;
    p.thread_index_in_simdgroup = t % 32;
    p.simdgroup_index_in_threadgroup = t / 32;
    p.simdgroups_per_threadgroup = w->nthreads / 32;
    p.threads_per_simdgroup = 32;
    init_stack(f);
  }
  for (;;) {
    bool progress = false, all_done = true;
    for (unsigned t = 0; t < w->nthreads; ++t) {
      Fiber* f = w->fibers[t].get();
      if (f->state == RUN) {
        to_fiber(w, f);
        progress = true;
      }
      if (f->state != DONE) all_done = false;
    }
    if (all_done) break;
    if (!progress) {
      std::string msg;
      for (unsigned t = 0; t < w->nthreads; ++t) {
        Fiber* f = w->fibers[t].get();
        if (t == 0 || f->state != w->fibers[t - 1]->state)
          msg += "\n  thread " + std::to_string(t) + "+: " + state_name(f->state);
      }
      fail("deadlock: no thread of the threadgroup can proceed (divergent barrier or simd collective)%s",
           msg.c_str());
    }
  }
  std::free(w->sync);
  w->sync = nullptr;
}

void compute(SimdSlot& s) {
  auto f32 = [](uint64_t p) { float x; std::memcpy(&x, &p, 4); return x; };
  auto i32 = [](uint64_t p) { int32_t x; std::memcpy(&x, &p, 4); return x; };
  auto u32 = [](uint64_t p) { return uint32_t(p); };
  auto pf = [](float x) { uint64_t p = 0; std::memcpy(&p, &x, 4); return p; };
  auto pi = [](int32_t x) { uint64_t p = 0; std::memcpy(&p, &x, 4); return p; };
  auto pu = [](uint32_t x) { return uint64_t(x); };
  auto lane_src = [&](int l, int src) -> uint64_t {  // out-of-range source lanes return the lane's own value
    return (src >= 0 && src < 32) ? s.in[src] : s.in[l];
  };
  switch (s.op) {
    case Coll::SgBarrier:
      for (int l = 0; l < 32; ++l) s.out[l] = 0;
      return;
    case Coll::Shuffle:
    case Coll::Broadcast:
      for (int l = 0; l < 32; ++l) s.out[l] = lane_src(l, int(s.arg[l]));
      if (s.op == Coll::Broadcast)
        for (int l = 1; l < 32; ++l)
          if (s.arg[l] != s.arg[0]) fail("simd_broadcast: lanes disagree on the source lane");
      return;
    case Coll::ShuffleDown:
      for (int l = 0; l < 32; ++l) s.out[l] = lane_src(l, l + int(s.arg[l]));
      return;
    case Coll::ShuffleUp:
      for (int l = 0; l < 32; ++l) s.out[l] = lane_src(l, l - int(s.arg[l]));
      return;
    case Coll::ShuffleXor:
      for (int l = 0; l < 32; ++l) s.out[l] = lane_src(l, l ^ int(s.arg[l]));
      return;
    default:
      break;
  }
  // reductions and scans, in the value's own type
  if (s.op == Coll::Sum || s.op == Coll::Max || s.op == Coll::Min) {
    uint64_t v[32];
    for (int l = 0; l < 32; ++l) v[l] = s.in[l];
    for (int w = 16; w >= 1; w /= 2)  // pairwise tree, as a butterfly reduction would add
      for (int l = 0; l < w; ++l) {
        uint64_t a = v[l], b = v[l + w];
        if (s.tag == Tag::F32) {
          float x = f32(a), y = f32(b);
          v[l] = pf(s.op == Coll::Sum ? x + y : s.op == Coll::Max ? (x < y ? y : x) : (y < x ? y : x));
        } else if (s.tag == Tag::I32) {
          int32_t x = i32(a), y = i32(b);
          v[l] = pi(s.op == Coll::Sum ? int32_t(uint32_t(x) + uint32_t(y)) : s.op == Coll::Max ? (x < y ? y : x) : (y < x ? y : x));
        } else {
          uint32_t x = u32(a), y = u32(b);
          v[l] = pu(s.op == Coll::Sum ? x + y : s.op == Coll::Max ? (x < y ? y : x) : (y < x ? y : x));
        }
      }
    for (int l = 0; l < 32; ++l) s.out[l] = v[0];
    return;
  }
  // prefix sums
  bool incl = s.op == Coll::PrefixIncl;
  if (s.tag == Tag::F32) {
    float acc = 0.0f;
    for (int l = 0; l < 32; ++l) {
      float x = f32(s.in[l]);
      if (incl) acc += x;
      s.out[l] = pf(acc);
      if (!incl) acc += x;
    }
  } else {
    uint32_t acc = 0;
    for (int l = 0; l < 32; ++l) {
      uint32_t x = u32(s.in[l]);
      if (incl) acc += x;
      s.out[l] = pu(acc);
      if (!incl) acc += x;
    }
  }
}

void run_launch(const LaunchDesc& L, int nworkers) {
  unsigned nthreads = L.tg.x * L.tg.y * L.tg.z;
  if (nthreads == 0 || nthreads > 1024) fail("%s: threadgroup of %u threads (Metal allows 1..1024)", L.k->name, nthreads);
  if (nthreads % 32) fail("%s: threadgroup of %u threads is not a whole number of simdgroups", L.k->name, nthreads);
  unsigned ngroups = L.grid.x * L.grid.y * L.grid.z;
  if (ngroups == 0) return;
  TSAN_RELEASE(&g_launch_start);
  std::atomic<unsigned> next{0};
  static std::vector<std::unique_ptr<Worker>> workers;
  while ((int)workers.size() < nworkers) workers.emplace_back(new Worker);
  auto body = [&](Worker* w) {
    tW = w;
#ifdef EMU_TSAN
    w->sched_tsan = __tsan_get_current_fiber();
#endif
    w->L = &L;
    w->nthreads = nthreads;
    while (w->fibers.size() < nthreads) w->fibers.emplace_back(new Fiber);
    w->simds.assign(nthreads / 32, SimdSlot{});
    for (;;) {
      unsigned g = next.fetch_add(1);
      if (g >= ngroups) break;
      run_group(w, Vec3{g % L.grid.x, (g / L.grid.x) % L.grid.y, g / (L.grid.x * L.grid.y)});
    }
    tW = nullptr;
  };
  int nw = nworkers < 1 ? 1 : nworkers;
  if (nw == 1 || ngroups == 1) {
    body(workers[0].get());
  } else {
    std::vector<std::thread> th;
    for (int i = 0; i < nw; ++i) th.emplace_back(body, workers[i].get());
    for (auto& t : th) t.join();
  }
  TSAN_ACQUIRE(&g_launch_end);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
Register::Register(const KernelInfo& info) { registry()[info.name] = info; }

unsigned current_lane() { return tW->cur->lane; }

void* matrix_memo(bool* first) {
  Worker* w = tW;
  Fiber* f = w->cur;
  auto& log = w->memo[f->sg];
  size_t i = size_t(f->mm++);
  if (log.size() <= i) log.resize(i + 1, MemoEntry{false, {}});
  *first = !log[i].done;
  log[i].done = true;
  return log[i].bytes;
}

void fail(const char* fmt, ...) {
  std::fflush(stdout);
  std::fprintf(stderr, "EMU ERROR: ");
  va_list ap;
  va_start(ap, fmt);
  std::vfprintf(stderr, fmt, ap);
  va_end(ap);
  if (tW && tW->L) {
    std::fprintf(stderr, "\n  in kernel %s, threadgroup (%u,%u,%u)", tW->L->k->name, tW->gpos.x, tW->gpos.y,
                 tW->gpos.z);
    if (tW->cur) std::fprintf(stderr, ", thread %u", tW->cur->tid);
  }
  std::fprintf(stderr, "\n");
  std::fflush(stderr);
  _exit(3);
}

bool drop_barrier(const char* file, int line);

uint64_t simd_collective(Coll op, Tag tag, uint64_t payload, unsigned arg, const char* file, int line) {
  if (op == Coll::SgBarrier && drop_barrier(file, line)) return 0;
  Worker* w = tW;
  Fiber* f = w->cur;
  SimdSlot& s = w->simds[f->sg];
  if (s.arrived == 0) {
    s.op = op;
    s.tag = tag;
    s.file = file;
    s.line = line;
    s.mm = f->mm;
  } else {
    if (s.op != op || s.line != line || std::strcmp(s.file, file) != 0)
      fail("divergent simdgroup: lane %u reached %s:%d while other lanes wait at %s:%d", f->lane, base_name(file),
           line, base_name(s.file), s.line);
    if (s.mm != f->mm)
      fail("divergent simdgroup: lanes executed different numbers of simdgroup_matrix operations before %s:%d",
           base_name(file), line);
  }
  s.in[f->lane] = payload;
  s.arg[f->lane] = arg;
  char* sync = w->sync + 2 + 2 * f->sg + (s.sgb_epoch & 1);
  if (op == Coll::SgBarrier) TSAN_RELEASE(sync);
  if (++s.arrived < 32) {
    f->state = WAIT_SIMD;
    to_sched(w, f);
  } else {
    compute(s);
    s.arrived = 0;
    if (op == Coll::SgBarrier) s.sgb_epoch++;
    for (unsigned l = 0; l < 32; ++l) w->fibers[f->sg * 32 + l]->state = RUN;
  }
  if (op == Coll::SgBarrier) TSAN_ACQUIRE(sync);
  return s.out[f->lane];
}

bool drop_barrier(const char* file, int line) {
  if (g_drop_barrier.empty() || g_drop_barrier != std::string(base_name(file)) + ":" + std::to_string(line))
    return false;
  static bool said = false;
  if (!said) std::fprintf(stderr, "EMU: dropping the barrier at %s\n", g_drop_barrier.c_str());
  said = true;
  return true;
}

void threadgroup_barrier(const char* file, int line) {
  if (drop_barrier(file, line)) return;
  Worker* w = tW;
  Fiber* f = w->cur;
  if (w->bar_arrived == 0) {
    w->bar_file = file;
    w->bar_line = line;
  } else if (w->bar_line != line || std::strcmp(w->bar_file, file) != 0) {
    fail("thread %u reached threadgroup_barrier at %s:%d while others wait at %s:%d", f->tid, base_name(file), line,
         base_name(w->bar_file), w->bar_line);
  }
  char* sync = w->sync + (w->bar_epoch & 1);
  TSAN_RELEASE(sync);
  if ((unsigned)++w->bar_arrived < w->nthreads) {
    f->state = WAIT_BAR;
    to_sched(w, f);
  } else {
    w->bar_arrived = 0;
    w->bar_epoch++;
    for (unsigned t = 0; t < w->nthreads; ++t) w->fibers[t]->state = RUN;
  }
  TSAN_ACQUIRE(sync);
}

}  // namespace emu

// ---------------------------------------------------------------------------------------------------------------
// Job runner
#include "delta_plan.h"

namespace {

using emu::fail;

struct Buf {
  std::vector<char>* dummy = nullptr;
  char* p = nullptr;
  size_t bytes = 0;
};

std::map<std::string, Buf> g_bufs;

void alloc_buf(const std::string& name, size_t bytes, const std::string& init) {
  if (g_bufs.count(name)) fail("buffer %s defined twice", name.c_str());
  Buf b;
  b.bytes = bytes;
  b.p = (char*)std::malloc(bytes ? bytes : 1);  // separate allocations: AddressSanitizer redzones around each
  if (init == "zero") {
    std::memset(b.p, 0, bytes);
  } else if (init == "poison") {
    std::memset(b.p, 0xff, bytes);  // NaN in float, half and bfloat
  } else {
    std::ifstream in(init, std::ios::binary);
    if (!in) fail("cannot read %s", init.c_str());
    in.seekg(0, std::ios::end);
    size_t n = size_t(in.tellg());
    in.seekg(0);
    if (n < bytes) fail("buffer %s: file %s has %zu bytes, need %zu", name.c_str(), init.c_str(), n, bytes);
    in.read(b.p, std::streamsize(bytes));
  }
  g_bufs[name] = b;
}

void dump_buf(const std::string& name, const std::string& path) {
  auto it = g_bufs.find(name);
  if (it == g_bufs.end()) fail("dump of unknown buffer %s", name.c_str());
  std::ofstream out(path, std::ios::binary);
  out.write(it->second.p, std::streamsize(it->second.bytes));
}

struct RawBind {
  int index;
  std::string buf;
  std::string param;  // intended kernel parameter (plans); empty for raw launches
};

const emu::KernelInfo* find_kernel(const std::string& name) {
  auto& r = emu::registry();
  auto it = r.find(name);
  if (it == r.end()) fail("kernel %s is not in the emulated library", name.c_str());
  return &it->second;
}

// Checks the host's bindings against the kernel's declared [[buffer(i)]] parameters: every declared buffer bound,
// nothing bound at an undeclared index, and (for plans) the bound buffer's role equals the parameter's name.
void check_binds(const emu::KernelInfo* k, const std::vector<RawBind>& binds, bool check_names) {
  for (int i = 0; i < k->nparams; ++i) {
    const emu::ParamInfo& p = k->params[i];
    if (p.index < 0) continue;
    int found = 0;
    for (auto& b : binds)
      if (b.index == p.index) {
        ++found;
        if (check_names && b.param != p.name)
          fail("%s: host binds '%s' (buffer %s) at index %d, where the kernel declares '%s'", k->name,
               b.param.c_str(), b.buf.c_str(), p.index, p.name);
      }
    if (found != 1) fail("%s: buffer index %d (%s) bound %d times", k->name, p.index, p.name, found);
  }
  for (auto& b : binds) {
    bool ok = false;
    for (int i = 0; i < k->nparams; ++i) ok |= k->params[i].index == b.index;
    if (!ok) fail("%s: host binds index %d, which the kernel does not declare", k->name, b.index);
  }
}

void launch(const std::string& kname, emu::Vec3 grid, emu::Vec3 tg, const std::vector<RawBind>& binds,
            bool check_names, int nworkers) {
  const emu::KernelInfo* k = find_kernel(kname);
  check_binds(k, binds, check_names);
  std::vector<void*> table(64, nullptr);
  for (auto& b : binds) {
    auto it = g_bufs.find(b.buf);
    if (it == g_bufs.end()) fail("%s: unknown buffer %s", kname.c_str(), b.buf.c_str());
    if (b.index < 0 || b.index >= 64) fail("bad buffer index %d", b.index);
    table[b.index] = it->second.p;
  }
  emu::LaunchDesc L{k, table.data(), grid, tg};
  emu::run_launch(L, nworkers);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s JOBFILE | --list\n", argv[0]);
    return 2;
  }
  if (std::string(argv[1]) == "--check-plans") {
    // every plan of every op, dtype and optional-input combination binds what its kernels declare
    using namespace kda_kernels::metal;
    int nplans = 0, nlaunch = 0;
    for (const char* fam : {"kda", "gdn"})
      for (const char* mode : {"_recurrent_fwd", "_chunk_fwd", "_recurrent_bwd", "_chunk_bwd", "_recurrent_serve"})
        for (Dt dt : {Dt::f32, Dt::f16, Dt::bf16})
          for (int flags = 0; flags < 16; ++flags)
            for (int kv : {32, 64, 128, 100, 256}) {
              Problem pb;
              pb.dt = dt;
              pb.B = 2; pb.T = 5; pb.H = 1; pb.HV = 2; pb.K = kv; pb.V = kv; pb.N = 2;
              pb.has_h0 = flags & 1; pb.has_cu = flags & 2; pb.has_dht = flags & 4; pb.has_nat = flags & 8;
              pb.idx_cols = (flags & 8) ? 3 : 0;
              pb.pool_rows = 4;
              if (std::string(mode) == "_recurrent_serve") {  // serving has no initial state / grad: vary the pool
                pb.state_v_first = pb.has_h0;
                pb.pool_dt = pb.has_dht ? Dt::bf16 : (pb.has_h0 ? Dt::f16 : Dt::f32);
                pb.has_h0 = pb.has_dht = false;
                pb.has_nat = pb.has_nat && (flags & 1);
              }
              std::string op = std::string(fam) + mode;
              Plan plan;
              try {
                plan = make_plan(op, pb);
              } catch (const std::invalid_argument& e) {
                fail("%s: %s", op.c_str(), e.what());
              }
              ++nplans;
              for (auto& l : plan.launches) {
                std::vector<RawBind> rb;
                for (auto& b : l.binds) rb.push_back(RawBind{b.index, b.buffer, b.param});
                check_binds(find_kernel(l.kernel), rb, true);
                bool known = false;
                for (auto& b : l.binds) {
                  known = b.buffer == "params" || b.buffer == "dummy";
                  for (auto& bs : plan.buffers) known |= bs.name == b.buffer;
                  if (!known) fail("%s: launch of %s binds undeclared buffer %s", op.c_str(), l.kernel.c_str(),
                                   b.buffer.c_str());
                }
                ++nlaunch;
              }
            }
    std::printf("checked %d plans, %d launches\n", nplans, nlaunch);
    return 0;
  }
  if (std::string(argv[1]) == "--list") {
    for (auto& kv : emu::registry()) {
      std::printf("%s", kv.first.c_str());
      for (int i = 0; i < kv.second.nparams; ++i)
        std::printf(" %d:%s", kv.second.params[i].index, kv.second.params[i].name);
      std::printf("\n");
    }
    return 0;
  }
  if (const char* d = std::getenv("EMU_DROP_BARRIER")) emu::g_drop_barrier = d;
  int nworkers = 2;
  if (const char* w = std::getenv("EMU_WORKERS")) nworkers = std::atoi(w);
#ifdef EMU_TSAN
  nworkers = 1;
#endif
  std::ifstream job(argv[1]);
  if (!job) fail("cannot open job %s", argv[1]);
  std::string line;
  // raw launch state
  std::string kname;
  emu::Vec3 grid{1, 1, 1}, tg{32, 1, 1};
  std::vector<RawBind> binds;
  // plan state
  kda_kernels::metal::Problem pb;
  std::string op;
  std::map<std::string, std::string> inputs;
  std::map<std::string, long> shrink;
  std::string outdir;
  while (std::getline(job, line)) {
    std::istringstream ss(line);
    std::string cmd;
    if (!(ss >> cmd) || cmd[0] == '#') continue;
    if (cmd == "buffer") {  // buffer NAME BYTES zero|poison|FILE
      std::string name, init;
      size_t bytes;
      ss >> name >> bytes >> init;
      alloc_buf(name, bytes, init);
    } else if (cmd == "launch") {  // launch KERNEL gx gy gz tx ty tz
      ss >> kname >> grid.x >> grid.y >> grid.z >> tg.x >> tg.y >> tg.z;
      binds.clear();
    } else if (cmd == "bind") {  // bind INDEX BUFFER
      RawBind b;
      ss >> b.index >> b.buf;
      b.param = b.buf;
      binds.push_back(b);
    } else if (cmd == "run") {
      launch(kname, grid, tg, binds, false, nworkers);
    } else if (cmd == "dump") {  // dump BUFFER FILE
      std::string name, path;
      ss >> name >> path;
      dump_buf(name, path);
    } else if (cmd == "op") {  // plan mode: op NAME (e.g. kda_recurrent_fwd)
      ss >> op;
    } else if (cmd == "dtype") {
      std::string d;
      ss >> d;
      pb.dt = kda_kernels::metal::dt_from_name(d.c_str());
    } else if (cmd == "shape") {
      ss >> pb.B >> pb.T >> pb.H >> pb.HV >> pb.K >> pb.V >> pb.N;
    } else if (cmd == "scale") {
      ss >> pb.scale;
    } else if (cmd == "serve") {  // serve IDX_COLS STATE_V_FIRST POOL_ROWS POOL_DTYPE
      std::string pd;
      ss >> pb.idx_cols >> pb.state_v_first >> pb.pool_rows >> pd;
      pb.pool_dt = kda_kernels::metal::dt_from_name(pd.c_str());
    } else if (cmd == "input") {  // input NAME FILE
      std::string name, path;
      ss >> name >> path;
      inputs[name] = path;
    } else if (cmd == "shrink") {  // shrink NAME BYTES: allocate an input this many bytes short (harness self-test)
      std::string name;
      long n;
      ss >> name >> n;
      shrink[name] = n;
    } else if (cmd == "outdir") {
      ss >> outdir;
    } else if (cmd == "execute") {
      using namespace kda_kernels::metal;
      pb.has_h0 = inputs.count("initial_state") > 0;
      pb.has_cu = inputs.count("cu_seqlens") > 0;
      pb.has_dht = inputs.count("grad_final_state") > 0;
      pb.has_nat = inputs.count("num_accepted_tokens") > 0;
      Plan plan = make_plan(op, pb);
      for (auto& b : plan.buffers) {
        if (b.kind == BufKind::Input || b.kind == BufKind::InOut) {
          auto it = inputs.find(b.name);
          if (it == inputs.end()) fail("plan needs input %s", b.name.c_str());
          size_t bytes = size_t(b.bytes - (shrink.count(b.name) ? shrink[b.name] : 0));
          alloc_buf(b.name, bytes, it->second);
        } else {
          alloc_buf(b.name, size_t(b.bytes), b.zero ? "zero" : "poison");
        }
      }
      for (auto& kv : inputs)
        if (!g_bufs.count(kv.first)) fail("input %s is not used by the plan", kv.first.c_str());
      int li = 0;
      for (auto& l : plan.launches) {
        std::string pname = "params@" + std::to_string(li++);
        alloc_buf(pname, sizeof(DeltaParams), "zero");
        std::memcpy(g_bufs[pname].p, &l.params, sizeof(DeltaParams));
        std::vector<RawBind> rb;
        for (auto& b : l.binds) rb.push_back(RawBind{b.index, b.buffer == "params" ? pname : b.buffer, b.param});
        launch(l.kernel, emu::Vec3{l.grid[0], l.grid[1], l.grid[2]}, emu::Vec3{l.tg[0], l.tg[1], l.tg[2]}, rb,
               true, nworkers);
      }
      for (auto& b : plan.buffers)
        if (b.kind == BufKind::Output || b.kind == BufKind::InOut) dump_buf(b.name, outdir + "/" + b.name + ".bin");
      for (auto& kv : plan.aliases) dump_buf(kv.second, outdir + "/" + kv.first + ".bin");
    } else {
      fail("unknown job command %s", cmd.c_str());
    }
  }
  return 0;
}
