#include "adam_args.h"

#include "names.h"

#include <cmath>
#include <sstream>

namespace zerokern {
namespace {

void check_tensor(const at::Tensor& t, const char* list, size_t i, const at::Tensor& p0, int64_t numel,
                  const char* expected, bool (*dtype_ok)(at::ScalarType)) {
  TORCH_CHECK_TYPE(t.defined(), where(list, i), " is None");
  TORCH_CHECK_TYPE(dtype_ok(t.scalar_type()), where(list, i), " is ", dtype_name(t.scalar_type()),
                   ", expected ", expected);
  TORCH_CHECK_VALUE(t.device() == p0.device(), where(list, i), " is on ", t.device().str(),
                    ", params[0] is on ", p0.device().str());
  TORCH_CHECK_VALUE(t.is_contiguous(), where(list, i), " is not contiguous");
  TORCH_CHECK_VALUE(t.numel() == numel, where(list, i), " has ", t.numel(), " elements, params[", i,
                    "] has ", numel);
}

bool is_f32(at::ScalarType t) { return t == at::kFloat; }
bool is_grad(at::ScalarType t) { return is_kernel_float(t); }
bool is_low(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }

const float* scalar_ptr(const std::optional<at::Tensor>& t, const char* name, const c10::Device& device) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, name, " is ", dtype_name(t->scalar_type()),
                   ", expected a one-element float32 tensor");
  TORCH_CHECK_VALUE(t->numel() == 1, name, " has ", t->numel(), " elements, expected one");
  TORCH_CHECK_VALUE(t->device() == device, name, " is on ", t->device().str(), ", params[0] is on ",
                    device.str());
  return t->data_ptr<float>();
}

}  // namespace

AdamTensorList AdamArrays::view() const {
  AdamTensorList l;
  l.count = static_cast<int64_t>(params.size());
  l.params = params.data();
  l.grads = grads.data();
  l.exp_avgs = exp_avgs.data();
  l.exp_avg_sqs = exp_avg_sqs.data();
  l.model_params = model_params.empty() ? nullptr : model_params.data();
  l.numel = numel.data();
  l.grad_dtypes = grad_dtypes.data();
  l.model_dtypes = model_dtypes.empty() ? nullptr : model_dtypes.data();
  return l;
}

void check_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay, double step,
                      bool adam_w_mode, bool bias_correction, double grad_scale, bool step_is_tensor,
                      bool grad_scale_is_tensor, AdamHyper& h) {
  // The same order and wording as torch.optim's constructor checks.
  TORCH_CHECK_VALUE(lr >= 0.0, "Invalid learning rate: ", lr);
  TORCH_CHECK_VALUE(eps >= 0.0, "Invalid epsilon value: ", eps);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0, "Invalid beta parameter at index 0: ", beta1);
  TORCH_CHECK_VALUE(beta2 >= 0.0 && beta2 < 1.0, "Invalid beta parameter at index 1: ", beta2);
  TORCH_CHECK_VALUE(weight_decay >= 0.0, "Invalid weight_decay value: ", weight_decay);
  TORCH_CHECK_VALUE(step_is_tensor || step >= 1.0,
                    "step must be >= 1 (the 1-based number of the update being made), got ", step);
  TORCH_CHECK_VALUE(grad_scale_is_tensor || (std::isfinite(grad_scale) && grad_scale != 0.0),
                    "grad_scale must be finite and non-zero, got ", grad_scale);
  h = AdamHyper();
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.step = step;
  h.grad_scale = grad_scale;
  h.adam_w_mode = adam_w_mode;
  h.bias_correction = bias_correction;
}

void check_adam_scalar_tensors(const std::optional<at::Tensor>& lr_tensor,
                               const std::optional<at::Tensor>& step_tensor,
                               const std::optional<at::Tensor>& grad_scale_tensor,
                               const std::optional<at::Tensor>& found_inf, const c10::Device& device,
                               AdamHyper& h) {
  h.lr_ptr = scalar_ptr(lr_tensor, "lr", device);
  h.step_ptr = scalar_ptr(step_tensor, "step", device);
  h.grad_scale_ptr = scalar_ptr(grad_scale_tensor, "grad_scale", device);
  h.found_inf_ptr = scalar_ptr(found_inf, "found_inf", device);
}

