// A CPU emulator of the CUDA features the project's CUDA C++ kernels use, so that the very .cu
// file that nvcc builds for the GPU also compiles with g++ (-DFW_EMULATE, through fw_cuda.h) and
// runs on the CPU, deterministically, with barrier misuse reported: docs/cuda_emulation.md.
//
// Every CUDA thread is a cooperative fiber with its own stack. A cluster's fibers run under a
// scheduler that always runs the runnable fiber that comes first in the launch's `order`
// (forward, reverse, or a seeded random permutation drawn anew at every __syncthreads and
// cluster.sync) until it reaches a barrier (a warp collective, __syncthreads, cluster.sync())
// or returns: the first warps and CTAs of the order run as far ahead as the barriers allow, so
// a missing barrier shows up as a result that changes with the order. Shared memory starts filled with 0xFF bytes (NaN in
// float32/bfloat16/float16), a WMMA store writes only the storing lane's share of the tile, and a
// barrier that some threads can never reach raises "deadlock: ..." instead of hanging.
//
// Scope: 1-D grids and blocks, blockDim a multiple of 32, dynamic shared memory only (declared
// in the kernel body with FW_DYNAMIC_SMEM), full-warp masks, WMMA m16n16k16 with float
// accumulators.
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

// ---------------------------------------------------------------- qualifiers and builtins
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __cluster_dims__(...)
#define __align__(n) alignas(n)
#define FW_DYNAMIC_SMEM(name) unsigned char* name = ::fw_emu::dynamic_smem()

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef dim3 uint3;

constexpr int warpSize = 32;

inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float x, float y) { return x / y; }

// ---------------------------------------------------------------- 16-bit float types
struct fw_bf16 {
  uint16_t bits;
};
struct fw_half {
  uint16_t bits;
};

namespace fw_emu {

inline uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}
inline float bits_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN of the same sign.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// float32 -> IEEE binary16, round to nearest even, with subnormals, overflow to inf and NaN.
inline uint16_t f32_to_f16(float f) {
  const uint32_t u = f32_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (a >= 0x38800000u) {  // a normal half: rebias the exponent, round at bit 13
    const uint32_t r = a - (112u << 23);
    return static_cast<uint16_t>(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
  }
  if (a <= 0x33000000u) return static_cast<uint16_t>(sign);  // <= 2^-25: rounds to zero
  // a subnormal half: the value in units of 2^-24, rounded to nearest even
  const uint32_t mant = (a & 0x7fffffu) | 0x800000u;
  const uint32_t shift = 126u - (a >> 23);  // 14 .. 24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u), half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return static_cast<uint16_t>(sign | q);
}
inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    const float v = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return sign ? -v : v;
  }
  if (e == 31) return bits_f32(sign | 0x7f800000u | (m << 13));
  return bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace fw_emu

template <class T>
inline T fw_cvt(float x);
template <>
inline float fw_cvt<float>(float x) { return x; }
template <>
inline fw_bf16 fw_cvt<fw_bf16>(float x) { return fw_bf16{fw_emu::f32_to_bf16(x)}; }
template <>
inline fw_half fw_cvt<fw_half>(float x) { return fw_half{fw_emu::f32_to_f16(x)}; }
inline float fw_f32(float x) { return x; }
inline float fw_f32(fw_bf16 x) { return fw_emu::bf16_to_f32(x.bits); }
inline float fw_f32(fw_half x) { return fw_emu::f16_to_f32(x.bits); }

// ---------------------------------------------------------------- context switching
// On x86-64 a fiber switch saves the callee-saved registers and the FP control words on the
// old stack and swaps stack pointers (no system call, unlike swapcontext's signal mask);
// elsewhere, or with -DFW_EMU_UCONTEXT, ucontext.
#if defined(__x86_64__) && !defined(FW_EMU_UCONTEXT)
extern "C" void fw_emu_switch_v1(void** save_sp, void* load_sp);
asm(R"(
  .text
  .weak fw_emu_switch_v1
  .hidden fw_emu_switch_v1
  .type fw_emu_switch_v1, @function
fw_emu_switch_v1:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fw_emu_switch_v1, .-fw_emu_switch_v1
)");

