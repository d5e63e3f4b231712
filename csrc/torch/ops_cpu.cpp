// The zerokern operator library: schema definitions and the CPU kernels'
// registration. Built into zerokern._C, which every install has.
#include <ATen/Parallel.h>
#include <cmath>
#include <Python.h>
#include <torch/library.h>

#include "adam_args.h"
#include "adam_cache.h"
#include "flat_ops.h"
#include "zerokern/adam.h"
#include "zerokern/cast.h"
#include "lowbit_args.h"
#include "zerokern/lowbit.h"
#include "wire_args.h"
#include "zerokern/wire.h"

namespace zerokern {
namespace {

AdamArraysCache& cache() {
  static AdamArraysCache c;
  return c;
}

// The update on the CPU, after validation (the op's and the cached path's).
void run_adam_cpu(const AdamArrays& arrays, AdamHyper& h, const c10::Device&) {
  // On the CPU the one-element tensors are plain memory: read them here.
  if (h.found_inf_ptr && *h.found_inf_ptr != 0.f) return;
  if (h.lr_ptr) h.lr = *h.lr_ptr;
  if (h.step_ptr) h.step = *h.step_ptr;
  if (h.grad_scale_ptr) h.grad_scale = *h.grad_scale_ptr;
  TORCH_CHECK_VALUE(h.step >= 1.0, "step must be >= 1 (the 1-based number of the update being made), got ", h.step);
  TORCH_CHECK_VALUE(std::isfinite(h.grad_scale) && h.grad_scale != 0.0,
                    "grad_scale must be finite and non-zero, got ", h.grad_scale);
  h.lr_ptr = h.step_ptr = h.grad_scale_ptr = h.found_inf_ptr = nullptr;
  // torch.set_num_threads() governs our OpenMP team too.
  fused_adam_cpu(arrays.view(), h, at::get_num_threads());
}

void fused_adam_cpu_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
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
  run_adam_cpu(arrays, h, params[0].device());
}

void launch_cast_cpu(const CastList& l, const at::Tensor&) { cast_copy_cpu(l, at::get_num_threads()); }

// The low-bit update on CPU tensors (zerokern.kernels.lowbit_ops validated the lists).
void fused_adam_lowbit_cpu_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList model_params, at::TensorList exp_avg_scales,
                              at::TensorList exp_avg_sq_scales, at::IntArrayRef index_bases, at::TensorList maps,
                              int64_t seed, double lr, double beta1, double beta2, double eps, double weight_decay,
                              double step, bool adam_w_mode, bool bias_correction, double grad_scale) {
  LowBitArrays arrays;
  LowBitCall call;
  if (!build_lowbit(params, grads, exp_avgs, exp_avg_sqs, model_params, exp_avg_scales, exp_avg_sq_scales,
                    index_bases, maps, seed, lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction,
                    grad_scale, arrays, call))
    return;
  fused_adam_lowbit_cpu(arrays.list, call, at::get_num_threads());
}

// The wire format's kernels on CPU tensors (zerokern.kernels.wire_ops validated the arguments).
void wire_encode_cpu_op(const at::Tensor& x, const at::Tensor& out, const std::optional<at::Tensor>& error,
                        int64_t bits, int64_t seed, int64_t step, int64_t stream, int64_t base,
                        bool stochastic, const std::optional<at::Tensor>& residual) {
  wire_encode_cpu(wire_encode_args(x, out, error, bits, seed, step, stream, base, stochastic, residual),
                  at::get_num_threads());
}

void wire_decode_cpu_op(const at::Tensor& buf, int64_t n, int64_t bits, const at::Tensor& out, bool accumulate) {
  wire_decode_cpu(wire_decode_args(buf, n, bits, out, accumulate), at::get_num_threads());
}

std::string cpu_capability_op() { return cpu_capability(); }

// For bench/: the bandwidth roof of fused_adam_ on these tensors (see stream_roof_cpu).
void stream_roof_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList model_params) {
  AdamArrays arrays;
  AdamHyper h;
  check_adam_args(params, grads, exp_avgs, exp_avg_sqs, model_params, 0.0, 0.9, 0.999, 0.0, 0.0, 1.0, true,
                  true, 1.0, {}, {}, {}, {}, arrays, h);
  stream_roof_cpu(arrays.view(), at::get_num_threads());
}

}  // namespace

TORCH_LIBRARY(zerokern, m) {
  m.def(kFusedAdamSchema);
  m.def(kFlattenSchema);
  m.def(kFlattenIntoSchema);
  m.def(kUnflattenSchema);
  m.def(kUnflattenIntoSchema);
  m.def("cpu_capability() -> str", &cpu_capability_op);
  m.def(kFusedAdamLowBitSchema);
  m.def(kWireEncodeSchema);
  m.def(kWireDecodeSchema);
  m.def("stream_roof_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] model_params) -> ()");
}

TORCH_LIBRARY_IMPL(zerokern, CPU, m) {
  m.impl("fused_adam_", &fused_adam_cpu_op);
  m.impl("stream_roof_", &stream_roof_op);
  m.impl("fused_adam_lowbit_", &fused_adam_lowbit_cpu_op);
  m.impl("wire_encode_", &wire_encode_cpu_op);
  m.impl("wire_decode_", &wire_decode_cpu_op);
  using Flat = FlatOps<launch_cast_cpu>;
  m.impl("flatten", &Flat::flatten);
  m.impl("flatten_into_", &Flat::flatten_into);
  m.impl("unflatten", &Flat::unflatten);
  m.impl("unflatten_into_", &Flat::unflatten_into);
}

}  // namespace zerokern

namespace {
PyObject* fused_adam_cached_py(PyObject*, PyObject* args) {
  return zerokern::fused_adam_cached(args, zerokern::cache(), zerokern::run_adam_cpu, /*release_gil=*/true);
}
PyObject* tensor_lists_id_py(PyObject*, PyObject* lists) { return zerokern::tensor_lists_id(lists); }

PyMethodDef methods[] = {
    {"fused_adam_cached", fused_adam_cached_py, METH_VARARGS,
     "fused_adam_ on CPU tensors validated before; see [Note: host cost] in csrc/torch/adam_cache.h"},
    {"tensor_lists_id", tensor_lists_id_py, METH_O, "a number for these tensors' pointers, sizes and dtypes"},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

// A Python module so `import zerokern._C` loads the library (and registers the ops).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "zerokern CPU operators (torch.ops.zerokern)", -1,
                            methods};
  return PyModule_Create(&def);
}
