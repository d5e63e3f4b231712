// Shared pieces of zerokern's multi-tensor CUDA kernels (Adam, cast-copy).
//
// [Note: one launch, many tensors]
// A launch covers a batch of tensors passed by value as a kernel parameter
// (pointers, sizes, first_tile prefix sums; up to ~15 KB, which CUDA 12.1+
// allows on Volta and newer), so nothing is copied to the device per call and
// a call can be captured in a CUDA graph. Each tensor is cut into tiles of
// blockDim * vector-width elements; blocks walk all tiles of the batch
// grid-stride and find a tile's tensor by binary search over first_tile. One
// launch thus serves one 1B-element tensor or hundreds of small ones, with
// 64-bit element offsets throughout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

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

// Enough resident blocks to keep every SM's memory pipeline full
// (8 x 256 threads = 2048, the per-SM limit on sm_80 and sm_90).
inline int blocks_for(int64_t tiles) {
  static const int sms = [] {
    int device = 0, count = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    return count > 0 ? count : 80;
  }();
  const int64_t cap = static_cast<int64_t>(sms) * 8;
  return static_cast<int>(tiles < cap ? tiles : cap);
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

}  // namespace cuda
}  // namespace zerokern