namespace fw_emu {
namespace detail {
struct Context {
  void* sp = nullptr;
  // A stack that the first switch to "returns" into entry, which must never return.
  void make(char* base, size_t size, void (*entry)()) {
    void** s = reinterpret_cast<void**>((reinterpret_cast<uintptr_t>(base) + size) & ~uintptr_t(15));
    *--s = nullptr;  // entry's return address (as if called: the stack is 8 mod 16 at entry)
    *--s = reinterpret_cast<void*>(entry);
    for (int i = 0; i < 6; ++i) *--s = nullptr;  // rbp, rbx, r12-r15
    uint32_t csr[2] = {__builtin_ia32_stmxcsr(), 0};
    uint16_t cw;
    asm volatile("fnstcw %0" : "=m"(cw));
    csr[1] = cw;
    *--s = nullptr;
    memcpy(s, csr, 8);
    sp = s;
  }
};
inline void switch_context(Context& from, Context& to) { fw_emu_switch_v1(&from.sp, to.sp); }
}  // namespace detail
}  // namespace fw_emu
#else
namespace fw_emu {
namespace detail {
struct Context {
  ucontext_t uc;
  void make(char* base, size_t size, void (*entry)()) {
    getcontext(&uc);
    uc.uc_stack.ss_sp = base;
    uc.uc_stack.ss_size = size;
    uc.uc_link = nullptr;
    makecontext(&uc, entry, 0);
  }
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
}  // namespace detail
}  // namespace fw_emu
#endif

// ---------------------------------------------------------------- the fiber scheduler
namespace fw_emu {

struct Config {
  dim3 grid;                      // CTAs (x only), a multiple of cluster
  dim3 block;                     // threads per CTA (x only), a multiple of 32, at most 1024
  unsigned cluster = 1;           // CTAs per cluster, 1..8 (the portable cluster size)
  size_t smem_bytes = 0;          // dynamic shared memory per CTA, at most 227 KiB
  unsigned order = 0;             // priorities: 0 forward, 1 reverse, k >= 2 permutations seeded by k
  size_t stack_bytes = 512 << 10; // stack per emulated thread (a float fragment takes 1 KiB)
};

constexpr size_t kMaxSmem = 227u << 10;  // sm_90's opt-in dynamic shared memory per CTA

namespace detail {

enum class St { Run, Warp, Cta, Cluster, Exited };

enum class Op { SyncWarp, Shfl, LoadA, LoadB, LoadAcc, Mma, Store };

inline const char* op_name(Op op) {
  switch (op) {
    case Op::SyncWarp: return "__syncwarp";
    case Op::Shfl: return "__shfl_*_sync";
    case Op::LoadA: return "wmma::load_matrix_sync(matrix_a)";
    case Op::LoadB: return "wmma::load_matrix_sync(matrix_b)";
    case Op::LoadAcc: return "wmma::load_matrix_sync(accumulator)";
    case Op::Mma: return "wmma::mma_sync";
    case Op::Store: return "wmma::store_matrix_sync";
  }
  return "?";
}

struct Site {
  const char* file = "";
  unsigned line = 0;
  bool operator==(const Site& o) const { return line == o.line && strcmp(file, o.file) == 0; }
  std::string str() const {
    const char* slash = strrchr(file, '/');
    return std::string(slash ? slash + 1 : file) + ":" + std::to_string(line);
  }
};

// What a thread brings to a barrier: the operation and, for the collectives whose arguments
// must agree across the warp, those arguments; for a shuffle its value and source lane.
struct Coll {
  Op op = Op::SyncWarp;
  Site site;
  const void* ptr = nullptr;
  unsigned ldm = 0;
  int layout = 0;
  uint64_t value = 0;
  unsigned src = 0;
};

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  dim3 tid, bid;
  unsigned cta = 0;   // rank in the cluster
  unsigned index = 0; // in the cluster
  unsigned lane = 0, warp = 0;
  St st = St::Run;
  Coll coll;
  Site site;          // of the CTA or cluster barrier it waits at
  uint64_t result = 0;
  std::exception_ptr error;
  bool cluster_pending = false;  // arrived at the cluster barrier, not yet waited
  uint64_t cluster_phase = 0;    // the phase it arrived in
};

// The last mma_sync of a warp: its lanes hold the same fragments (every lane loads the whole
// tile), so a lane whose operands match the bytes of the lane that computed first copies its
// result instead of recomputing it.
struct MmaCache {
  uint64_t gen = ~0ull;
  size_t elem = 0;
  unsigned char a[1024], b[1024];
  float c[256], d[256];
};

struct WarpState {
  unsigned arrived = 0, exited = 0;
  uint64_t gen = 0;  // completed collectives
  Coll first;
  unsigned first_lane = 0;
  MmaCache mma;
};

struct CtaState {
  unsigned arrived = 0, exited = 0;
  Site site;
  unsigned char* smem = nullptr;
};

// Fiber stacks (a guard page below each), kept for the next launch on this thread: mapping and
// first touching a thousand stacks would cost more than a small launch.
struct StackPool {
  std::vector<std::pair<char*, size_t>> free;
  static constexpr size_t kKeep = 16384;
  char* take(size_t bytes) {
    for (size_t i = free.size(); i-- > 0;) {
      if (free[i].second == bytes) {
        char* p = free[i].first;
        free.erase(free.begin() + static_cast<std::ptrdiff_t>(i));
        return p;
      }
    }
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw std::runtime_error("fw_emu: cannot map a fiber stack");
    mprotect(p, page, PROT_NONE);
    return static_cast<char*>(p);
  }
  void give(char* p, size_t bytes) {
    if (free.size() < kKeep)
      free.emplace_back(p, bytes);
    else
      munmap(p, bytes);
  }
  ~StackPool() {
    for (auto& e : free) munmap(e.first, e.second);
  }
};
inline thread_local StackPool tl_stacks;

struct Launch;
inline thread_local Launch* tl_launch = nullptr;
inline thread_local Fiber* tl_cur = nullptr;

inline std::string where(const Fiber& f) {
  return "block " + std::to_string(f.bid.x) + " thread " + std::to_string(f.tid.x);
}

struct Launch {
  Config cfg;
  dim3 block_dim, grid_dim;
  std::vector<Fiber> fibers;
  std::vector<WarpState> warps;
  std::vector<CtaState> ctas;
  std::vector<unsigned char*> smem_alloc;
  unsigned cluster_arrived = 0;
  uint64_t cluster_phase = 0;  // completed cluster barriers
  Site cluster_site;
  // The scheduler runs the runnable fiber first in `order_of` (pos_of its inverse); `ready`
  // holds one bit per position, set while that fiber is runnable.
  std::vector<unsigned> order_of, pos_of;
  std::vector<uint64_t> ready;
  unsigned live = 0;
  Context main_ctx;
  const void* body = nullptr;
  void (*invoke)(const void*) = nullptr;
  uint64_t rng = 0;
  size_t smem_size = 0, stack_size = 0, stack_map = 0;

