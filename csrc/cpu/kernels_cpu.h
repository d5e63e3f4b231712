// Internal to the CPU kernels: the per-ISA entry points (adam_isa.inc and
// cast_isa.inc, built once per ISA by kernels_<isa>.cpp) and the choice among
// them (dispatch.cpp).
#pragma once

#include <cstdint>

#include "zerokern/adam.h"
#include "zerokern/dtype.h"
#include "zerokern/lowbit.h"
#include "zerokern/wire.h"

namespace zerokern {
namespace cpu {

// One contiguous span of one tensor of an Adam call.
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
using CastSpanFn = void (*)(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, bool stream);
// Blocks [first, last) of tensor k of a low-bit Adam call (lowbit_isa.inc).
using LowBitBlocksFn = void (*)(const LowBitTensorList& t, const LowBitCall& call, int64_t k, int64_t first,
                                int64_t last);
// Blocks [first, last) of a wire-format chunk (wire_isa.inc).
using WireEncodeFn = void (*)(const WireEncode& a, int64_t first, int64_t last);
using WireDecodeFn = void (*)(const WireDecode& a, int64_t first, int64_t last);

#define ZK_DECLARE_ISA(isa)                                                         \
  namespace isa {                                                                   \
  void adam_span(const AdamSpan& s, const AdamCoeffs& c);                           \
  void roof_span(const AdamSpan& s, const AdamCoeffs& c);                           \
  void cast_span(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n, bool stream); \
  void lowbit_blocks(const LowBitTensorList& t, const LowBitCall& call, int64_t k, int64_t first, int64_t last); \
  void wire_encode_blocks(const WireEncode& a, int64_t first, int64_t last);                    \
  void wire_decode_blocks(const WireDecode& a, int64_t first, int64_t last);                    \
  }
ZK_DECLARE_ISA(avx512)
ZK_DECLARE_ISA(avx2)
ZK_DECLARE_ISA(baseline)
#undef ZK_DECLARE_ISA

struct Variant {
  const char* name;
  AdamSpanFn adam;
  AdamSpanFn roof;
  CastSpanFn cast;
  LowBitBlocksFn lowbit;
  WireEncodeFn wire_encode;
  WireDecodeFn wire_decode;
};

// The widest variant this CPU runs (or the one ZEROKERN_CPU_CAPABILITY names),
// chosen on first use.
const Variant& variant();

}  // namespace cpu
}  // namespace zerokern
