// zerokern fused Adam/AdamW: the torch-free kernel interface.
//
// Everything in this header is plain C++ (and CUDA where __CUDACC__ is set), so
// the kernels compile without torch headers: nvcc builds them in seconds and
// the same code serves a C++ test or another framework. The torch binding
// (csrc/torch/) validates the inputs and fills these structs; the kernels
// assume valid input.
//
// Update, per element, in fp32 (torch.optim.AdamW / Adam semantics):
//   g  = grad * (1 / grad_scale)                 (as GradScaler unscales: exact for
//                                                 the power-of-two scales it uses)
//   g += weight_decay * p                       (adam_w_mode == false: L2)
//   p *= 1 - lr * weight_decay                  (adam_w_mode == true: decoupled)
//   m  = beta1 * m + (1 - beta1) * g
//   v  = beta2 * v + (1 - beta2) * g * g
//   p -= (lr / bc1) * m / (sqrt(v) * (1 / sqrt(bc2)) + eps)
//   model_param = round_to_nearest_even(p)      (when a model tensor is given)
// with bc1 = 1 - beta1^step and bc2 = 1 - beta2^step (1 without bias correction).
#pragma once

#include <cmath>
#include <cstdint>

#include "zerokern/dtype.h"

#if defined(__CUDACC__)
#define ZK_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define ZK_HOST_DEVICE inline
#endif

namespace zerokern {

// Hyper-parameters of one call, as the caller gave them. lr, step and
// grad_scale may instead come from one-element device tensors (the *_ptr
// fields, nullable) so a CUDA graph can capture a step with no host sync; the
// CPU path resolves those on the host before launching.
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double step = 1.0;        // 1-based number of the update being made
  double grad_scale = 1.0;  // grads are multiplied by its reciprocal
  bool adam_w_mode = true;
  bool bias_correction = true;
  const float* lr_ptr = nullptr;
  const float* step_ptr = nullptr;
  const float* grad_scale_ptr = nullptr;
  const float* found_inf_ptr = nullptr;  // non-zero: the call changes nothing
};

// The per-call constants of the element update, resolved from AdamHyper.
struct AdamCoeffs {
  float beta1, beta2, one_minus_beta1, one_minus_beta2, eps;
  float weight_decay;  // L2 term (adam_w_mode == false), else 0
  float decay;         // decoupled factor 1 - lr * wd (adam_w_mode == true), else 1
  float step_size;     // lr / bc1
  float inv_bc2_sqrt;  // 1 / sqrt(bc2)
  float inv_grad_scale;
};

// In double, as torch.optim does: 1 - beta2^step loses most of its digits to
// cancellation in float (bc2 = 1e-3 at step 1 would be off by 1e-5 relative).
// On the GPU this runs once per thread, not per element.
// lr is rounded to float first, so a number and a float32 tensor holding it
// give the same bits.
ZK_HOST_DEVICE AdamCoeffs resolve_coeffs(const AdamHyper& h, double lr_in, double step, double grad_scale) {
  const double lr = static_cast<float>(lr_in);
  AdamCoeffs c;
  c.beta1 = static_cast<float>(h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.eps = static_cast<float>(h.eps);
  c.weight_decay = h.adam_w_mode ? 0.f : static_cast<float>(h.weight_decay);
  c.decay = h.adam_w_mode ? static_cast<float>(1.0 - lr * h.weight_decay) : 1.f;
  const double bc1 = h.bias_correction ? 1.0 - pow(h.beta1, step) : 1.0;
  const double bc2 = h.bias_correction ? 1.0 - pow(h.beta2, step) : 1.0;
  c.step_size = static_cast<float>(lr / bc1);
  // Reciprocals, so the element loop has one division (m / denom) and one
  // square root: with three divisions a 2-core AVX-512 CPU was compute-bound
  // on cache-resident sizes.
  c.inv_bc2_sqrt = static_cast<float>(1.0 / sqrt(bc2));
  c.inv_grad_scale = static_cast<float>(1.0 / static_cast<double>(static_cast<float>(grad_scale)));
  return c;
}

// One element's update. p, m, v are read and written in fp32; returns sqrt(v), which the
// low-bit kernels store (int8 exp_avg_sq holds its square root), so they need no second one.
ZK_HOST_DEVICE float adam_element_root(float& p, float& m, float& v, float g, const AdamCoeffs& c) {
  g = g * c.inv_grad_scale;
  g = g + c.weight_decay * p;
  p = p * c.decay;
  m = c.beta1 * m + c.one_minus_beta1 * g;
  v = c.beta2 * v + c.one_minus_beta2 * g * g;
  const float root = sqrtf(v);
  const float denom = root * c.inv_bc2_sqrt + c.eps;
  p = p - c.step_size * (m / denom);
  return root;
}

ZK_HOST_DEVICE void adam_element(float& p, float& m, float& v, float g, const AdamCoeffs& c) {
  (void)adam_element_root(p, m, v, g, c);
}

// A list of tensors updated by one call. Pointers are to the first element of
// contiguous storage; tensor i has numel[i] elements. grads[i] has
// grad_dtypes[i]; model_params may be null (no write-back) or hold a pointer per
// tensor with model_dtypes[i] (kFloat16 or kBFloat16).
struct AdamTensorList {
  int64_t count = 0;
  float* const* params = nullptr;
  const void* const* grads = nullptr;
  float* const* exp_avgs = nullptr;
  float* const* exp_avg_sqs = nullptr;
  void* const* model_params = nullptr;
  const int64_t* numel = nullptr;
  const DType* grad_dtypes = nullptr;
  const DType* model_dtypes = nullptr;
};

// CPU: SIMD (chosen at run time from the CPU's features) and OpenMP over
// num_threads threads. Requires the *_ptr fields of hyper to be null.
void fused_adam_cpu(const AdamTensorList& tensors, const AdamHyper& hyper, int num_threads);

// A benchmark's bandwidth roof for fused_adam_cpu: the same memory streams and
// threading with one add per stream instead of the Adam arithmetic.
void stream_roof_cpu(const AdamTensorList& tensors, int num_threads);

// Which SIMD variant fused_adam_cpu runs on this machine: "avx512", "avx2" or "baseline".
const char* cpu_capability();

#if defined(ZEROKERN_WITH_CUDA)
// CUDA: a few launches for the whole list on `stream` (a cudaStream_t).
// Returns the first launch error, or 0 (cudaSuccess).
int fused_adam_cuda(const AdamTensorList& tensors, const AdamHyper& hyper, void* stream);
#endif

}  // namespace zerokern
