// A host build of zerokern's CUDA kernels: the CUDA constructs they use, on the CPU.
//
// [Note: the SIMT emulator]
// The .cu files of csrc/cuda are compiled, unchanged, by the host C++ compiler with this header
// force-included (as nvcc force-includes cuda_runtime.h); tests/kernels/simt_emu.py builds them and the
// tests call every __global__ through it (tests/kernels/test_cuda_emulated.py). What each construct
// becomes:
//   threadIdx, blockIdx,     thread_locals the launcher sets before it resumes a CUDA thread
//   blockDim, gridDim
//   a CUDA thread            a fiber (ucontext) with a stack of its own; a block's threads run on one
//                            OS thread, each until it returns or waits (simt.cpp)
//   __shared__               static thread_local: one copy per OS thread, which runs one block at a
//                            time, so one per block (not poisoned between blocks: a read before the
//                            first write sees the last block's value, where a GPU has garbage)
//   __syncthreads()          a block barrier; a thread that returned before its block's barrier is
//                            reported as an error (undefined on a GPU), as is a deadlock
//   warp shuffles and votes  lockstep exchanges among the lanes a mask names, in PTX's terms
//                            (shfl.sync's segment rule); a lane in the mask that returned, differing
//                            masks, or a read of a lane outside the mask are errors
//   atomics                  __atomic builtins (blocks run one after another, so they are atomic)
//   half, bfloat16, dim3     CUDA's own headers (cuda_fp16.h, cuda_bf16.h, vector_types.h): their
//                            host code is the device's conversion, round to nearest even, NaN 0x7FFF
//   a launch <<<g, b>>>      tests/kernels/simt_emu.py rewrites `k<<<cfg>>>(args)` as
//                            `::zk_emu::launch(k, "k", cfg)(args)` (what nvcc's front end does to
//                            the host pass); the arguments are converted to the parameters' types
//                            and copied, the grid runs to completion, errors come back from
//                            cudaGetLastError() with CUDA's codes
//   global memory accesses   plain host accesses; -fsanitize=alignment reports a misaligned one (a
//                            GPU faults: cudaErrorMisalignedAddress) through simt.cpp's handler
//   fp32 arithmetic          IEEE on the host with -ffp-contract=off, denormals kept (MXCSR's FTZ and
//                            DAZ cleared during a launch, as nvcc's default -ftz=false)
// What it does not emulate faithfully: FMA contraction (nvcc fuses a * b + c where it may; here
// every product is rounded, as in the CPU build: results may differ from a GPU's in the last bit
// where a kernel does not spell its roundings out); the payload of a NaN that arithmetic makes
// (x86 keeps an operand's, a GPU writes 0x7FFFFFFF); the order of threads between synchronisation
// points (fixed: forward or reversed, see zk_emu_set_schedule), so a data race shows only as an
// order dependence; warp divergence inside a warp (lanes run one by one); __launch_bounds__,
// registers and occupancy; PTX other than what is written here. Intrinsics whose GPU result is an
// approximation (__expf, rsqrtf, ...) are deliberately missing: a kernel that uses one does not
// compile here rather than run with other numbers.
#pragma once

#if defined(__CUDACC__)
#error "simt.h is the host build of CUDA code; nvcc has the real constructs"
#endif

#define ZEROKERN_SIMT_EMU 1
// The build hides every symbol (-fvisibility=hidden) but these: the emulator's cudaGetLastError
// and friends must not meet the real CUDA runtime's, which torch may have loaded.
#define ZK_EMU_API extern "C" __attribute__((visibility("default")))
// Before CUDA's host_defines.h, which keeps a definition it finds.
#define __shared__ static thread_local
#define __launch_bounds__(...)

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <driver_types.h>
#include <vector_types.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// --- the built-in variables --------------------------------------------------------------------
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