  ~Launch() {
    for (Fiber& f : fibers)
      if (f.stack) tl_stacks.give(f.stack, stack_map);
    for (unsigned char* p : smem_alloc) free(p);
  }

  static void trampoline() {
    Fiber* f = tl_cur;
    Launch* L = tl_launch;
    try {
      L->invoke(L->body);
    } catch (...) {
      f->error = std::current_exception();
    }
    f->st = St::Exited;
    switch_context(f->ctx, L->main_ctx);
    abort();  // an exited fiber is never resumed
  }

  void setup() {
    const unsigned n = cfg.cluster * cfg.block.x;
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    stack_size = (cfg.stack_bytes + page - 1) / page * page;
    stack_map = stack_size + page;  // a guard page below each stack
    fibers.resize(n);
    for (Fiber& f : fibers) f.stack = tl_stacks.take(stack_map);
    warps.resize(n / 32);
    ctas.resize(cfg.cluster);
    smem_size = (cfg.smem_bytes + 1023) / 1024 * 1024;
    for (unsigned r = 0; r < cfg.cluster; ++r) {
      unsigned char* p = nullptr;
      if (cfg.smem_bytes) {
        p = static_cast<unsigned char*>(aligned_alloc(1024, smem_size));
        if (!p) throw std::runtime_error("fw_emu: cannot allocate shared memory");
        smem_alloc.push_back(p);
      }
      ctas[r].smem = p;
    }
  }

  void start_cluster(unsigned c) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    for (unsigned i = 0; i < fibers.size(); ++i) {
      Fiber& f = fibers[i];
      f.index = i;
      f.cta = i / cfg.block.x;
      f.tid = dim3(i % cfg.block.x, 0, 0);
      f.bid = dim3(c * cfg.cluster + f.cta, 0, 0);
      f.lane = f.tid.x % 32;
      f.warp = i / 32;
      f.st = St::Run;
      f.error = nullptr;
      f.cluster_pending = false;
      f.ctx.make(f.stack + page, stack_size, &Launch::trampoline);
    }
    for (WarpState& w : warps) {
      w.arrived = w.exited = 0;
      w.mma.gen = ~0ull;
    }
    for (CtaState& s : ctas) {
      s.arrived = s.exited = 0;
      if (s.smem) memset(s.smem, 0xff, smem_size);
    }
    cluster_arrived = 0;
  }

  std::string describe() const {
    // group the threads that cannot run by CTA, state and site
    std::map<std::string, unsigned> groups;
    for (const Fiber& f : fibers) {
      std::string what;
      switch (f.st) {
        case St::Run: what = "runnable"; break;
        case St::Exited: what = "exited"; break;
        case St::Warp: what = std::string("wait at ") + op_name(f.coll.op) + " (" +
                              f.coll.site.str() + ")"; break;
        case St::Cta: what = "wait at __syncthreads (" + f.site.str() + ")"; break;
        case St::Cluster: what = "wait at the cluster barrier (" + f.site.str() + ")"; break;
      }
      ++groups["block " + std::to_string(f.bid.x) + ": " + what];
    }
    std::string s;
    for (const auto& g : groups) s += "; " + g.first + ": " + std::to_string(g.second) + " threads";
    return s;
  }

