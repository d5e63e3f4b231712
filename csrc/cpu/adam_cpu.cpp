// CPU fused Adam: the SIMD variant chosen at run time (dispatch.cpp), the work
// split over OpenMP threads by elements (parallel.h).
#include "kernels_cpu.h"
#include "parallel.h"
#include "zerokern/adam.h"

namespace zerokern {
namespace {

void run_spans(const AdamTensorList& t, int num_threads, cpu::AdamSpanFn fn, const AdamCoeffs& c) {
  const bool has_model = t.model_params != nullptr;
  cpu::parallel_slices(t.numel, t.count, num_threads, [&](int64_t k, int64_t b, int64_t e) {
    cpu::AdamSpan s;
    s.param = t.params[k] + b;
    s.grad = static_cast<const char*>(t.grads[k]) + b * element_size(t.grad_dtypes[k]);
    s.exp_avg = t.exp_avgs[k] + b;
    s.exp_avg_sq = t.exp_avg_sqs[k] + b;
    s.model_param = has_model ? static_cast<char*>(t.model_params[k]) + b * 2 : nullptr;
    s.n = e - b;
    s.grad_dtype = t.grad_dtypes[k];
    s.model_dtype = has_model ? t.model_dtypes[k] : DType::kNone;
    fn(s, c);
  });
}

}  // namespace

void fused_adam_cpu(const AdamTensorList& t, const AdamHyper& h, int num_threads) {
  run_spans(t, num_threads, cpu::variant().adam, resolve_coeffs(h, h.lr, h.step, h.grad_scale));
}

void stream_roof_cpu(const AdamTensorList& t, int num_threads) {
  run_spans(t, num_threads, cpu::variant().roof, AdamCoeffs{});
}

}  // namespace zerokern
