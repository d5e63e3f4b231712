// The SIMT emulator's runtime: grids, blocks of fibers, barriers, warp exchanges, errors.
// See [Note: the SIMT emulator] in simt.h.
//
// A launch runs its blocks one after another on the calling OS thread. A block's CUDA threads are
// fibers (ucontext) on stacks of their own; the block's scheduler sweeps them in order (or in
// reverse, zk_emu_set_schedule), running each until it returns or waits at a __syncthreads() or a
// warp exchange. The last thread to reach a barrier (or the last lane of a mask to reach an
// exchange) releases the others; a sweep in which no thread can run, with some not returned, is a
// deadlock (a barrier or mask some thread never reaches) and is reported, not waited on.
#include "simt.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <cstdarg>
#include <cstdlib>
#include <cstdio>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace zk_emu {
namespace {

constexpr size_t kStackBytes = 256 * 1024;  // a kernel's frame holds its parameters (~15 KB for a batch)
constexpr size_t kGuardBytes = 4096;        // below each stack, unmapped: an overflow faults at once

enum class State : uint8_t { kRunnable, kAtBarrier, kAtWarp, kDone, kKilled };

struct Fiber {
  ucontext_t ctx;
  char* stack = nullptr;
  uint3 tid;
  unsigned warp = 0, lane = 0;
  State state = State::kRunnable;
  unsigned barriers = 0;  // __syncthreads() passed: which barrier's predicate sum it reads
  int op = 0;             // the warp intrinsic it waits at
  unsigned mask = 0;
  uint64_t word = 0;      // its contribution to the warp exchange
  uint64_t got[32];       // the exchange's words, copied at release
};

struct LaunchRecord {
  std::string name;
  dim3 grid, block;
};

struct Emulator {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;  // the current block's threads (stacks kept across blocks and launches)
  Fiber* current = nullptr;
  unsigned live = 0, at_barrier = 0, returned = 0;
  int predicate_sum[2] = {0, 0};
  bool aborted = false, in_launch = false;
  void (*body)(const void*) = nullptr;
  const void* ctx = nullptr;
};

thread_local Emulator emu;

// Process-wide, as a CUDA context's: the error cudaGetLastError() returns, and its message.
int last_error = 0;
std::string last_message;
std::vector<LaunchRecord> launch_log;
int current_device = 0;
bool reverse_order = false;

void yield(Fiber* f) { swapcontext(&f->ctx, &emu.scheduler); }

const char* where() {
  static thread_local char buf[96];
  if (!emu.current) return "host code";
  std::snprintf(buf, sizeof buf, "block (%u,%u,%u) thread (%u,%u,%u)", blockIdx.x, blockIdx.y, blockIdx.z,
                emu.current->tid.x, emu.current->tid.y, emu.current->tid.z);
  return buf;
}

Fiber* self(const char* what) {
  if (!emu.current) {  // host code calling a device intrinsic: not a kernel's fault, the emulator's misuse
    std::fprintf(stderr, "zk_emu: %s called outside a kernel\n", what);
    std::abort();
  }
  return emu.current;
}

void fiber_main() {
  Fiber* f = emu.current;
  emu.body(emu.ctx);
  f->state = State::kDone;
  ++emu.returned;
  --emu.live;
  if (emu.at_barrier > 0)
    fail(cudaErrorLaunchFailure, "thread (%u,%u,%u) returned while %u threads wait at __syncthreads() (undefined)",
         f->tid.x, f->tid.y, f->tid.z, emu.at_barrier);
  for (Fiber& g : emu.fibers)
    if (g.state == State::kAtWarp && g.warp == f->warp && (g.mask >> f->lane & 1u))
      fail(cudaErrorLaunchFailure, "lane %u returned while lane %u waits for it (mask 0x%08x)", f->lane, g.lane,
           g.mask);
  yield(f);  // never resumed
}

void release_barrier() {
  for (Fiber& g : emu.fibers)
    if (g.state == State::kAtBarrier) g.state = State::kRunnable;
  emu.at_barrier = 0;
}

// Runs the block's threads until all return; false when the launch was aborted.
bool run_block() {
  const size_t n = emu.fibers.size();
  for (size_t i = 0; i < n; ++i) {
    Fiber& f = emu.fibers[i];
    getcontext(&f.ctx);  // here, after the launch set the FP control register the fibers start with
    f.ctx.uc_stack.ss_sp = f.stack;
    f.ctx.uc_stack.ss_size = kStackBytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_main, 0);
    f.state = State::kRunnable;
    f.barriers = 0;
  }
  emu.live = static_cast<unsigned>(n);
  emu.at_barrier = emu.returned = 0;
  emu.predicate_sum[0] = emu.predicate_sum[1] = 0;
  while (emu.live > 0) {
    bool ran = false;
    for (size_t k = 0; k < n; ++k) {
      Fiber& f = emu.fibers[reverse_order ? n - 1 - k : k];
      if (f.state != State::kRunnable) continue;
      emu.current = &f;
      threadIdx = f.tid;
      swapcontext(&emu.scheduler, &f.ctx);
      emu.current = nullptr;
      ran = true;
      if (emu.aborted) return false;
    }
    if (!ran && emu.live > 0) {
      unsigned bar = 0, warp = 0;
      for (const Fiber& f : emu.fibers) {
        bar += f.state == State::kAtBarrier;
        warp += f.state == State::kAtWarp;
      }
      fail(cudaErrorLaunchFailure,
           "block (%u,%u,%u) deadlocks: %u threads wait at __syncthreads(), %u at a warp intrinsic, %u returned",
           blockIdx.x, blockIdx.y, blockIdx.z, bar, warp, emu.returned);
      return false;
    }
  }
  return true;
}