  void release_warp(unsigned w) {
    WarpState& ws = warps[w];
    Fiber* lanes = &fibers[w * 32];
    if (ws.first.op != Op::SyncWarp && ws.exited)
      throw std::runtime_error(std::string("fw_emu: ") + op_name(ws.first.op) + " (" +
                               ws.first.site.str() + ") in " + where(lanes[ws.first_lane]) +
                               "'s warp, whose lanes have not all reached it (" +
                               std::to_string(ws.exited) + " exited); it needs all 32 lanes");
    if (ws.first.op == Op::Shfl)
      for (unsigned l = 0; l < 32; ++l) lanes[l].result = lanes[lanes[l].coll.src].coll.value;
    for (unsigned l = 0; l < 32; ++l)
      if (lanes[l].st == St::Warp) make_runnable(lanes[l]);
    ws.arrived = 0;
    ++ws.gen;
  }

  void make_runnable(Fiber& f) {
    f.st = St::Run;
    const unsigned pos = pos_of[f.index];
    ready[pos >> 6] |= 1ull << (pos & 63);
  }

  void release(St st, unsigned cta) {
    for (Fiber& f : fibers)
      if (f.st == st && (st == St::Cluster || f.cta == cta)) make_runnable(f);
    if (cfg.order >= 2) draw_order();
  }

  // The priorities: forward, reverse, or a permutation drawn from the seeded generator.
  void draw_order() {
    const unsigned n = static_cast<unsigned>(fibers.size());
    for (unsigned i = 0; i < n; ++i) order_of[i] = cfg.order == 1 ? n - 1 - i : i;
    if (cfg.order >= 2)
      for (unsigned i = n - 1; i > 0; --i)
        std::swap(order_of[i], order_of[static_cast<unsigned>(next_random() % (i + 1))]);
    std::fill(ready.begin(), ready.end(), 0ull);
    for (unsigned pos = 0; pos < n; ++pos) {
      pos_of[order_of[pos]] = pos;
      if (fibers[order_of[pos]].st == St::Run) ready[pos >> 6] |= 1ull << (pos & 63);
    }
  }

  int first_ready() const {
    for (size_t w = 0; w < ready.size(); ++w)
      if (ready[w]) return static_cast<int>(w * 64 + static_cast<size_t>(__builtin_ctzll(ready[w])));
    return -1;
  }

  // Book-keeping after fiber f stopped (at a barrier or for good).
  void arrived(Fiber& f) {
    switch (f.st) {
      case St::Run: break;
      case St::Exited: {
        if (f.error) {
          try {
            std::rethrow_exception(f.error);
          } catch (const std::exception& e) {
            throw std::runtime_error(where(f) + ": " + e.what());
          }
        }
        --live;
        WarpState& ws = warps[f.warp];
        ++ws.exited;
        if (ws.arrived && ws.arrived + ws.exited == 32) release_warp(f.warp);
        CtaState& cs = ctas[f.cta];
        // a CTA that has left: its shared memory is gone, peers reading it see garbage
        if (++cs.exited == cfg.block.x && cs.smem) memset(cs.smem, 0xff, smem_size);
        break;
      }
      case St::Warp: {
        WarpState& ws = warps[f.warp];
        if (ws.arrived == 0) {
          ws.first = f.coll;
          ws.first_lane = f.lane;
        } else {
          const Coll& a = ws.first;
          const Coll& b = f.coll;
          if (a.op != b.op)
            throw std::runtime_error(
                "fw_emu: warp divergence: " + where(f) + " at " + op_name(b.op) + " (" +
                b.site.str() + ") while lane " + std::to_string(ws.first_lane) + " waits at " +
                op_name(a.op) + " (" + a.site.str() + ")");
          if (a.op != Op::Shfl && a.op != Op::SyncWarp &&
              (a.ptr != b.ptr || a.ldm != b.ldm || a.layout != b.layout))
            throw std::runtime_error(
                std::string("fw_emu: ") + op_name(b.op) + " (" + b.site.str() +
                ") called with different arguments by the lanes of a warp (" + where(f) +
                " and lane " + std::to_string(ws.first_lane) + ")");
        }
        if (++ws.arrived + ws.exited == 32) release_warp(f.warp);
        break;
      }
      case St::Cta: {
        CtaState& cs = ctas[f.cta];
        if (cs.arrived == 0) {
          cs.site = f.site;
        } else if (!(cs.site == f.site)) {
          throw std::runtime_error("fw_emu: barrier divergence: " + where(f) +
                                   " at __syncthreads (" + f.site.str() +
                                   ") while other threads of its block wait at __syncthreads (" +
                                   cs.site.str() + ")");
        }
        if (++cs.arrived == cfg.block.x) {
          cs.arrived = 0;
          release(St::Cta, f.cta);
        }
        break;
      }
      case St::Cluster: break;  // counted when it arrived (cluster_arrive)
    }
  }

