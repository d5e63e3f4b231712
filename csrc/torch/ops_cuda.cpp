// CUDA kernels' registration for the zerokern operator library (defined in
// ops_cpu.cpp; import zerokern._C first). Built into zerokern._C_cuda.
#include <ATen/cuda/CUDAContext.h>
#include <Python.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "adam_args.h"
#include "adam_cache.h"
#include "flat_ops.h"
#include "lowbit_args.h"
#include "zerokern/adam.h"
#include "zerokern/cast.h"
#include "zerokern/lowbit.h"
#include "wire_args.h"
#include "zerokern/wire.h"

namespace zerokern {
namespace {

AdamArraysCache& cache() {
  static AdamArraysCache c;
  return c;
}

// One or a few launches on the current stream of the params' device.
void run_adam_cuda(const AdamArrays& arrays, AdamHyper& h, const c10::Device& device) {
  const c10::cuda::CUDAGuard guard(device);
  const int err = fused_adam_cuda(arrays.view(), h, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "zerokern fused_adam_ launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

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
  // See [Note: host cost]: the next call with these tensors skips the checks.
  cache().remember(key_of({params, grads, exp_avgs, exp_avg_sqs, model_params}), arrays, params[0].device());
  run_adam_cuda(arrays, h, params[0].device());
}

void launch_cast_cuda(const CastList& l, const at::Tensor& device_of) {
  const c10::cuda::CUDAGuard guard(device_of.device());
  const int err = cast_copy_cuda(l, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "zerokern cast_copy launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The low-bit update on CUDA tensors, on the current stream (the lists validated in Python).
void fused_adam_lowbit_cuda_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                               at::TensorList exp_avg_sqs, at::TensorList model_params,
                               at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                               at::IntArrayRef index_bases, at::TensorList maps, int64_t seed, double lr,
                               double beta1, double beta2, double eps, double weight_decay, double step,
                               bool adam_w_mode, bool bias_correction, double grad_scale) {
  LowBitArrays arrays;
  LowBitCall call;
  if (!build_lowbit(params, grads, exp_avgs, exp_avg_sqs, model_params, exp_avg_scales, exp_avg_sq_scales,
                    index_bases, maps, seed, lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction,
                    grad_scale, arrays, call))
    return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  const int err = fused_adam_lowbit_cuda(arrays.list, call, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "zerokern fused_adam_lowbit_ launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(err)));
}

// The wire format's kernels on CUDA tensors, on the current stream (validated in Python).
void wire_encode_cuda_op(const at::Tensor& x, const at::Tensor& out, const std::optional<at::Tensor>& error,
                         int64_t bits, int64_t seed, int64_t step, int64_t stream, int64_t base,
                         bool stochastic, const std::optional<at::Tensor>& residual) {
  const WireEncode a = wire_encode_args(x, out, error, bits, seed, step, stream, base, stochastic, residual);
  const c10::cuda::CUDAGuard guard(x.device());
  const int err = wire_encode_cuda(a, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "zerokern wire_encode_ launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

void wire_decode_cuda_op(const at::Tensor& buf, int64_t n, int64_t bits, const at::Tensor& out, bool accumulate) {
  const WireDecode a = wire_decode_args(buf, n, bits, out, accumulate);
  const c10::cuda::CUDAGuard guard(out.device());
  const int err = wire_decode_cuda(a, at::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == 0, "zerokern wire_decode_ launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(err)));
}

}  // namespace

TORCH_LIBRARY_IMPL(zerokern, CUDA, m) {
  m.impl("fused_adam_", &fused_adam_cuda_op);
  m.impl("fused_adam_lowbit_", &fused_adam_lowbit_cuda_op);
  m.impl("wire_encode_", &wire_encode_cuda_op);
  m.impl("wire_decode_", &wire_decode_cuda_op);
  using Flat = FlatOps<launch_cast_cuda>;
  m.impl("flatten", &Flat::flatten);
  m.impl("flatten_into_", &Flat::flatten_into);
  m.impl("unflatten", &Flat::unflatten);
  m.impl("unflatten_into_", &Flat::unflatten_into);
}

}  // namespace zerokern

namespace {
PyObject* fused_adam_cached_py(PyObject*, PyObject* args) {
  // A launch: quick and asynchronous, so the GIL stays (the caching allocator orders frees after it).
  return zerokern::fused_adam_cached(args, zerokern::cache(), zerokern::run_adam_cuda, /*release_gil=*/false);
}

PyMethodDef methods[] = {
    {"fused_adam_cached", fused_adam_cached_py, METH_VARARGS,
     "fused_adam_ on CUDA tensors validated before; see [Note: host cost] in csrc/torch/adam_cache.h"},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

extern "C" PyObject* PyInit__C_cuda(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C_cuda", "zerokern CUDA operators (torch.ops.zerokern)", -1,
                            methods};
  return PyModule_Create(&def);
}
