// Internal to the CPU kernel: one contiguous span of one tensor, and the
// per-ISA entry points that update it (csrc/cpu/adam_isa.inc, built once per ISA).
#pragma once

#include <cstdint>

#include "zerokern/adam.h"

namespace zerokern {
namespace cpu {

struct AdamSpan {
  float* param;
  const void* grad;
  float* exp_avg;
  float* exp_avg_sq;
  void* model_param;  // null: no write-back
  int64_t n;
  DType grad_dtype;
  DType model_dtype;  // kNone when model_param is null
};

using AdamSpanFn = void (*)(const AdamSpan&, const AdamCoeffs&);

namespace avx512 {
void adam_span(const AdamSpan& s, const AdamCoeffs& c);
void roof_span(const AdamSpan& s, const AdamCoeffs& c);
}  // namespace avx512
namespace avx2 {
void adam_span(const AdamSpan& s, const AdamCoeffs& c);
void roof_span(const AdamSpan& s, const AdamCoeffs& c);
}  // namespace avx2
namespace baseline {
void adam_span(const AdamSpan& s, const AdamCoeffs& c);
void roof_span(const AdamSpan& s, const AdamCoeffs& c);
}  // namespace baseline

}  // namespace cpu
}  // namespace zerokern