  uint64_t next_random() {  // splitmix64: the same permutations on every platform
    uint64_t z = (rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }

  // Run the cluster's threads: always the runnable one first in the order, until it stops at a
  // barrier or returns, so the first threads of the order run as far ahead of the others as
  // the barriers let them.
  void run_cluster(unsigned c) {
    start_cluster(c);
    const unsigned n = static_cast<unsigned>(fibers.size());
    order_of.assign(n, 0);
    pos_of.assign(n, 0);
    ready.assign((n + 63) / 64, 0ull);
    live = n;
    draw_order();
    for (;;) {
      const int pos = first_ready();
      if (pos < 0) {
        if (live == 0) return;
        throw std::runtime_error("deadlock: no thread of cluster " + std::to_string(c) +
                                 " can run, its threads wait at barriers that others never "
                                 "reach (a barrier in divergent code?)" + describe());
      }
      Fiber& f = fibers[order_of[static_cast<unsigned>(pos)]];
      tl_cur = &f;
      switch_context(main_ctx, f.ctx);
      tl_cur = nullptr;
      // (a barrier that completed while it ran, in cluster_arrive, may have redrawn the order)
      const unsigned now = pos_of[f.index];
      ready[now >> 6] &= ~(1ull << (now & 63));
      arrived(f);
    }
  }
};

inline Fiber& self() {
  if (!tl_cur) throw std::runtime_error("fw_emu: a device function was called outside a launch");
  return *tl_cur;
}

// Stop the calling fiber at a barrier until the scheduler releases it.
inline void wait(St st) {
  Fiber& f = self();
  f.st = st;
  switch_context(f.ctx, tl_launch->main_ctx);
}

inline void warp_collective(const Coll& c) {
  self().coll = c;
  wait(St::Warp);
}

// The cluster barrier, split as barrier.cluster.arrive / .wait: arriving does not block; the
// barrier completes when every thread of the cluster has arrived; waiting blocks until the
// phase it arrived in has completed.
inline void cluster_arrive(Site site) {
  Fiber& f = self();
  Launch& L = *tl_launch;
  if (f.cluster_pending)
    throw std::runtime_error("fw_emu: cluster barrier_arrive (" + site.str() +
                             ") twice without a barrier_wait between");
  if (L.cluster_arrived == 0) {
    L.cluster_site = site;
  } else if (!(L.cluster_site == site)) {
    throw std::runtime_error("fw_emu: barrier divergence: " + where(f) + " at the cluster barrier (" +
                             site.str() + ") while other threads of its cluster are at (" +
                             L.cluster_site.str() + ")");
  }
  f.cluster_pending = true;
  f.cluster_phase = L.cluster_phase;
  if (++L.cluster_arrived == L.fibers.size()) {
    L.cluster_arrived = 0;
    ++L.cluster_phase;
    L.release(St::Cluster, 0);
  }
}

inline void cluster_wait(Site site) {
  Fiber& f = self();
  if (!f.cluster_pending)
    throw std::runtime_error("fw_emu: cluster barrier_wait (" + site.str() +
                             ") without a barrier_arrive before it");
  if (tl_launch->cluster_phase == f.cluster_phase) {
    f.site = site;
    wait(St::Cluster);
  }
  f.cluster_pending = false;
}

inline void check_mask(unsigned mask, const char* what) {
  if (mask != 0xffffffffu)
    throw std::runtime_error(std::string("fw_emu: ") + what +
                             " with a mask other than 0xffffffff is not emulated");
}

template <class T>
T shuffle(unsigned mask, T v, unsigned src, int width, Site site) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a 32/64-bit value");
  check_mask(mask, "a shuffle");
  if (width <= 0 || width > 32 || (width & (width - 1)))
    throw std::runtime_error("fw_emu: shuffle width must be a power of two <= 32");
  Coll c;
  c.op = Op::Shfl;
  c.site = site;
  memcpy(&c.value, &v, sizeof(T));
  c.src = src;
  warp_collective(c);
  T out;
  memcpy(&out, &self().result, sizeof(T));
  return out;
}

}  // namespace detail

// The calling CTA's dynamic shared memory (FW_DYNAMIC_SMEM).
inline unsigned char* dynamic_smem() {
  detail::Fiber& f = detail::self();
  return detail::tl_launch->ctas[f.cta].smem;
}

