// Shared pieces of zerokern's multi-tensor CUDA kernels (Adam, cast-copy).
//
// [Note: one launch, many tensors]
// A launch covers a batch of tensors passed by value as a kernel parameter
// (pointers, sizes, first_tile prefix sums; up to ~15 KB, which CUDA 12.1+
// allows on Volta and newer), so nothing is copied to the device per call and
// a call can be captured in a CUDA graph. Each tensor is cut into tiles of
// blockDim * vector-width elements; blocks walk all tiles of the batch
// grid-stride and find a tile's tensor by binary search over first_tile (in
// the parameter space, a constant bank: a few uniform constant loads, not the
// chain of dependent global loads a table in memory would cost). One
// launch thus serves one 1B-element tensor or hundreds of small ones, with
// 64-bit element offsets throughout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <cstring>

namespace zerokern {
namespace cuda {

constexpr int kThreads = 256;

// The tensor t with first_tile[t] <= tile < first_tile[t + 1] (uniform per block).
__device__ __forceinline__ int find_tensor(const int64_t* first_tile, int count, int64_t tile) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_tile[mid] <= tile) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Blocks each SM holds at once, from the compiler's register and shared
// memory use (kMinBlocksPerSM is the floor __launch_bounds__ enforces).
constexpr int kMinBlocksPerSM = 4;

// [Note: grid size]
// The grid is one wave of resident blocks (SMs x blocks the occupancy API says
// fit), walking the tiles grid-stride; a grid sized for more than fit would run
// as a full wave plus a partly empty second one. Asked once per kernel and
// device: the answer depends only on the compiled kernel and the device.
template <auto Kernel>  // the kernel itself: one answer per instantiation, not per signature
int blocks_for(int64_t tiles) {
  constexpr int kDevices = 64;
  static std::atomic<int> resident[kDevices];  // 0: not asked yet on that device
  int device = 0;
  cudaGetDevice(&device);
  int per_device = device < kDevices ? resident[device].load(std::memory_order_relaxed) : 0;
  if (per_device == 0) {
    int sms = 0, per_sm = 0;
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, kThreads, 0);
    per_device = (sms > 0 ? sms : 80) * (per_sm > 0 ? per_sm : kMinBlocksPerSM);
    if (device < kDevices) resident[device].store(per_device, std::memory_order_relaxed);
  }
  return static_cast<int>(tiles < per_device ? tiles : per_device);
}

inline bool is_aligned(const void* ptr, size_t bytes) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// V elements of T, loaded or stored as one aligned vector.
template <typename T, int V>
struct alignas(sizeof(T) * V) Pack {
  T v[V];
};

// [Note: vector stores]
// A Pack is loaded with one 128-bit load, but NVVM splits the store of one
// into a store per element when the kernel also has a scalar path (sm_90 SASS:
// four STG.E for four floats, eight STG.E.U16 for eight halves; memcpy into a
// uint4 or a union does not help either). So stores are written in PTX: one
// st.global.v4.b32 of the Pack's 16 bytes, which ptxas emits as one plain
// STG.E.128. tests/kernels/test_codegen.py reads the SASS to keep it that way.
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_pack(const T* ptr) {
  return *reinterpret_cast<const Pack<T, V>*>(ptr);
}

template <typename T, int V>
__device__ __forceinline__ void store_pack(T* ptr, const Pack<T, V>& pack) {
  static_assert(sizeof(pack) == 16, "vector stores are 16 bytes");
  uint32_t w[4];
  memcpy(w, &pack, sizeof(pack));
#if defined(ZEROKERN_SIMT_EMU)  // the host build (csrc/emu/simt.h): the same instruction, emulated
  zk_emu::st_global_v4_b32(ptr, w);
#else
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
#endif
}

// V elements at ptr as 16-byte accesses (V * sizeof(T) a multiple of 16).
template <typename T, int V>
__device__ __forceinline__ Pack<T, V> load_wide(const T* ptr) {
  constexpr int W = 16 / sizeof(T);
  Pack<T, V> out;
#pragma unroll
  for (int j = 0; j < V; j += W) {
    const Pack<T, W> q = load_pack<T, W>(ptr + j);
#pragma unroll
    for (int k = 0; k < W; ++k) out.v[j + k] = q.v[k];
  }
  return out;
}

template <typename T, int V>
__device__ __forceinline__ void store_wide(T* ptr, const Pack<T, V>& in) {
  constexpr int W = 16 / sizeof(T);
#pragma unroll
  for (int j = 0; j < V; j += W) {
    Pack<T, W> q;
#pragma unroll
    for (int k = 0; k < W; ++k) q.v[k] = in.v[j + k];
    store_pack<T, W>(ptr + j, q);
  }
}

// [Note: tiles and the fallback]
// A tile is kThreads * V elements. Full tiles of a tensor whose pointers all
// allow V-wide access take the vector path (thread t owns V consecutive
// elements); the rest (a tensor's last, partial tile, or every tile of a
// tensor with a misaligned pointer, such as a view at an odd offset) take the
// fallback, where element k of thread t is tile_base + k * kThreads + t: each
// warp instruction then reads 32 consecutive elements, coalesced, instead of
// 32 elements V apart.
__device__ __forceinline__ bool full_vector_tile(bool aligned, int64_t base, int64_t tile_elems, int64_t n) {
  return aligned && base + tile_elems <= n;
}

}  // namespace cuda
}  // namespace zerokern