char* new_stack() {
  void* p = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  mprotect(p, kGuardBytes, PROT_NONE);
  return static_cast<char*>(p) + kGuardBytes;
}

}  // namespace

void fail(int code, const char* fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (last_error == 0) {  // the first error is the one reported, as a GPU's
    last_error = code;
    last_message = std::string(where()) + ": " + msg;
  }
  if (emu.current) {  // a fault ends the kernel: this thread never resumes, the launch stops
    emu.aborted = true;
    Fiber* f = emu.current;
    f->state = State::kKilled;
    yield(f);
  }
}

void syncthreads() { (void)syncthreads_reduce(-1, 0); }

int syncthreads_reduce(int op, int predicate) {
  Fiber* f = self("__syncthreads()");
  if (emu.returned > 0)
    fail(cudaErrorLaunchFailure, "__syncthreads() after %u threads of the block returned (undefined)", emu.returned);
  const unsigned parity = f->barriers++ & 1u;
  emu.predicate_sum[parity] += predicate != 0;
  f->state = State::kAtBarrier;
  if (++emu.at_barrier == emu.live) {
    emu.predicate_sum[parity ^ 1u] = 0;  // the next barrier's (every thread has read the last one's)
    release_barrier();
  } else {
    yield(f);
  }
  const int sum = emu.predicate_sum[parity];
  const int n = static_cast<int>(emu.fibers.size());
  return op == 0 ? sum : op == 1 ? sum == n : op == 2 ? sum > 0 : 0;
}

unsigned lane_id() { return self("a lane intrinsic")->lane; }

unsigned live_lanes() {
  const Fiber* f = self("__activemask()");
  unsigned m = 0;
  for (const Fiber& g : emu.fibers)
    if (g.warp == f->warp && g.state != State::kDone) m |= 1u << g.lane;
  return m;
}

const uint64_t* warp_exchange(int op, unsigned mask, uint64_t word) {
  Fiber* f = self("a warp intrinsic");
  const size_t first = static_cast<size_t>(f->warp) * warpSize;
  const unsigned lanes = static_cast<unsigned>(std::min<size_t>(warpSize, emu.fibers.size() - first));
  if (!(mask >> f->lane & 1u))
    fail(cudaErrorLaunchFailure, "lane %u calls a warp intrinsic with mask 0x%08x, which leaves it out", f->lane, mask);
  if (lanes < 32 && (mask >> lanes) != 0)
    fail(cudaErrorLaunchFailure, "mask 0x%08x names lanes the warp lacks (it has %u threads)", mask, lanes);
  f->op = op;
  f->mask = mask;
  f->word = word;
  f->state = State::kAtWarp;
  bool all = true;
  for (unsigned l = 0; l < lanes; ++l) {
    if (!(mask >> l & 1u)) continue;
    const Fiber& g = emu.fibers[first + l];
    if (g.state == State::kDone)
      fail(cudaErrorLaunchFailure, "mask 0x%08x names lane %u, which returned (undefined)", mask, l);
    if (g.state != State::kAtWarp) {
      all = false;
      continue;
    }
    if (g.mask != mask || g.op != op)
      fail(cudaErrorLaunchFailure, "lanes %u and %u meet at warp intrinsics with masks 0x%08x, 0x%08x (ops %d, %d)",
           f->lane, l, mask, g.mask, op, g.op);
  }
  if (all) {  // the last lane of the mask: hand every lane the words and let them go on
    uint64_t words[32] = {};
    for (unsigned l = 0; l < lanes; ++l)
      if (mask >> l & 1u) words[l] = emu.fibers[first + l].word;
    for (unsigned l = 0; l < lanes; ++l) {
      if (!(mask >> l & 1u)) continue;
      Fiber& g = emu.fibers[first + l];
      std::memcpy(g.got, words, sizeof words);
      g.state = State::kRunnable;
    }
  } else {
    yield(f);
  }
  return f->got;
}