// Run kernel(args...) on cfg.grid.x CTAs of cfg.block.x threads, one cluster after another.
template <class... P, class... A>
void launch(void (*kernel)(P...), const Config& cfg, A&&... args) {
  static_assert(sizeof...(P) == sizeof...(A), "launch: wrong number of kernel arguments");
  if (detail::tl_launch) throw std::runtime_error("fw_emu::launch: nested launch");
  if (cfg.grid.y != 1 || cfg.grid.z != 1 || cfg.block.y != 1 || cfg.block.z != 1)
    throw std::invalid_argument("fw_emu::launch: only 1-D grids and blocks are emulated");
  if (cfg.block.x == 0 || cfg.block.x % 32 || cfg.block.x > 1024)
    throw std::invalid_argument("fw_emu::launch: block.x must be a multiple of 32 in [32, 1024], got " +
                                std::to_string(cfg.block.x));
  if (cfg.cluster == 0 || cfg.cluster > 8 || cfg.grid.x == 0 || cfg.grid.x % cfg.cluster)
    throw std::invalid_argument("fw_emu::launch: cluster must be in [1, 8] and divide grid.x, got grid " +
                                std::to_string(cfg.grid.x) + ", cluster " + std::to_string(cfg.cluster));
  if (cfg.smem_bytes > kMaxSmem)
    throw std::invalid_argument("fw_emu::launch: smem_bytes " + std::to_string(cfg.smem_bytes) +
                                " exceeds the 227 KiB a CTA may have");
  if (cfg.stack_bytes < (64u << 10))
    throw std::invalid_argument("fw_emu::launch: stack_bytes must be at least 64 KiB");
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  auto body = [&]() { std::apply(kernel, params); };
  using Body = decltype(body);
  detail::Launch L;
  L.cfg = cfg;
  L.block_dim = cfg.block;
  L.grid_dim = cfg.grid;
  L.rng = cfg.order;
  L.body = &body;
  L.invoke = [](const void* b) { (*static_cast<const Body*>(b))(); };
  struct Guard {
    ~Guard() {
      detail::tl_launch = nullptr;
      detail::tl_cur = nullptr;
    }
  } guard;
  detail::tl_launch = &L;
  L.setup();
  for (unsigned c = 0; c < cfg.grid.x / cfg.cluster; ++c) L.run_cluster(c);
}

// Run f(), returning nullptr, or the message of what it threw (valid until the next call on
// this thread): for extern "C" entries, which must not throw across ctypes.
template <class F>
const char* catch_error(F&& f) {
  static thread_local std::string message;
  try {
    f();
    return nullptr;
  } catch (const std::exception& e) {
    message = e.what();
  } catch (...) {
    message = "unknown C++ exception";
  }
  return message.c_str();
}

}  // namespace fw_emu

#define threadIdx (static_cast<const dim3&>(::fw_emu::detail::self().tid))
#define blockIdx (static_cast<const dim3&>(::fw_emu::detail::self().bid))
#define blockDim (static_cast<const dim3&>(::fw_emu::detail::tl_launch->block_dim))
#define gridDim (static_cast<const dim3&>(::fw_emu::detail::tl_launch->grid_dim))

// ---------------------------------------------------------------- barriers and shuffles
inline void __syncthreads(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  fw_emu::detail::self().site = {file, line};
  fw_emu::detail::wait(fw_emu::detail::St::Cta);
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       unsigned line = __builtin_LINE()) {
  fw_emu::detail::check_mask(mask, "__syncwarp");
  fw_emu::detail::Coll c;
  c.op = fw_emu::detail::Op::SyncWarp;
  c.site = {file, line};
  fw_emu::detail::warp_collective(c);
}

template <class T>
T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32,
              const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  const unsigned lane = fw_emu::detail::self().lane;
  const unsigned w = static_cast<unsigned>(width);
  const unsigned src = (lane & ~(w - 1)) + (static_cast<unsigned>(src_lane) & (w - 1));
  return fw_emu::detail::shuffle(mask, v, src, width, {file, line});
}

template <class T>
T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32,
                  const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  const unsigned lane = fw_emu::detail::self().lane;
  const unsigned w = static_cast<unsigned>(width);
  unsigned src = lane ^ static_cast<unsigned>(lane_mask);
  if ((src & ~(w - 1)) != (lane & ~(w - 1)) || src > 31) src = lane;
  return fw_emu::detail::shuffle(mask, v, src, width, {file, line});
}

template <class T>
T __shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32,
                   const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  const unsigned lane = fw_emu::detail::self().lane;
  const unsigned w = static_cast<unsigned>(width);
  unsigned src = lane + delta;
  if ((src & ~(w - 1)) != (lane & ~(w - 1)) || src > 31) src = lane;
  return fw_emu::detail::shuffle(mask, v, src, width, {file, line});
}

template <class T>
T __shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32,
                 const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  const unsigned lane = fw_emu::detail::self().lane;
  const unsigned w = static_cast<unsigned>(width);
  const unsigned src = (lane & (w - 1)) >= delta ? lane - delta : lane;
  return fw_emu::detail::shuffle(mask, v, src, width, {file, line});
}

// Fibers never run at the same time, so read-modify-write is atomic as written.
template <class T>
T atomicAdd(T* p, T v) {
  const T old = *p;
  *p = old + v;
  return old;
}

