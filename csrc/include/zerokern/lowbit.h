// zerokern low-bit Adam: the torch-free kernel interface (the numbers are defined by
// zerokern/kernels/lowbit.py; tests compare every kernel against it).
//
// Per block of kBlock elements of one tensor (blocks counted from the tensor's first element):
//   decode m, v        int8 codes: map[code] * scale, squared for v (int8 v holds sqrt(v): [Note: the
//                      second moment as its square root] in lowbit.py); bf16: widened; fp32: as is
//   adam_element       adam.h's update, in fp32, on each element
//   encode m, v        int8 (v: its square root): scale = absmax of the new block, code = how many of the map's 255
//                      midpoints are below x * (1 / scale) (fp32; the code of 0 when scale is 0);
//                      bf16: stochastic rounding
//   write p            fp32 master (and the fp16/bf16 model copy, rounded to nearest), or a bf16
//                      param without master, stochastically rounded
// Stochastic rounding of element i (global index base + i) adds the 16-bit half (i & 1) of word
// ((i >> 1) & 3) of Philox4x32-10(counter = (i >> 3 as two 32-bit words, step, stream), key = seed)
// to the fp32 bits and keeps the top 16.
#pragma once

#include <cstdint>

#include "zerokern/adam.h"
#include "zerokern/dtype.h"

namespace zerokern {

constexpr int64_t kBlock = 256;
constexpr uint32_t kStreamParam = 0, kStreamExpAvg = 1, kStreamExpAvgSq = 2;

enum class StateFormat : uint8_t { kFloat32 = 0, kBFloat16 = 1, kInt8 = 2 };

// The quantizer's tables (from lowbit.py, so every backend reads the same fp32 values).
struct QuantTables {
  const float* map;      // 256 values, ascending
  const float* mid;      // the 255 midpoints, then +inf
  const int32_t* cells;  // 65536: how many midpoints lie below each cell ([Note: quantizing by cells])
  const int32_t* keyed;  // kKeyEntries rows: count | threshold << 8 ([Note: quantizing by keys])
};
struct QuantMaps {
  QuantTables sgn, uns;  // exp_avg's (signed) and exp_avg_sq's (unsigned)
};
constexpr int kCellShift = 16;
constexpr int kKeyExpLo = 96, kKeyEntries = 1 << 13;

struct LowBitTensorList {
  int64_t count = 0;
  void* const* params = nullptr;         // fp32 masters or bf16 params (param_bf16)
  const void* const* grads = nullptr;
  void* const* exp_avgs = nullptr;       // per format: float, uint16 (bf16) or uint8 codes
  void* const* exp_avg_sqs = nullptr;
  float* const* exp_avg_scales = nullptr;     // int8: one per block
  float* const* exp_avg_sq_scales = nullptr;
  void* const* model_params = nullptr;   // null: none
  const int64_t* numel = nullptr;
  const int64_t* index_base = nullptr;   // global index of each tensor's first element
  const DType* grad_dtypes = nullptr;
  DType model_dtype = DType::kNone;
  bool param_bf16 = false;
  StateFormat state = StateFormat::kFloat32;
};

struct LowBitCall {
  AdamCoeffs coeffs;
  uint64_t seed = 0;
  uint32_t step = 1;  // the 1-based update number (keys the random stream)
  QuantMaps maps;
};

ZK_HOST_DEVICE uint32_t mulhilo32(uint32_t a, uint32_t b, uint32_t* hi) {
  const uint64_t p = static_cast<uint64_t>(a) * b;
  *hi = static_cast<uint32_t>(p >> 32);
  return static_cast<uint32_t>(p);
}

// Philox4x32-10 (Salmon et al., SC 2011), as Random123 and Triton's tl.philox.
ZK_HOST_DEVICE void philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
#if defined(__CUDACC__)
#pragma unroll
#else
#pragma GCC unroll 10
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, hi1;
    const uint32_t lo0 = mulhilo32(0xD2511F53u, c[0], &hi0);
    const uint32_t lo1 = mulhilo32(0xCD9E8D57u, c[2], &hi1);
    const uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = lo1;
    c[2] = n2;
    c[3] = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
}

// The 16 random bits of global element `index`.
ZK_HOST_DEVICE uint32_t random16(uint64_t seed, uint32_t step, uint32_t stream, int64_t index) {
  const uint64_t group = static_cast<uint64_t>(index) >> 3;
  uint32_t c[4] = {static_cast<uint32_t>(group), static_cast<uint32_t>(group >> 32), step, stream};
  philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return (c[(index >> 1) & 3] >> (16 * (index & 1))) & 0xFFFFu;
}

// fp32 bits + 16 random bits, cut to bf16 (NaN: a quiet NaN; inf: inf).
ZK_HOST_DEVICE uint16_t stochastic_round_bf16_bits(uint32_t w, uint32_t r16) {
  const uint32_t mag = w & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return 0x7FC0u;
  if (mag == 0x7F800000u) return static_cast<uint16_t>(w >> 16);
  return static_cast<uint16_t>((w + r16) >> 16);
}

// How many of the 255 midpoints are below x: the code of x, from x's cell and one compare
// ([Note: quantizing by cells] in zerokern/kernels/lowbit.py).
ZK_HOST_DEVICE uint32_t quantize_code(float x, uint32_t xbits, const QuantTables& q) {
  const int32_t c = q.cells[xbits >> kCellShift];
  return static_cast<uint32_t>(c + (q.mid[c] < x ? 1 : 0));
}

// CPU: SIMD variant chosen at run time, OpenMP over the blocks of every tensor.
void fused_adam_lowbit_cpu(const LowBitTensorList& tensors, const LowBitCall& call, int num_threads);

#if defined(ZEROKERN_WITH_CUDA)
// CUDA: one launch per tensor on `stream` (a cudaStream_t); the first launch error, or 0.
int fused_adam_lowbit_cuda(const LowBitTensorList& tensors, const LowBitCall& call, void* stream);
#endif

}  // namespace zerokern
