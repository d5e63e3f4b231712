// CUDA fused Adam: the kernel template and the launch batch it reads.
//
// One launch updates up to kMaxTensorsPerLaunch tensors that share a grad dtype
// and a model dtype (the host driver, adam_cuda.cu, groups and batches them).
// Each tensor is cut into tiles of kTile elements; blocks walk the tiles of the
// whole batch grid-stride, so one launch covers a single 1B-element tensor or
// hundreds of small ones alike, with 64-bit element offsets throughout.
// The batch travels as a kernel parameter (about 15 KB: CUDA 12.1+ allows 32 KB
// on Volta and newer), so nothing is copied to the device per call and a step
// can be captured in a CUDA graph.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "zerokern/adam.h"

namespace zerokern {
namespace cuda {

constexpr int kThreads = 256;
constexpr int kVec = 4;  // elements per thread per tile: one 16-byte fp32 load
constexpr int64_t kTile = kThreads * kVec;
constexpr int kMaxTensorsPerLaunch = 224;

struct AdamBatch {
  float* params[kMaxTensorsPerLaunch];
  const void* grads[kMaxTensorsPerLaunch];
  float* exp_avgs[kMaxTensorsPerLaunch];
  float* exp_avg_sqs[kMaxTensorsPerLaunch];
  void* model_params[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  // first_tile[i]: index of tensor i's first tile; first_tile[count] = all tiles.
  int64_t first_tile[kMaxTensorsPerLaunch + 1];
  bool aligned[kMaxTensorsPerLaunch];  // every pointer allows kVec-wide access
  int count;
};

struct NoOut {};

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
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// kVec elements of T, loaded or stored as one aligned vector.
template <typename T>
struct alignas(sizeof(T) * kVec) Pack {
  T v[kVec];
};

template <typename GradT, typename OutT>
__global__ void __launch_bounds__(kThreads) adam_kernel(const __grid_constant__ AdamBatch batch,
                                                        const AdamHyper hyper) {
  // [Note: skipped steps] found_inf is read on the device so an overflowed
  // fp16 step is skipped without the host ever waiting for the GPU.
  if (hyper.found_inf_ptr != nullptr && *hyper.found_inf_ptr != 0.f) return;
  const double lr = hyper.lr_ptr ? *hyper.lr_ptr : hyper.lr;
  const double step = hyper.step_ptr ? *hyper.step_ptr : hyper.step;
  const double scale = hyper.grad_scale_ptr ? *hyper.grad_scale_ptr : hyper.grad_scale;
  const AdamCoeffs c = resolve_coeffs(hyper, lr, step, scale);
  constexpr bool kHasOut = !std::is_same<OutT, NoOut>::value;

  const int64_t tiles = batch.first_tile[batch.count];
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    // Which tensor holds this tile: binary search over first_tile (uniform per block).
    int lo = 0, hi = batch.count - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (batch.first_tile[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    const int t = lo;
    const int64_t base = (tile - batch.first_tile[t]) * kTile;
    const int64_t n = batch.numel[t];
    float* __restrict__ p = batch.params[t];
    float* __restrict__ m = batch.exp_avgs[t];
    float* __restrict__ v = batch.exp_avg_sqs[t];
    const GradT* __restrict__ g = static_cast<const GradT*>(batch.grads[t]);
    const int64_t i0 = base + static_cast<int64_t>(threadIdx.x) * kVec;

    if (batch.aligned[t] && i0 + kVec <= n) {
      Pack<float> pp = *reinterpret_cast<const Pack<float>*>(p + i0);
      Pack<float> mp = *reinterpret_cast<const Pack<float>*>(m + i0);
      Pack<float> vp = *reinterpret_cast<const Pack<float>*>(v + i0);
      const Pack<GradT> gp = *reinterpret_cast<const Pack<GradT>*>(g + i0);
#pragma unroll
      for (int k = 0; k < kVec; ++k) adam_element(pp.v[k], mp.v[k], vp.v[k], to_float(gp.v[k]), c);
      *reinterpret_cast<Pack<float>*>(p + i0) = pp;
      *reinterpret_cast<Pack<float>*>(m + i0) = mp;
      *reinterpret_cast<Pack<float>*>(v + i0) = vp;
      if constexpr (kHasOut) {
        Pack<OutT> op;
#pragma unroll
        for (int k = 0; k < kVec; ++k) op.v[k] = from_float<OutT>(pp.v[k]);
        *reinterpret_cast<Pack<OutT>*>(static_cast<OutT*>(batch.model_params[t]) + i0) = op;
      }
    } else {
      for (int64_t i = i0; i < i0 + kVec && i < n; ++i) {
        float pi = p[i], mi = m[i], vi = v[i];
        adam_element(pi, mi, vi, to_float(g[i]), c);
        p[i] = pi;
        m[i] = mi;
        v[i] = vi;
        if constexpr (kHasOut) static_cast<OutT*>(batch.model_params[t])[i] = from_float<OutT>(pi);
      }
    }
  }
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

// Launches adam_kernel<GradT, OutT> for one batch. Instantiated per grad dtype
// in adam_cuda_<dtype>.cu so nvcc compiles them in parallel.
template <typename GradT, typename OutT>
cudaError_t launch_adam(const AdamBatch& batch, const AdamHyper& hyper, cudaStream_t stream) {
  const int64_t tiles = batch.first_tile[batch.count];
  if (tiles == 0) return cudaSuccess;
  adam_kernel<GradT, OutT><<<blocks_for(tiles), kThreads, 0, stream>>>(batch, hyper);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace zerokern