// ---------------------------------------------------------------- cooperative groups
namespace cooperative_groups {

struct thread_block {
  void sync(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) const {
    __syncthreads(file, line);
  }
  unsigned thread_rank() const { return threadIdx.x; }
  unsigned size() const { return blockDim.x; }
  unsigned num_threads() const { return blockDim.x; }
  dim3 group_index() const { return blockIdx; }
  dim3 thread_index() const { return threadIdx; }
};
inline thread_block this_thread_block() { return thread_block(); }

struct cluster_group {
  struct arrival_token {};
  void sync(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) const {
    fw_emu::detail::cluster_arrive({file, line});
    fw_emu::detail::cluster_wait({file, line});
  }
  arrival_token barrier_arrive(const char* file = __builtin_FILE(),
                               unsigned line = __builtin_LINE()) const {
    fw_emu::detail::cluster_arrive({file, line});
    return arrival_token();
  }
  void barrier_wait(const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) const {
    fw_emu::detail::cluster_wait({file, line});
  }
  void barrier_wait(arrival_token&&, const char* file = __builtin_FILE(),
                    unsigned line = __builtin_LINE()) const {
    fw_emu::detail::cluster_wait({file, line});
  }
  unsigned block_rank() const { return fw_emu::detail::self().cta; }
  unsigned num_blocks() const { return fw_emu::detail::tl_launch->cfg.cluster; }
  unsigned num_threads() const { return num_blocks() * blockDim.x; }
  unsigned thread_rank() const { return fw_emu::detail::self().index; }
  unsigned size() const { return num_threads(); }
  dim3 block_index() const { return dim3(block_rank(), 0, 0); }
  // The address of the same byte offset in CTA `rank`'s dynamic shared memory.
  template <class T>
  T* map_shared_rank(T* p, unsigned rank) const {
    fw_emu::detail::Launch& L = *fw_emu::detail::tl_launch;
    if (rank >= L.cfg.cluster)
      throw std::runtime_error("fw_emu: map_shared_rank: rank " + std::to_string(rank) +
                               " outside the cluster of " + std::to_string(L.cfg.cluster));
    const auto* mine = L.ctas[fw_emu::detail::self().cta].smem;
    const auto* b = reinterpret_cast<const unsigned char*>(p);
    if (!mine || b < mine || b >= mine + L.cfg.smem_bytes)
      throw std::runtime_error("fw_emu: map_shared_rank: the pointer is not into this CTA's "
                               "dynamic shared memory");
    if (L.ctas[rank].exited == L.cfg.block.x)
      throw std::runtime_error("fw_emu: map_shared_rank: CTA " + std::to_string(rank) +
                               " of the cluster has already exited (a cluster.sync() before "
                               "it leaves is missing)");
    return reinterpret_cast<T*>(L.ctas[rank].smem + (b - mine));
  }
};
inline cluster_group this_cluster() { return cluster_group(); }

}  // namespace cooperative_groups

// ---------------------------------------------------------------- WMMA, m16n16k16
namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

// The whole 16x16 tile, row-major by logical (row, col), in every lane: num_elements is 256
// here (8 on the GPU), so elementwise loops over x[] work when they do not depend on position.
template <class Use, int M, int N, int K, class T, class Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16, "fw_emu emulates the m16n16k16 WMMA shape only");
  static_assert(std::is_same<Use, accumulator>::value ? std::is_same<T, float>::value
                                                      : (std::is_same<T, fw_bf16>::value ||
                                                         std::is_same<T, fw_half>::value ||
                                                         std::is_same<T, float>::value),
                "fw_emu: operands bf16/half/float (float in emulation only), accumulators float");
  static constexpr int num_elements = 256;
  T x[256];
};

template <class Use, class T, class L>
inline void fill_fragment(fragment<Use, 16, 16, 16, T, L>& f, const T& v) {
  for (int i = 0; i < 256; ++i) f.x[i] = v;
}

namespace detail {
using fw_emu::detail::Coll;
using fw_emu::detail::Op;
using fw_emu::detail::Site;

inline void check_tile(const void* p, unsigned ldm, size_t elem, const char* what, Site site) {
  const std::string call = std::string("fw_emu: ") + what + " (" + site.str() + "): ";
  if (reinterpret_cast<uintptr_t>(p) % 32)
    throw std::runtime_error(call + "the pointer must be 256-bit (32-byte) aligned");
  if ((ldm * elem) % 16 || ldm < 16)
    throw std::runtime_error(call + "ldm " + std::to_string(ldm) +
                             " must be >= 16 and a multiple of 16 bytes");
}

inline void collective(Op op, const void* p, unsigned ldm, int layout, Site site) {
  Coll c;
  c.op = op;
  c.site = site;
  c.ptr = p;
  c.ldm = ldm;
  c.layout = layout;
  fw_emu::detail::warp_collective(c);
}

template <class T, class L>
void read_tile(T* x, const T* p, unsigned ldm) {
  const bool col = std::is_same<L, col_major>::value;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) x[r * 16 + c] = col ? p[r + c * ldm] : p[r * ldm + c];
}

