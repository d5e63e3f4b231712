// The emulated CUDA kernels' entry points, for the tests (tests/kernels/simt_emu.py calls them through
// ctypes). Each fills the torch-free struct of csrc/include/zerokern as the torch binding
// (csrc/torch/*_args.cpp) does and calls the CUDA host code of csrc/cuda, which launches its
// kernels on the emulator (simt.h). No validation here: the tests pass valid tensors, and what
// they test is the kernels. Returns the host code's cudaError (0: success).
#include "zerokern/adam.h"
#include "zerokern/cast.h"
#include "zerokern/lowbit.h"
#include "zerokern/wire.h"

using zerokern::DType;

namespace {
// hyper: lr, beta1, beta2, eps, weight_decay, step, grad_scale
zerokern::AdamHyper adam_hyper(const double* hyper, int adam_w_mode, int bias_correction) {
  zerokern::AdamHyper h;
  h.lr = hyper[0];
  h.beta1 = hyper[1];
  h.beta2 = hyper[2];
  h.eps = hyper[3];
  h.weight_decay = hyper[4];
  h.step = hyper[5];
  h.grad_scale = hyper[6];
  h.adam_w_mode = adam_w_mode != 0;
  h.bias_correction = bias_correction != 0;
  return h;
}
}  // namespace

ZK_EMU_API int zk_emu_fused_adam(int64_t count, float* const* params, const void* const* grads, float* const* exp_avgs,
                                 float* const* exp_avg_sqs, void* const* model_params, const int64_t* numel,
                                 const uint8_t* grad_dtypes, const uint8_t* model_dtypes, const double* hyper,
                                 int adam_w_mode, int bias_correction, const float* lr_ptr, const float* step_ptr,
                                 const float* grad_scale_ptr, const float* found_inf_ptr) {
  zerokern::AdamTensorList t;
  t.count = count;
  t.params = params;
  t.grads = grads;
  t.exp_avgs = exp_avgs;
  t.exp_avg_sqs = exp_avg_sqs;
  t.model_params = model_params;
  t.numel = numel;
  t.grad_dtypes = reinterpret_cast<const DType*>(grad_dtypes);
  t.model_dtypes = reinterpret_cast<const DType*>(model_dtypes);
  zerokern::AdamHyper h = adam_hyper(hyper, adam_w_mode, bias_correction);
  h.lr_ptr = lr_ptr;
  h.step_ptr = step_ptr;
  h.grad_scale_ptr = grad_scale_ptr;
  h.found_inf_ptr = found_inf_ptr;
  return zerokern::fused_adam_cuda(t, h, nullptr);
}

ZK_EMU_API int zk_emu_cast_copy(int64_t count, const void* const* src, void* const* dst, const int64_t* numel,
                                const uint8_t* src_dtypes, const uint8_t* dst_dtypes) {
  zerokern::CastList l;
  l.count = count;
  l.src = src;
  l.dst = dst;
  l.numel = numel;
  l.src_dtypes = reinterpret_cast<const DType*>(src_dtypes);
  l.dst_dtypes = reinterpret_cast<const DType*>(dst_dtypes);
  return zerokern::cast_copy_cuda(l, nullptr);
}

// maps: lowbit.py's eight tables (zerokern.kernels.lowbit.maps()), as build_lowbit reads them.
ZK_EMU_API int zk_emu_fused_adam_lowbit(int64_t count, void* const* params, const void* const* grads,
                                        void* const* exp_avgs, void* const* exp_avg_sqs, float* const* exp_avg_scales,
                                        float* const* exp_avg_sq_scales, void* const* model_params,
                                        const int64_t* numel, const int64_t* index_base, const uint8_t* grad_dtypes,
                                        int model_dtype, int param_bf16, int state, const double* hyper,
                                        int adam_w_mode, int bias_correction, uint64_t seed, void* const* maps) {
  zerokern::LowBitTensorList t;
  t.count = count;
  t.params = params;
  t.grads = grads;
  t.exp_avgs = exp_avgs;
  t.exp_avg_sqs = exp_avg_sqs;
  t.exp_avg_scales = exp_avg_scales;
  t.exp_avg_sq_scales = exp_avg_sq_scales;
  t.model_params = model_params;
  t.numel = numel;
  t.index_base = index_base;
  t.grad_dtypes = reinterpret_cast<const DType*>(grad_dtypes);
  t.model_dtype = static_cast<DType>(model_dtype);
  t.param_bf16 = param_bf16 != 0;
  t.state = static_cast<zerokern::StateFormat>(state);
  const zerokern::AdamHyper h = adam_hyper(hyper, adam_w_mode, bias_correction);
  zerokern::LowBitCall call;
  call.coeffs = zerokern::resolve_coeffs(h, h.lr, h.step, h.grad_scale);
  call.seed = seed;
  call.step = static_cast<uint32_t>(static_cast<int64_t>(h.step));
  const auto f = [&](int i) { return static_cast<const float*>(maps[i]); };
  const auto c = [&](int i) { return static_cast<const int32_t*>(maps[i]); };
  call.maps.sgn = {f(0), f(1), c(2), c(6)};
  call.maps.uns = {f(3), f(4), c(5), c(7)};
  return zerokern::fused_adam_lowbit_cuda(t, call, nullptr);
}

// stream: the caller's (the Philox counter's word 3 is kStreamWire + stream, as wire_encode_args).
ZK_EMU_API int zk_emu_wire_encode(const void* x, int dtype, int64_t n, uint8_t* out, void* error, int error_dtype,
                                  const void* residual, int residual_dtype, int bits, uint64_t seed, int64_t step,
                                  int64_t stream, int64_t base, int stochastic) {
  zerokern::WireEncode a;
  a.x = x;
  a.dtype = static_cast<DType>(dtype);
  a.n = n;
  a.out = out;
  a.error = error;
  a.error_dtype = static_cast<DType>(error_dtype);
  a.residual = residual;
  a.residual_dtype = static_cast<DType>(residual_dtype);
  a.bits = bits;
  a.seed = seed;
  a.step = static_cast<uint32_t>(step);
  a.stream = zerokern::kStreamWire + static_cast<uint32_t>(stream);
  a.base = base;
  a.stochastic = stochastic != 0;
  return zerokern::wire_encode_cuda(a, nullptr);
}

ZK_EMU_API int zk_emu_wire_decode(const uint8_t* buf, int64_t n, int bits, float* out, int accumulate) {
  zerokern::WireDecode a;
  a.buf = buf;
  a.n = n;
  a.bits = bits;
  a.out = out;
  a.accumulate = accumulate != 0;
  return zerokern::wire_decode_cuda(a, nullptr);
}