namespace zk_emu {

// Records an error as the GPU would report it (code: a cudaError); inside a CUDA thread it ends the
// launch, as a fault ends a kernel. printf-style message.
[[gnu::format(printf, 2, 3)]] void fail(int code, const char* fmt, ...);

void syncthreads();
int syncthreads_reduce(int op, int predicate);  // op 0: count, 1: and, 2: or
void syncwarp(unsigned mask);
// Every lane of `mask` hands in a 64-bit word; returns all 32 words of the warp (only the lanes of
// the mask are defined). op names the intrinsic, so lanes meeting at different ones are an error.
const uint64_t* warp_exchange(int op, unsigned mask, uint64_t word);
unsigned lane_id();
unsigned live_lanes();  // the warp's lanes that have not returned

enum ShuffleMode { kIdx = 0, kUp = 1, kDown = 2, kBfly = 3 };
enum WarpOp { kOpShfl = 1, kOpVote = 2, kOpSyncwarp = 3 };

// shfl.sync in PTX's words: the source lane of `lane` for mode, b and the segment width.
inline unsigned shuffle_source(ShuffleMode mode, unsigned lane, int b, int width, bool* in_range) {
  const unsigned c = mode == kUp ? 0u : 0x1fu;
  const unsigned seg = static_cast<unsigned>(warpSize - width) & 0x1fu;  // c[12:8]
  const unsigned min_lane = lane & seg, max_lane = min_lane | (c & ~seg);
  const int bval = b & 0x1f;
  int j = 0;
  bool ok = false;
  switch (mode) {
    case kUp: j = static_cast<int>(lane) - bval; ok = j >= static_cast<int>(max_lane); break;
    case kDown: j = static_cast<int>(lane) + bval; ok = j <= static_cast<int>(max_lane); break;
    case kBfly: j = static_cast<int>(lane ^ bval); ok = j <= static_cast<int>(max_lane); break;
    default: j = static_cast<int>(min_lane | (bval & ~seg)); ok = j <= static_cast<int>(max_lane); break;
  }
  *in_range = ok;
  return ok ? static_cast<unsigned>(j) : lane;
}

template <typename T>
T shuffle(ShuffleMode mode, unsigned mask, T var, int b, int width) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffles move up to 64 bits");
  if (width <= 0 || width > warpSize || (width & (width - 1)) != 0)
    fail(cudaErrorInvalidValue, "shuffle width %d is not a power of 2 up to 32", width);
  uint64_t word = 0;
  std::memcpy(&word, &var, sizeof(T));
  const uint64_t* all = warp_exchange(kOpShfl, mask, word);
  const unsigned lane = lane_id();
  bool in_range = false;
  const unsigned src = shuffle_source(mode, lane, b, width, &in_range);
  if (!(mask >> src & 1u))
    fail(cudaErrorLaunchFailure, "lane %u shuffles from lane %u, outside the mask 0x%08x (undefined)", lane, src,
         mask);
  T out;
  std::memcpy(&out, &all[src], sizeof(T));
  return out;
}

unsigned vote_ballot(unsigned mask, int predicate);

// --- launches ----------------------------------------------------------------------------------
struct Config {
  dim3 grid, block;
  size_t shared = 0;
  cudaStream_t stream = nullptr;
};

// Runs the grid: thread_body(ctx) once per CUDA thread, on its fiber. params_bytes: the size of
// the kernel's parameters (CUDA's limit is 32764 bytes). Errors go to cudaGetLastError().
void run_grid(const char* name, const Config& cfg, void (*thread_body)(const void*), const void* ctx,
              size_t params_bytes);

template <typename... P>
struct Launch {
  void (*kernel)(P...);
  const char* name;
  Config cfg;

  template <typename... A>
  void operator()(A&&... args) const {
    static_assert(sizeof...(A) == sizeof...(P), "a kernel launch passes every parameter");
    // As a launch does: converted to the parameters' types and copied (each thread then copies
    // them again into its own parameters, which it may modify).
    const std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
    struct Ctx {
      void (*kernel)(P...);
      const std::tuple<std::decay_t<P>...>* params;
    } ctx{kernel, &params};
    run_grid(name, cfg,
             [](const void* c) {
               const Ctx* x = static_cast<const Ctx*>(c);
               std::apply(x->kernel, *x->params);
             },
             &ctx, (0 + ... + sizeof(std::decay_t<P>)));
  }
};

template <typename... P>
Launch<P...> launch(void (*kernel)(P...), const char* name, dim3 grid, dim3 block, size_t shared = 0,
                    cudaStream_t stream = nullptr) {
  return Launch<P...>{kernel, name, Config{grid, block, shared, stream}};
}

// st.global.v4.b32: 16 bytes at a 16-byte aligned address (the PTX csrc/cuda writes by hand).
void st_global_v4_b32(void* ptr, const uint32_t w[4]);

}  // namespace zk_emu

// --- synchronisation, shuffles, votes ----------------------------------------------------------
inline void __syncthreads() { zk_emu::syncthreads(); }
inline int __syncthreads_count(int p) { return zk_emu::syncthreads_reduce(0, p); }
inline int __syncthreads_and(int p) { return zk_emu::syncthreads_reduce(1, p); }
inline int __syncthreads_or(int p) { return zk_emu::syncthreads_reduce(2, p); }
inline void __syncwarp(unsigned mask = 0xFFFFFFFFu) { zk_emu::syncwarp(mask); }
inline unsigned __activemask() { return zk_emu::live_lanes(); }