void syncwarp(unsigned mask) { (void)warp_exchange(kOpSyncwarp, mask, 0); }

unsigned vote_ballot(unsigned mask, int predicate) {
  const uint64_t* all = warp_exchange(kOpVote, mask, predicate != 0);
  unsigned out = 0;
  for (unsigned l = 0; l < 32; ++l)
    if ((mask >> l & 1u) && all[l]) out |= 1u << l;
  return out;
}

void st_global_v4_b32(void* ptr, const uint32_t w[4]) {
  if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) {
    fail(cudaErrorMisalignedAddress, "st.global.v4.b32 to %p, which is not 16-byte aligned", ptr);
    return;
  }
  std::memcpy(ptr, w, 16);
}

// The emulated devices: 3 SMs (a grid of a few blocks, so grid-stride loops turn), 1 SM (one block
// walks every tile) and 2^20 SMs (a block per tile); one resident block per SM.
int blocks_per_sm() { return 1; }

void run_grid(const char* name, const Config& cfg, void (*thread_body)(const void*), const void* ctx,
              size_t params_bytes) {
  launch_log.push_back({name, cfg.grid, cfg.block});
  if (emu.in_launch) {
    fail(cudaErrorNotSupported, "kernel %s launched from a kernel (dynamic parallelism is not emulated)", name);
    return;
  }
  const dim3 g = cfg.grid, b = cfg.block;
  const uint64_t threads = static_cast<uint64_t>(b.x) * b.y * b.z;
  if (threads == 0 || threads > 1024 || b.x > 1024 || b.y > 1024 || b.z > 64 || g.x == 0 || g.y == 0 ||
      g.z == 0 || g.x > 0x7FFFFFFFu || g.y > 65535 || g.z > 65535) {
    fail(cudaErrorInvalidConfiguration, "kernel %s launched with grid (%u,%u,%u), block (%u,%u,%u)", name, g.x, g.y,
         g.z, b.x, b.y, b.z);
    return;
  }
  if (params_bytes > 32764) {
    fail(cudaErrorInvalidValue, "kernel %s has %zu bytes of parameters, over CUDA's 32764", name, params_bytes);
    return;
  }
  if (cfg.shared != 0) {
    fail(cudaErrorNotSupported, "kernel %s asks for dynamic shared memory, which is not emulated", name);
    return;
  }
  while (emu.fibers.size() < threads) {
    emu.fibers.emplace_back();
    emu.fibers.back().stack = new_stack();
    if (!emu.fibers.back().stack) {
      emu.fibers.pop_back();
      fail(cudaErrorMemoryAllocation, "no memory for the stacks of %llu threads", (unsigned long long)threads);
      return;
    }
  }
  std::vector<Fiber> spare;  // keep the stacks of a larger earlier block for later launches
  if (emu.fibers.size() > threads) {
    spare.assign(std::make_move_iterator(emu.fibers.begin() + threads), std::make_move_iterator(emu.fibers.end()));
    emu.fibers.resize(threads);
  }
  for (uint64_t i = 0; i < threads; ++i) {
    Fiber& f = emu.fibers[i];
    f.tid = uint3{static_cast<unsigned>(i % b.x), static_cast<unsigned>(i / b.x % b.y),
                  static_cast<unsigned>(i / (static_cast<uint64_t>(b.x) * b.y))};
    f.warp = static_cast<unsigned>(i / warpSize);
    f.lane = static_cast<unsigned>(i % warpSize);
  }
#if defined(__x86_64__) || defined(__i386__)
  const unsigned csr = _mm_getcsr();
  _mm_setcsr(csr & ~0x8040u);  // FTZ (bit 15) and DAZ (bit 6) off: a GPU keeps fp32 denormals (-ftz=false)
#endif
  emu.in_launch = true;
  emu.aborted = false;
  emu.body = thread_body;
  emu.ctx = ctx;
  blockDim = b;
  gridDim = g;
  const uint64_t blocks = static_cast<uint64_t>(g.x) * g.y * g.z;
  for (uint64_t k = 0; k < blocks; ++k) {
    const uint64_t i = reverse_order ? blocks - 1 - k : k;
    blockIdx = uint3{static_cast<unsigned>(i % g.x), static_cast<unsigned>(i / g.x % g.y),
                     static_cast<unsigned>(i / (static_cast<uint64_t>(g.x) * g.y))};
    if (!run_block()) break;
  }
  emu.in_launch = false;
  emu.current = nullptr;
#if defined(__x86_64__) || defined(__i386__)
  _mm_setcsr(csr);
#endif
  for (Fiber& f : spare) emu.fibers.push_back(std::move(f));
}

}  // namespace zk_emu

