// CUDA fused Adam: the kernel template and the launch batch it reads.
//
// One launch updates up to kMaxTensorsPerLaunch tensors that share a grad dtype
// and a model dtype (the host driver, adam_cuda.cu, groups and batches them);
// see [Note: one launch, many tensors] in multi_tensor.cuh.
#pragma once

#include <cstdint>
#include <type_traits>

#include "multi_tensor.cuh"
#include "zerokern/adam.h"

namespace zerokern {
namespace cuda {

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
    const int t = find_tensor(batch.first_tile, batch.count, tile);
    const int64_t base = (tile - batch.first_tile[t]) * kTile;
    const int64_t n = batch.numel[t];
    float* __restrict__ p = batch.params[t];
    float* __restrict__ m = batch.exp_avgs[t];
    float* __restrict__ v = batch.exp_avg_sqs[t];
    const GradT* __restrict__ g = static_cast<const GradT*>(batch.grads[t]);
    const int64_t i0 = base + static_cast<int64_t>(threadIdx.x) * kVec;

    if (batch.aligned[t] && i0 + kVec <= n) {
      Pack<float, kVec> pp = *reinterpret_cast<const Pack<float, kVec>*>(p + i0);
      Pack<float, kVec> mp = *reinterpret_cast<const Pack<float, kVec>*>(m + i0);
      Pack<float, kVec> vp = *reinterpret_cast<const Pack<float, kVec>*>(v + i0);
      const Pack<GradT, kVec> gp = *reinterpret_cast<const Pack<GradT, kVec>*>(g + i0);
#pragma unroll
      for (int k = 0; k < kVec; ++k) adam_element(pp.v[k], mp.v[k], vp.v[k], to_float(gp.v[k]), c);
      *reinterpret_cast<Pack<float, kVec>*>(p + i0) = pp;
      *reinterpret_cast<Pack<float, kVec>*>(m + i0) = mp;
      *reinterpret_cast<Pack<float, kVec>*>(v + i0) = vp;
      if constexpr (kHasOut) {
        Pack<OutT, kVec> op;
#pragma unroll
        for (int k = 0; k < kVec; ++k) op.v[k] = from_float<OutT>(pp.v[k]);
        *reinterpret_cast<Pack<OutT, kVec>*>(static_cast<OutT*>(batch.model_params[t]) + i0) = op;
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