template <typename T>
T __shfl_sync(unsigned mask, T var, int src, int width = warpSize) {
  return zk_emu::shuffle(zk_emu::kIdx, mask, var, src, width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return zk_emu::shuffle(zk_emu::kUp, mask, var, static_cast<int>(delta), width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize) {
  return zk_emu::shuffle(zk_emu::kDown, mask, var, static_cast<int>(delta), width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize) {
  return zk_emu::shuffle(zk_emu::kBfly, mask, var, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int p) { return zk_emu::vote_ballot(mask, p); }
inline int __any_sync(unsigned mask, int p) { return (zk_emu::vote_ballot(mask, p) & mask) != 0; }
inline int __all_sync(unsigned mask, int p) { return (zk_emu::vote_ballot(mask, p) & mask) == mask; }

// --- atomics (on global or shared memory; they return the old value) --------------------------
template <typename T>
T zk_atomic_rmw(T* a, T (*f)(T, T), T v) {
  T old = __atomic_load_n(a, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(a, &old, f(old, v), false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED)) {
  }
  return old;
}
template <typename T>
T zk_atomic_rmw_float(T* a, T (*f)(T, T), T v) {
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* ua = reinterpret_cast<U*>(a);
  U old = __atomic_load_n(ua, __ATOMIC_RELAXED), next;
  do {
    T x, y;
    std::memcpy(&x, &old, sizeof x);
    y = f(x, v);
    std::memcpy(&next, &y, sizeof y);
  } while (!__atomic_compare_exchange_n(ua, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_RELAXED));
  T out;
  std::memcpy(&out, &old, sizeof out);
  return out;
}
#define ZK_INT_ATOMICS(T)                                                                              \
  inline T atomicAdd(T* a, T v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }                \
  inline T atomicSub(T* a, T v) { return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST); }                \
  inline T atomicExch(T* a, T v) { return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST); }              \
  inline T atomicAnd(T* a, T v) { return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST); }                \
  inline T atomicOr(T* a, T v) { return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST); }                  \
  inline T atomicXor(T* a, T v) { return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST); }                \
  inline T atomicMin(T* a, T v) { return zk_atomic_rmw<T>(a, [](T x, T y) { return y < x ? y : x; }, v); } \
  inline T atomicMax(T* a, T v) { return zk_atomic_rmw<T>(a, [](T x, T y) { return y > x ? y : x; }, v); } \
  inline T atomicCAS(T* a, T compare, T v) {                                                          \
    __atomic_compare_exchange_n(a, &compare, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);           \
    return compare;                                                                                   \
  }
ZK_INT_ATOMICS(int)
ZK_INT_ATOMICS(unsigned int)
ZK_INT_ATOMICS(unsigned long long)
ZK_INT_ATOMICS(long long)
#undef ZK_INT_ATOMICS
inline float atomicAdd(float* a, float v) {
  return zk_atomic_rmw_float<float>(a, [](float x, float y) { return x + y; }, v);
}
inline double atomicAdd(double* a, double v) {
  return zk_atomic_rmw_float<double>(a, [](double x, double y) { return x + y; }, v);
}
inline float atomicExch(float* a, float v) {
  return zk_atomic_rmw_float<float>(a, [](float, float y) { return y; }, v);
}
inline unsigned atomicInc(unsigned* a, unsigned lim) {
  return zk_atomic_rmw<unsigned>(a, [](unsigned x, unsigned l) { return x >= l ? 0u : x + 1; }, lim);
}
inline unsigned atomicDec(unsigned* a, unsigned lim) {
  return zk_atomic_rmw<unsigned>(a, [](unsigned x, unsigned l) { return (x == 0 || x > l) ? l : x - 1; }, lim);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_block() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// --- exact intrinsics (IEEE operations, bit casts, integer ops) -----------------------------------
inline uint32_t __float_as_uint(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline int __float_as_int(float x) { int u; std::memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline float __int_as_float(int u) { float x; std::memcpy(&x, &u, 4); return x; }
inline long long __double_as_longlong(double x) { long long u; std::memcpy(&u, &x, 8); return u; }
inline double __longlong_as_double(long long u) { double x; std::memcpy(&x, &u, 8); return x; }
// Each one IEEE rounding to nearest even; -ffp-contract=off keeps the compiler from fusing them.
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __saturatef(float x) { return x != x ? 0.f : x < 0.f ? 0.f : x > 1.f ? 1.f : x; }
template <typename T>
inline T __ldg(const T* p) { return *p; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline unsigned __brev(unsigned x) {
  x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
  x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
  x = ((x >> 4) & 0x0F0F0F0Fu) | ((x & 0x0F0F0F0Fu) << 4);
  return __builtin_bswap32(x);
}
// CUDA's classification functions, in the global namespace as device code has them.
using std::isfinite;
using std::isinf;
using std::isnan;
using std::signbit;
// CUDA's integer min / max overloads (float ones are fminf / fmaxf from <cmath>).
#define ZK_MINMAX(T)                                    \
  inline T min(T a, T b) { return b < a ? b : a; }     \
  inline T max(T a, T b) { return a < b ? b : a; }
ZK_MINMAX(int)
ZK_MINMAX(unsigned int)
ZK_MINMAX(long long)
ZK_MINMAX(unsigned long long)
#undef ZK_MINMAX

// --- the runtime API the launch code calls -----------------------------------------------------
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
const char* cudaGetErrorString(cudaError_t error);
inline cudaError_t cudaDeviceSynchronize() { return cudaPeekAtLastError(); }
inline cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaPeekAtLastError(); }
namespace zk_emu {
int blocks_per_sm();  // what the emulated occupancy calculator answers (the emulated device's)
}
template <typename T>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, T, int, size_t) {
  *blocks = zk_emu::blocks_per_sm();
  return cudaSuccess;
}
