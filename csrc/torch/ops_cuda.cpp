// CUDA kernels' registration for the zerokern operator library (defined in
// ops_cpu.cpp; import zerokern._C first). Built into zerokern._C_cuda.
#include <ATen/cuda/CUDAContext.h>
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "adam_args.h"
#include "flat_ops.h"
#include "zerokern/adam.h"
#include "zerokern/cast.h"

namespace zerokern {
namespace {

void fused_adam_cuda_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList model_params, double lr, double beta1,
                        double beta2, double eps, double weight_decay, double step, bool adam_w_mode,
                        bool bias_correction, double grad_scale, const std::optional<at::Tensor>& lr_tensor,
                        const std::optional<at::Tensor>& step_tensor,
                        const std::optional<at::Tensor>& grad_scale_tensor,
                        const std::optional<at::Tensor>& found_inf) {
  AdamArrays arrays;
  AdamHyper h;
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, model_params, lr, beta1, beta2, eps, weight_decay,
                  step, adam_w_mode, bias_correction, grad_scale, lr_tensor, step_tensor, grad_scale_tensor,
                  found_inf, arrays, h);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const int err = fused_adam_cuda(arrays.view(), h, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "zerokern fused_adam_ launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void launch_cast_cuda(const CastList& l, const at::Tensor& device_of) {
  const c10::cuda::CUDAGuard guard(device_of.device());
  const int err = cast_copy_cuda(l, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "zerokern cast_copy launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}


}  // namespace

TORCH_LIBRARY_IMPL(zerokern, CUDA, m) {
  m.impl("fused_adam_", &fused_adam_cuda_op);
  using Flat = FlatOps<launch_cast_cuda>;
  m.impl("flatten", &Flat::flatten);
  m.impl("flatten_into_", &Flat::flatten_into);
  m.impl("unflatten", &Flat::unflatten);
  m.impl("unflatten_into_", &Flat::unflatten_into);
}

}  // namespace zerokern

extern "C" PyObject* PyInit__C_cuda(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C_cuda", "zerokern CUDA operators (torch.ops.zerokern)", -1,
                            nullptr};
  return PyModule_Create(&def);
}
