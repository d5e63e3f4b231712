// Validation of fused_adam_'s arguments and their conversion to the torch-free
// kernel structs (csrc/include/zerokern/adam.h). Shared by the CPU and CUDA
// bindings; the Python backends apply the same rules in zerokern/_checks.py
// (tests/kernels/test_adam_errors.py holds both to the same messages).
#pragma once

#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op): 4x the parse time of each file (docs/build.md)
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <vector>

#include "zerokern/adam.h"

namespace zerokern {

// The op's schema, shared by the definition and the tests' expectations.
inline constexpr const char* kFusedAdamSchema =
    "fused_adam_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
    "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] model_params, *, float lr, float beta1, "
    "float beta2, float eps, float weight_decay, float step, bool adam_w_mode, "
    "bool bias_correction, float grad_scale, Tensor? lr_tensor=None, Tensor? step_tensor=None, "
    "Tensor? grad_scale_tensor=None, Tensor? found_inf=None) -> ()";

// Pointer and dtype arrays that an AdamTensorList points into.
struct AdamArrays {
  std::vector<float*> params, exp_avgs, exp_avg_sqs;
  std::vector<const void*> grads;
  std::vector<void*> model_params;
  std::vector<int64_t> numel;
  std::vector<DType> grad_dtypes, model_dtypes;

  AdamTensorList view() const;
};

// The two halves of check_adam_args, for a call whose tensors were checked
// before (adam_cache.h): the numbers, and the one-element tensors, which must
// be on `device` (params[0]'s).
void check_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                      bool adam_w_mode, bool bias_correction, double grad_scale, bool step_is_tensor,
                      bool grad_scale_is_tensor, AdamHyper& hyper);
void check_adam_scalar_tensors(const std::optional<at::Tensor>& lr_tensor,
                               const std::optional<at::Tensor>& step_tensor,
                               const std::optional<at::Tensor>& grad_scale_tensor,
                               const std::optional<at::Tensor>& found_inf, const c10::Device& device,
                               AdamHyper& hyper);
// Each tensor: dtype, device, layout, sizes, aliasing; fills `arrays`.
void check_adam_tensors(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList model_params, AdamArrays& arrays);

// Checks every tensor (dtype, device, layout, sizes, aliasing) and the
// hyper-parameters; throws c10::TypeError / c10::ValueError (Python TypeError /
// ValueError) naming the culprit, e.g. "grads[3] has 4097 elements, params[3] has 4096".
// On success fills `arrays` and `hyper` (with the *_tensor arguments resolved
// to device pointers; the CPU binding turns those into values).
void check_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList model_params, double lr, double beta1,
                     double beta2, double eps, double weight_decay, double step, bool adam_w_mode,
                     bool bias_correction, double grad_scale, const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& step_tensor,
                     const std::optional<at::Tensor>& grad_scale_tensor,
                     const std::optional<at::Tensor>& found_inf, AdamArrays& arrays, AdamHyper& hyper);

}  // namespace zerokern
