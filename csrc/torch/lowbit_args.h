// The low-bit Adam op's arguments as the torch-free LowBitTensorList / LowBitCall (shared by the
// CPU and CUDA bindings). zerokern.kernels.lowbit_ops validates the lists in Python, the one place
// their rules live; the checks here only keep a direct call from reading out of bounds.
#pragma once

#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op): 4x the parse time of each file (docs/build.md)

#include <vector>

#include "zerokern/lowbit.h"

namespace zerokern {

struct LowBitArrays {
  std::vector<void*> params, exp_avgs, exp_avg_sqs, model_params;
  std::vector<const void*> grads;
  std::vector<float*> exp_avg_scales, exp_avg_sq_scales;
  std::vector<int64_t> numel, index_base;
  std::vector<DType> grad_dtypes;
  LowBitTensorList list;  // views of the vectors above
};

// Fills arrays and call; false when there is nothing to do (no tensors).
bool build_lowbit(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList model_params, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                  at::IntArrayRef index_bases, at::TensorList maps, int64_t seed, double lr, double beta1,
                  double beta2, double eps, double weight_decay, double step, bool adam_w_mode, bool bias_correction,
                  double grad_scale, LowBitArrays& arrays, LowBitCall& call);

constexpr const char* kFusedAdamLowBitSchema =
    "fused_adam_lowbit_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
    "Tensor(d!)[] model_params, Tensor(e!)[] exp_avg_scales, Tensor(f!)[] exp_avg_sq_scales, int[] index_bases, "
    "Tensor[] maps, int seed, float lr, float beta1, float beta2, float eps, float weight_decay, float step, "
    "bool adam_w_mode, bool bias_correction, float grad_scale) -> ()";

}  // namespace zerokern