cudaError_t cudaGetDevice(int* device) {
  *device = zk_emu::current_device;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  if (device < 0 || device > 2) return cudaErrorInvalidDevice;
  zk_emu::current_device = device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (attr != cudaDevAttrMultiProcessorCount || device < 0 || device > 2) return cudaErrorInvalidValue;
  static const int sms[3] = {3, 1, 1 << 20};
  *value = sms[device];
  return cudaSuccess;
}

cudaError_t cudaGetLastError() {
  const int e = zk_emu::last_error;
  zk_emu::last_error = 0;
  return static_cast<cudaError_t>(e);
}

cudaError_t cudaPeekAtLastError() { return static_cast<cudaError_t>(zk_emu::last_error); }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    default: return "error";
  }
}

// -fsanitize=alignment's report, for the kernels' files: a misaligned access, which faults on a GPU.
// The layout is the sanitizer runtime's (ubsan_handlers.h); only the alignment check is compiled in.
namespace {
struct UbsanLocation {
  const char* file;
  uint32_t line, column;
};
struct UbsanType {
  uint16_t kind, info;
  char name[1];
};
struct UbsanTypeMismatch {
  UbsanLocation loc;
  const UbsanType* type;
  unsigned char log_alignment;
  unsigned char check_kind;
};
}  // namespace

extern "C" __attribute__((visibility("hidden"))) void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* d,
                                                                                     uintptr_t ptr) {
  zk_emu::fail(cudaErrorMisalignedAddress, "%s:%u: access to %s at 0x%lx, which is not %u-byte aligned",
               d->loc.file, d->loc.line, d->type->name, static_cast<unsigned long>(ptr), 1u << d->log_alignment);
}

// What the tests read and set (tests/kernels/simt_emu.py).
ZK_EMU_API int zk_emu_last_error() { return zk_emu::last_error; }
ZK_EMU_API const char* zk_emu_last_message() { return zk_emu::last_message.c_str(); }
ZK_EMU_API void zk_emu_reset() {
  zk_emu::last_error = 0;
  zk_emu::last_message.clear();
  zk_emu::launch_log.clear();
}
ZK_EMU_API int zk_emu_set_device(int device) { return cudaSetDevice(device); }
ZK_EMU_API void zk_emu_set_schedule(int reverse) { zk_emu::reverse_order = reverse != 0; }
ZK_EMU_API int64_t zk_emu_launches() { return static_cast<int64_t>(zk_emu::launch_log.size()); }
// Launch i: its kernel's name and its grid and block (x, y, z each).
ZK_EMU_API const char* zk_emu_launch(int64_t i, unsigned* dims) {
  const zk_emu::LaunchRecord& r = zk_emu::launch_log.at(static_cast<size_t>(i));
  const unsigned d[6] = {r.grid.x, r.grid.y, r.grid.z, r.block.x, r.block.y, r.block.z};
  std::memcpy(dims, d, sizeof d);
  return r.name.c_str();
}
