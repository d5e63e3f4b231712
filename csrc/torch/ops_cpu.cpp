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
#include "zerokern/lowbit.h"

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

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

// The low-bit update on CPU tensors. zerokern.kernels.lowbit_ops validated the lists (the one
// place their rules live); the checks here only keep a direct call from reading out of bounds.
void fused_adam_lowbit_cpu_op(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, at::TensorList model_params, at::TensorList exp_avg_scales,
                              at::TensorList exp_avg_sq_scales, at::IntArrayRef index_bases, at::TensorList maps,
                              int64_t seed, double lr, double beta1, double beta2, double eps, double weight_decay,
                              double step, bool adam_w_mode, bool bias_correction, double grad_scale) {
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(grads.size() == params.size() && exp_avgs.size() == params.size() &&
              exp_avg_sqs.size() == params.size() && index_bases.size() == params.size(),
              "fused_adam_lowbit_: the lists must have one entry per param");
  TORCH_CHECK(maps.size() == 6, "fused_adam_lowbit_: maps must be zerokern.kernels.lowbit.maps()");
  if (n == 0) return;
  LowBitTensorList t;
  const auto sdt = exp_avgs[0].scalar_type();
  t.state = sdt == at::kByte ? StateFormat::kInt8 : sdt == at::kBFloat16 ? StateFormat::kBFloat16
                                                                         : StateFormat::kFloat32;
  t.param_bf16 = params[0].scalar_type() == at::kBFloat16;
  const bool int8 = t.state == StateFormat::kInt8, has_model = !model_params.empty();
  TORCH_CHECK(!int8 || (exp_avg_scales.size() == params.size() && exp_avg_sq_scales.size() == params.size()),
              "fused_adam_lowbit_: int8 state needs scales for every tensor");
  std::vector<void*> p(n), m(n), v(n), out(has_model ? n : 0);
  std::vector<const void*> g(n);
  std::vector<float*> ms(int8 ? n : 0), vs(int8 ? n : 0);
  std::vector<int64_t> numel(n), base(n);
  std::vector<DType> gd(n);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t k = params[i].numel();
    TORCH_CHECK(grads[i].numel() == k && exp_avgs[i].numel() == k && exp_avg_sqs[i].numel() == k &&
                (!has_model || model_params[i].numel() == k),
                "fused_adam_lowbit_: tensor ", i, " has lists of different sizes");
    TORCH_CHECK(!int8 || (exp_avg_scales[i].numel() == (k + kBlock - 1) / kBlock &&
                          exp_avg_sq_scales[i].numel() == (k + kBlock - 1) / kBlock),
                "fused_adam_lowbit_: tensor ", i, " needs one scale per block of ", kBlock);
    p[i] = params[i].data_ptr();
    g[i] = grads[i].data_ptr();
    m[i] = exp_avgs[i].data_ptr();
    v[i] = exp_avg_sqs[i].data_ptr();
    if (has_model) out[i] = model_params[i].data_ptr();
    if (int8) {
      ms[i] = exp_avg_scales[i].data_ptr<float>();
      vs[i] = exp_avg_sq_scales[i].data_ptr<float>();
    }
    numel[i] = k;
    base[i] = index_bases[i];
    gd[i] = dtype_of(grads[i]);
  }
  t.count = n;
  t.params = p.data();
  t.grads = g.data();
  t.exp_avgs = m.data();
  t.exp_avg_sqs = v.data();
  t.exp_avg_scales = int8 ? ms.data() : nullptr;
  t.exp_avg_sq_scales = int8 ? vs.data() : nullptr;
  t.model_params = has_model ? out.data() : nullptr;
  t.model_dtype = has_model ? dtype_of(model_params[0]) : DType::kNone;
  t.numel = numel.data();
  t.index_base = base.data();
  t.grad_dtypes = gd.data();
  AdamHyper h;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adam_w_mode = adam_w_mode;
  h.bias_correction = bias_correction;
  LowBitCall call;
  call.coeffs = resolve_coeffs(h, lr, step, grad_scale);
  call.seed = static_cast<uint64_t>(seed);
  call.step = static_cast<uint32_t>(static_cast<int64_t>(step));
  call.maps.sgn = {maps[0].data_ptr<float>(), maps[1].data_ptr<float>(), maps[2].data_ptr<int32_t>()};
  call.maps.uns = {maps[3].data_ptr<float>(), maps[4].data_ptr<float>(), maps[5].data_ptr<int32_t>()};
  fused_adam_lowbit_cpu(t, call, at::get_num_threads());
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
  m.def("fused_adam_lowbit_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] model_params, Tensor(e!)[] exp_avg_scales, Tensor(f!)[] exp_avg_sq_scales, int[] index_bases, "
        "Tensor[] maps, int seed, float lr, float beta1, float beta2, float eps, float weight_decay, float step, "
        "bool adam_w_mode, bool bias_correction, float grad_scale) -> ()");
  m.def("stream_roof_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
        "Tensor(d!)[] model_params) -> ()");
}

TORCH_LIBRARY_IMPL(zerokern, CPU, m) {
  m.impl("fused_adam_", &fused_adam_cpu_op);
  m.impl("stream_roof_", &stream_roof_op);
  m.impl("fused_adam_lowbit_", &fused_adam_lowbit_cpu_op);
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