inline double wide(float v) { return v; }
inline double wide(fw_bf16 v) { return fw_f32(v); }
inline double wide(fw_half v) { return fw_f32(v); }
}  // namespace detail

template <class Use, class T, class L>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, T, L>& f, const T* p, unsigned ldm,
                             const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  static_assert(!std::is_same<Use, accumulator>::value,
                "an accumulator load takes a layout_t argument");
  static_assert(std::is_same<L, row_major>::value || std::is_same<L, col_major>::value,
                "matrix_a/matrix_b fragments need a row_major or col_major layout");
  const auto op = std::is_same<Use, matrix_a>::value ? detail::Op::LoadA : detail::Op::LoadB;
  detail::check_tile(p, ldm, sizeof(T), "load_matrix_sync", {file, line});
  detail::collective(op, p, ldm, std::is_same<L, col_major>::value, {file, line});
  detail::read_tile<T, L>(f.x, p, ldm);
}

inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p,
                             unsigned ldm, layout_t layout, const char* file = __builtin_FILE(),
                             unsigned line = __builtin_LINE()) {
  detail::check_tile(p, ldm, 4, "load_matrix_sync", {file, line});
  detail::collective(detail::Op::LoadAcc, p, ldm, layout, {file, line});
  if (layout == mem_col_major)
    detail::read_tile<float, col_major>(f.x, p, ldm);
  else
    detail::read_tile<float, row_major>(f.x, p, ldm);
}

// d = a b + c: the products of the operands exact, the sum over k in float64 rounded once to
// float32 per call (the tensor cores' own accumulation order and rounding are not modelled).
template <class T, class LA, class LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, T, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, T, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c,
                     const char* file = __builtin_FILE(), unsigned line = __builtin_LINE()) {
  detail::collective(detail::Op::Mma, nullptr, 0, 0, {file, line});
  fw_emu::detail::WarpState& ws = fw_emu::detail::tl_launch->warps[fw_emu::detail::self().warp];
  fw_emu::detail::MmaCache& mc = ws.mma;
  if (mc.gen == ws.gen && mc.elem == sizeof(T) && !memcmp(mc.a, a.x, sizeof(a.x)) &&
      !memcmp(mc.b, b.x, sizeof(b.x)) && !memcmp(mc.c, c.x, sizeof(c.x))) {
    memcpy(d.x, mc.d, sizeof(mc.d));
    return;
  }
  mc.gen = ws.gen;
  mc.elem = sizeof(T);
  memcpy(mc.a, a.x, sizeof(a.x));
  memcpy(mc.b, b.x, sizeof(b.x));
  memcpy(mc.c, c.x, sizeof(c.x));
  double aw[256], bw[256];
  for (int i = 0; i < 256; ++i) {
    aw[i] = detail::wide(a.x[i]);
    bw[i] = detail::wide(b.x[i]);
  }
  float* out = mc.d;
  for (int i = 0; i < 16; ++i) {
    double acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = c.x[i * 16 + j];
    for (int k = 0; k < 16; ++k) {
      const double av = aw[i * 16 + k];
      for (int j = 0; j < 16; ++j) acc[j] += av * bw[k * 16 + j];
    }
    for (int j = 0; j < 16; ++j) out[i * 16 + j] = static_cast<float>(acc[j]);
  }
  memcpy(d.x, mc.d, sizeof(mc.d));
}

// Each lane writes only its share of the tile, as on the GPU, where a lane stores the elements
// its registers hold: the accumulator layout of mma.sync m16n8k16 twice over (lane l: rows
// l / 4 and l / 4 + 8, columns 2 (l % 4) + {0, 1, 8, 9}). Reading the stored tile in other
// lanes needs a __syncwarp() first, whatever share of it a kernel's own loops give a lane.
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f,
                              unsigned ldm, layout_t layout, const char* file = __builtin_FILE(),
                              unsigned line = __builtin_LINE()) {
  detail::check_tile(p, ldm, 4, "store_matrix_sync", {file, line});
  detail::collective(detail::Op::Store, p, ldm, layout, {file, line});
  const unsigned lane = fw_emu::detail::self().lane;
  const int g = static_cast<int>(lane / 4), c0 = 2 * static_cast<int>(lane % 4);
  for (int r : {g, g + 8})
    for (int c : {c0, c0 + 1, c0 + 8, c0 + 9}) {
      if (layout == mem_col_major)
        p[r + c * ldm] = f.x[r * 16 + c];
      else
        p[r * ldm + c] = f.x[r * 16 + c];
    }
}

}  // namespace wmma
}  // namespace nvcuda

namespace wmma = nvcuda::wmma;
namespace cg = cooperative_groups;