void check_adam_tensors(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, at::TensorList model_params, AdamArrays& a) {
  const size_t n = params.size();
  TORCH_CHECK_VALUE(grads.size() == n, "grads has ", grads.size(), " tensors, params has ", n);
  TORCH_CHECK_VALUE(exp_avgs.size() == n, "exp_avgs has ", exp_avgs.size(), " tensors, params has ", n);
  TORCH_CHECK_VALUE(exp_avg_sqs.size() == n, "exp_avg_sqs has ", exp_avg_sqs.size(), " tensors, params has ", n);
  TORCH_CHECK_VALUE(model_params.empty() || model_params.size() == n, "model_params has ", model_params.size(),
                    " tensors, params has ", n);

  const bool has_model = !model_params.empty();
  a.params.resize(n);
  a.grads.resize(n);
  a.exp_avgs.resize(n);
  a.exp_avg_sqs.resize(n);
  a.numel.resize(n);
  a.grad_dtypes.resize(n);
  a.model_params.resize(has_model ? n : 0);
  a.model_dtypes.resize(has_model ? n : 0);

  if (n > 0) {
    TORCH_CHECK_TYPE(params[0].defined(), "params[0] is None");
    const at::Tensor& p0 = params[0];
    for (size_t i = 0; i < n; ++i) {
      const int64_t numel = params[i].defined() ? params[i].numel() : 0;
      check_tensor(params[i], "params", i, p0, numel, "float32", is_f32);
      check_tensor(grads[i], "grads", i, p0, numel, "float32, float16 or bfloat16", is_grad);
      check_tensor(exp_avgs[i], "exp_avgs", i, p0, numel, "float32", is_f32);
      check_tensor(exp_avg_sqs[i], "exp_avg_sqs", i, p0, numel, "float32", is_f32);
      if (has_model) check_tensor(model_params[i], "model_params", i, p0, numel, "float16 or bfloat16", is_low);
      // Updating one buffer as two would silently corrupt it.
      if (numel > 0) {
        const void* pp = params[i].data_ptr();
        TORCH_CHECK_VALUE(exp_avgs[i].data_ptr() != pp && exp_avg_sqs[i].data_ptr() != pp &&
                              exp_avgs[i].data_ptr() != exp_avg_sqs[i].data_ptr(),
                          "params[", i, "], exp_avgs[", i, "] and exp_avg_sqs[", i, "] must not share memory");
      }
      a.params[i] = params[i].data_ptr<float>();
      a.grads[i] = grads[i].data_ptr();
      a.exp_avgs[i] = exp_avgs[i].data_ptr<float>();
      a.exp_avg_sqs[i] = exp_avg_sqs[i].data_ptr<float>();
      a.numel[i] = numel;
      a.grad_dtypes[i] = to_kernel_dtype(grads[i].scalar_type());
      if (has_model) {
        a.model_params[i] = model_params[i].data_ptr();
        a.model_dtypes[i] = to_kernel_dtype(model_params[i].scalar_type());
      }
    }
  }
}

void check_adam_args(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                     at::TensorList exp_avg_sqs, at::TensorList model_params, double lr, double beta1,
                     double beta2, double eps, double weight_decay, double step, bool adam_w_mode,
                     bool bias_correction, double grad_scale, const std::optional<at::Tensor>& lr_tensor,
                     const std::optional<at::Tensor>& step_tensor,
                     const std::optional<at::Tensor>& grad_scale_tensor,
                     const std::optional<at::Tensor>& found_inf, AdamArrays& a, AdamHyper& h) {
  check_adam_hyper(lr, beta1, beta2, eps, weight_decay, step, adam_w_mode, bias_correction, grad_scale,
                   step_tensor.has_value(), grad_scale_tensor.has_value(), h);
  check_adam_tensors(params, grads, exp_avgs, exp_avg_sqs, model_params, a);
  if (!params.empty()) check_adam_scalar_tensors(lr_tensor, step_tensor, grad_scale_tensor, found_inf,
                                                 params[0].device(), h);
}

}  // namespace zerokern
