// CPU fused Adam: picks the SIMD variant at run time and splits the work over
// OpenMP threads by elements, not by tensors, so 200 small tensors cost about
// what one tensor of the same total size costs.
#include <omp.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "adam_cpu.h"
#include "zerokern/adam.h"

namespace zerokern {
namespace {

struct Variant {
  const char* name;
  cpu::AdamSpanFn adam;
  cpu::AdamSpanFn roof;
};

bool cpu_has(const char* feature) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (!std::strcmp(feature, "avx512"))
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("bmi2");
  if (!std::strcmp(feature, "avx2"))
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
#endif
  return !std::strcmp(feature, "baseline");
}

// The widest variant this CPU runs, or the one ZEROKERN_CPU_CAPABILITY names
// (for tests and for comparing variants; asking for one the CPU lacks is an error).
Variant choose_variant() {
  static const Variant variants[] = {
      {"avx512", cpu::avx512::adam_span, cpu::avx512::roof_span},
      {"avx2", cpu::avx2::adam_span, cpu::avx2::roof_span},
      {"baseline", cpu::baseline::adam_span, cpu::baseline::roof_span},
  };
  const char* wanted = std::getenv("ZEROKERN_CPU_CAPABILITY");
  if (wanted && *wanted) {
    for (const Variant& v : variants) {
      if (!std::strcmp(v.name, wanted)) {
        if (!cpu_has(v.name))
          throw std::runtime_error(std::string("ZEROKERN_CPU_CAPABILITY=") + wanted +
                                   " but this CPU lacks the instructions it needs");
        return v;
      }
    }
    throw std::runtime_error(std::string("ZEROKERN_CPU_CAPABILITY=") + wanted +
                             " is not one of avx512, avx2, baseline");
  }
  for (const Variant& v : variants)
    if (cpu_has(v.name)) return v;
  return variants[2];
}

const Variant& variant() {
  static const Variant chosen = choose_variant();
  return chosen;
}

// Below this many elements per thread, starting a thread costs more than it saves.
constexpr int64_t kMinElementsPerThread = 1 << 15;
// Thread boundaries fall on multiples of 16 fp32 elements (one 64-byte cache line).
constexpr int64_t kBoundary = 16;

}  // namespace

const char* cpu_capability() { return variant().name; }

namespace {

// Runs fn over the list, split across threads by elements: thread k takes the
// k-th equal slice of the concatenation of all tensors, so many small tensors
// balance as well as one big one.
void for_each_span(const AdamTensorList& t, int num_threads, cpu::AdamSpanFn fn, const AdamCoeffs& c) {
  // start[i]: index of tensor i's first element in the concatenation of all tensors.
  std::vector<int64_t> start(t.count + 1, 0);
  for (int64_t i = 0; i < t.count; ++i) start[i + 1] = start[i] + t.numel[i];
  const int64_t total = start[t.count];
  if (total == 0) return;

  const int64_t by_size = (total + kMinElementsPerThread - 1) / kMinElementsPerThread;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, by_size)));

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = total * tid / nth / kBoundary * kBoundary;
    const int64_t hi = tid + 1 == nth ? total : total * (tid + 1) / nth / kBoundary * kBoundary;
    // First tensor whose range ends after lo.
    int64_t k = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; k < t.count && start[k] < hi; ++k) {
      const int64_t b = std::max(lo, start[k]) - start[k];
      const int64_t e = std::min(hi, start[k + 1]) - start[k];
      if (e <= b) continue;
      const bool has_model = t.model_params != nullptr;
      const size_t gsize = t.grad_dtypes[k] == DType::kFloat32 ? 4 : 2;
      cpu::AdamSpan s;
      s.param = t.params[k] + b;
      s.grad = static_cast<const char*>(t.grads[k]) + b * gsize;
      s.exp_avg = t.exp_avgs[k] + b;
      s.exp_avg_sq = t.exp_avg_sqs[k] + b;
      s.model_param = has_model ? static_cast<char*>(t.model_params[k]) + b * 2 : nullptr;
      s.n = e - b;
      s.grad_dtype = t.grad_dtypes[k];
      s.model_dtype = has_model ? t.model_dtypes[k] : DType::kNone;
      fn(s, c);
    }
  }
}

}  // namespace

void fused_adam_cpu(const AdamTensorList& t, const AdamHyper& h, int num_threads) {
  for_each_span(t, num_threads, variant().adam, resolve_coeffs(h, h.lr, h.step, h.grad_scale));
}

void stream_roof_cpu(const AdamTensorList& t, int num_threads) {
  for_each_span(t, num_threads, variant().roof, AdamCoeffs{});
}

}  // namespace zerokern
