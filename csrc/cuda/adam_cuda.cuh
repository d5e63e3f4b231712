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

constexpr int kMaxTensorsPerLaunch = 224;

struct NoOut {};  // OutT of a launch with no model params to write

// Elements per thread per tile: 16 bytes of the narrowest stream, so every
// stream moves in 16-byte accesses (fp32 p/m/v: 4 of them, or 2 x 4 when a
// grad or model param is 2 bytes wide: then 8 of those fill 16 bytes). The
// kernel and the host (which sizes the tiles, adam_cuda.cu) both ask this.
__host__ __device__ constexpr int adam_vec(bool narrow_grad, bool narrow_out) {
  return narrow_grad || narrow_out ? 8 : 4;
}

struct AdamBatch {
  float* params[kMaxTensorsPerLaunch];
  const void* grads[kMaxTensorsPerLaunch];
  float* exp_avgs[kMaxTensorsPerLaunch];
  float* exp_avg_sqs[kMaxTensorsPerLaunch];
  void* model_params[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  // first_tile[i]: index of tensor i's first tile; first_tile[count] = all tiles.
  int64_t first_tile[kMaxTensorsPerLaunch + 1];
  bool aligned[kMaxTensorsPerLaunch];  // every pointer allows 16-byte access
  int count;
};

template <typename GradT, typename OutT>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM)
    adam_kernel(const __grid_constant__ AdamBatch batch, const AdamHyper hyper) {
  // [Note: skipped steps] found_inf is read on the device so an overflowed
  // fp16 step is skipped without the host ever waiting for the GPU.
  if (hyper.found_inf_ptr != nullptr && *hyper.found_inf_ptr != 0.f) return;
  const double lr = hyper.lr_ptr ? *hyper.lr_ptr : hyper.lr;
  const double step = hyper.step_ptr ? *hyper.step_ptr : hyper.step;
  const double scale = hyper.grad_scale_ptr ? *hyper.grad_scale_ptr : hyper.grad_scale;
  const AdamCoeffs c = resolve_coeffs(hyper, lr, step, scale);
  constexpr bool kHasOut = !std::is_same<OutT, NoOut>::value;
  constexpr int V = adam_vec(sizeof(GradT) == 2, kHasOut);
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * V;

  const int64_t tiles = batch.first_tile[batch.count];
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int t = find_tensor(batch.first_tile, batch.count, tile);
    const int64_t base = (tile - batch.first_tile[t]) * kTile;
    const int64_t n = batch.numel[t];
    float* __restrict__ p = batch.params[t];
    float* __restrict__ m = batch.exp_avgs[t];
    float* __restrict__ v = batch.exp_avg_sqs[t];
    const GradT* __restrict__ g = static_cast<const GradT*>(batch.grads[t]);

    // See [Note: tiles and the fallback] and [Note: vector stores].
    if (full_vector_tile(batch.aligned[t], base, kTile, n)) {
      const int64_t i0 = base + static_cast<int64_t>(threadIdx.x) * V;
      Pack<float, V> pv = load_wide<float, V>(p + i0);
      Pack<float, V> mv = load_wide<float, V>(m + i0);
      Pack<float, V> vv = load_wide<float, V>(v + i0);
      const Pack<GradT, V> gp = load_wide<GradT, V>(g + i0);
#pragma unroll
      for (int k = 0; k < V; ++k) adam_element(pv.v[k], mv.v[k], vv.v[k], to_float(gp.v[k]), c);
      store_wide<float, V>(p + i0, pv);
      store_wide<float, V>(m + i0, mv);
      store_wide<float, V>(v + i0, vv);
      if constexpr (kHasOut) {
        Pack<OutT, V> op;
#pragma unroll
        for (int k = 0; k < V; ++k) op.v[k] = from_float<OutT>(pv.v[k]);
        store_wide<OutT, V>(static_cast<OutT*>(batch.model_params[t]) + i0, op);
      }
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t i = base + k * kThreads + threadIdx.x;
        if (i >= n) break;
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
  adam_kernel<GradT, OutT><<<blocks_for<adam_kernel<GradT, OutT>>(tiles), kThreads, 0, stream>>>(batch, hyper);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace zerokern
