#include "lowbit_args.h"

#include <c10/util/Exception.h>

namespace zerokern {
namespace {

DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

}  // namespace

bool build_lowbit(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList model_params, at::TensorList exp_avg_scales, at::TensorList exp_avg_sq_scales,
                  at::IntArrayRef index_bases, at::TensorList maps, int64_t seed, double lr, double beta1,
                  double beta2, double eps, double weight_decay, double step, bool adam_w_mode, bool bias_correction,
                  double grad_scale, LowBitArrays& a, LowBitCall& call) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && index_bases.size() == n,
              "fused_adam_lowbit_: the lists must have one entry per param");
  TORCH_CHECK(maps.size() == 8, "fused_adam_lowbit_: maps must be zerokern.kernels.lowbit.maps()");
  // the keyed tables' layout (kKeyExpLo, kKeyEntries) is lowbit.py's KEY_EXP_LO / KEY_ENTRIES
  TORCH_CHECK(maps[6].numel() == kKeyEntries && maps[7].numel() == kKeyEntries,
              "fused_adam_lowbit_: maps[6:8] must be lowbit.py's keyed tables of ", kKeyEntries, " rows");
  if (n == 0) return false;
  LowBitTensorList& t = a.list;
  const auto sdt = exp_avgs[0].scalar_type();
  t.state = sdt == at::kByte ? StateFormat::kInt8 : sdt == at::kBFloat16 ? StateFormat::kBFloat16
                                                                         : StateFormat::kFloat32;
  t.param_bf16 = params[0].scalar_type() == at::kBFloat16;
  const bool int8 = t.state == StateFormat::kInt8, has_model = !model_params.empty();
  TORCH_CHECK(!int8 || (exp_avg_scales.size() == n && exp_avg_sq_scales.size() == n),
              "fused_adam_lowbit_: int8 state needs scales for every tensor");
  TORCH_CHECK(!has_model || model_params.size() == n, "fused_adam_lowbit_: one model param per param");
  for (size_t i = 0; i < n; ++i) {
    const int64_t k = params[i].numel();
    TORCH_CHECK(grads[i].numel() == k && exp_avgs[i].numel() == k && exp_avg_sqs[i].numel() == k &&
                    (!has_model || model_params[i].numel() == k),
                "fused_adam_lowbit_: tensor ", i, " has lists of different sizes");
    TORCH_CHECK(!int8 || (exp_avg_scales[i].numel() == (k + kBlock - 1) / kBlock &&
                          exp_avg_sq_scales[i].numel() == (k + kBlock - 1) / kBlock),
                "fused_adam_lowbit_: tensor ", i, " needs one scale per block of ", kBlock);
    a.params.push_back(params[i].data_ptr());
    a.grads.push_back(grads[i].data_ptr());
    a.exp_avgs.push_back(exp_avgs[i].data_ptr());
    a.exp_avg_sqs.push_back(exp_avg_sqs[i].data_ptr());
    if (has_model) a.model_params.push_back(model_params[i].data_ptr());
    if (int8) {
      a.exp_avg_scales.push_back(exp_avg_scales[i].data_ptr<float>());
      a.exp_avg_sq_scales.push_back(exp_avg_sq_scales[i].data_ptr<float>());
    }
    a.numel.push_back(k);
    a.index_base.push_back(index_bases[i]);
    a.grad_dtypes.push_back(dtype_of(grads[i]));
  }
  t.count = static_cast<int64_t>(n);
  t.params = a.params.data();
  t.grads = a.grads.data();
  t.exp_avgs = a.exp_avgs.data();
  t.exp_avg_sqs = a.exp_avg_sqs.data();
  t.exp_avg_scales = int8 ? a.exp_avg_scales.data() : nullptr;
  t.exp_avg_sq_scales = int8 ? a.exp_avg_sq_scales.data() : nullptr;
  t.model_params = has_model ? a.model_params.data() : nullptr;
  t.model_dtype = has_model ? dtype_of(model_params[0]) : DType::kNone;
  t.numel = a.numel.data();
  t.index_base = a.index_base.data();
  t.grad_dtypes = a.grad_dtypes.data();
  AdamHyper h;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.eps = eps;
  h.weight_decay = weight_decay;
  h.adam_w_mode = adam_w_mode;
  h.bias_correction = bias_correction;
  call.coeffs = resolve_coeffs(h, lr, step, grad_scale);
  call.seed = static_cast<uint64_t>(seed);
  call.step = static_cast<uint32_t>(static_cast<int64_t>(step));
  call.maps.sgn = {maps[0].data_ptr<float>(), maps[1].data_ptr<float>(), maps[2].data_ptr<int32_t>(),
                   maps[6].data_ptr<int32_t>()};
  call.maps.uns = {maps[3].data_ptr<float>(), maps[4].data_ptr<float>(), maps[5].data_ptr<int32_t>(),
                   maps[7].data_ptr<int32_t>()};
  return true;
}

}  // namespace zerokern
