// CUDA fused Adam, host side: groups the tensor list by (grad dtype, model
// dtype), packs each group into batches of kMaxTensorsPerLaunch, and launches
// one kernel per batch. A typical call (one dtype pair, < 224 tensors) is one launch.
#include <vector>

#include "adam_cuda.cuh"
#include "zerokern/adam.h"

namespace zerokern {
namespace cuda {

// The instantiations live in adam_cuda_{f32,f16,bf16}.cu.
#define ZK_EXTERN_LAUNCH(G)                                                                  \
  extern template cudaError_t launch_adam<G, NoOut>(const AdamBatch&, const AdamHyper&,      \
                                                    cudaStream_t);                           \
  extern template cudaError_t launch_adam<G, __half>(const AdamBatch&, const AdamHyper&,     \
                                                     cudaStream_t);                          \
  extern template cudaError_t launch_adam<G, __nv_bfloat16>(const AdamBatch&, const AdamHyper&, \
                                                            cudaStream_t);
ZK_EXTERN_LAUNCH(float)
ZK_EXTERN_LAUNCH(__half)
ZK_EXTERN_LAUNCH(__nv_bfloat16)
#undef ZK_EXTERN_LAUNCH

namespace {

template <typename GradT>
cudaError_t launch_for_out(DType out, const AdamBatch& b, const AdamHyper& h, cudaStream_t s) {
  switch (out) {
    case DType::kFloat16: return launch_adam<GradT, __half>(b, h, s);
    case DType::kBFloat16: return launch_adam<GradT, __nv_bfloat16>(b, h, s);
    default: return launch_adam<GradT, NoOut>(b, h, s);
  }
}

cudaError_t launch(DType grad, DType out, const AdamBatch& b, const AdamHyper& h, cudaStream_t s) {
  switch (grad) {
    case DType::kFloat16: return launch_for_out<__half>(out, b, h, s);
    case DType::kBFloat16: return launch_for_out<__nv_bfloat16>(out, b, h, s);
    default: return launch_for_out<float>(out, b, h, s);
  }
}

}  // namespace
}  // namespace cuda

int fused_adam_cuda(const AdamTensorList& t, const AdamHyper& hyper, void* stream_ptr) {
  using namespace cuda;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const bool has_model = t.model_params != nullptr;

  // Group indices by dtype pair, skipping empty tensors.
  std::vector<int64_t> groups[3][4];
  for (int64_t i = 0; i < t.count; ++i) {
    if (t.numel[i] == 0) continue;
    const DType out = has_model ? t.model_dtypes[i] : DType::kNone;
    groups[static_cast<int>(t.grad_dtypes[i])][static_cast<int>(out)].push_back(i);
  }

  AdamBatch batch;
  for (int gd = 0; gd < 3; ++gd) {
    for (int od = 0; od < 4; ++od) {
      const std::vector<int64_t>& idx = groups[gd][od];
      const bool narrow_out = od == static_cast<int>(DType::kFloat16) || od == static_cast<int>(DType::kBFloat16);
      const int vec = adam_vec(gd != static_cast<int>(DType::kFloat32), narrow_out);
      const int64_t tile = static_cast<int64_t>(kThreads) * vec;
      for (size_t begin = 0; begin < idx.size(); begin += kMaxTensorsPerLaunch) {
        const size_t end = std::min(idx.size(), begin + kMaxTensorsPerLaunch);
        batch.count = static_cast<int>(end - begin);
        batch.first_tile[0] = 0;
        for (size_t j = begin; j < end; ++j) {
          const int k = static_cast<int>(j - begin);
          const int64_t i = idx[j];
          batch.params[k] = t.params[i];
          batch.grads[k] = t.grads[i];
          batch.exp_avgs[k] = t.exp_avgs[i];
          batch.exp_avg_sqs[k] = t.exp_avg_sqs[i];
          batch.model_params[k] = has_model ? t.model_params[i] : nullptr;
          batch.numel[k] = t.numel[i];
          batch.first_tile[k + 1] = batch.first_tile[k] + (t.numel[i] + tile - 1) / tile;
          // Every stream moves in 16-byte accesses (see adam_vec).
          batch.aligned[k] = is_aligned(t.params[i], 16) && is_aligned(t.exp_avgs[i], 16) &&
                             is_aligned(t.exp_avg_sqs[i], 16) && is_aligned(t.grads[i], 16) &&
                             is_aligned(batch.model_params[k], 16);
        }
        const cudaError_t err = launch(static_cast<DType>(gd), static_cast<DType>(od), batch, hyper, stream);
        if (err != cudaSuccess) return static_cast<int>(err);
      }
    }
  }
  return 0;
}

}  // namespace zerokern
