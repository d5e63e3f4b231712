// Branchless fp16/bf16 <-> fp32 conversions on raw bits, for CPU loops.
//
// Written without branches or table lookups so that GCC and Clang vectorize the
// loops that call them for whichever ISA the including file targets (see
// csrc/cpu/adam_isa.inc). Results are bit-exact with torch's .to(dtype):
// round-to-nearest-even, subnormals kept, inf kept, NaN stays NaN.
// The fp16 method is the classic one from Maratyszcza's FP16 library (also used
// by c10::Half): exponent re-biasing through float multiplication, so the FPU
// does the rounding.
#pragma once

#include <cstdint>
#include <cstring>

namespace zerokern {
namespace bits {

inline float f32_from_bits(uint32_t w) {
  float f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}

inline uint32_t f32_to_bits(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof w);
  return w;
}

inline float bf16_to_f32(uint16_t h) { return f32_from_bits(static_cast<uint32_t>(h) << 16); }

inline uint16_t f32_to_bf16(float f) {
  const uint32_t w = f32_to_bits(f);
  const uint32_t rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
  // NaN in: a quiet NaN out (rounding could otherwise carry it into inf).
  return static_cast<uint16_t>((w & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal numbers: shift the exponent and mantissa into place and fix the bias
  // by a multiplication with 2^-112 (exponent_offset moves inf/NaN to inf/NaN).
  const uint32_t exp_offset = 0xE0u << 23;
  const float normalized = f32_from_bits((two_w >> 4) + exp_offset) * 0x1.0p-112f;
  // Subnormals: build 0.5 + mantissa * 2^-24 and subtract the 0.5.
  const uint32_t magic_mask = 126u << 23;
  const float denormalized = f32_from_bits((two_w >> 17) | magic_mask) - 0.5f;
  const uint32_t denormalized_cutoff = 1u << 27;
  const uint32_t result =
      sign | (two_w < denormalized_cutoff ? f32_to_bits(denormalized) : f32_to_bits(normalized));
  return f32_from_bits(result);
}

inline uint16_t f32_to_f16(float f) {
  // Scaling by 2^112 then 2^-110 makes the FPU round the mantissa to 10 bits
  // (and overflow to inf) exactly as fp16 would.
  const float abs_f = f32_from_bits(f32_to_bits(f) & 0x7FFFFFFFu);
  float base = (abs_f * 0x1.0p+112f) * 0x1.0p-110f;
  const uint32_t w = f32_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = f32_from_bits((bias >> 1) + 0x07800000u) + base;
  const uint32_t b = f32_to_bits(base);
  const uint32_t exp_bits = (b >> 13) & 0x00007C00u;
  const uint32_t mantissa_bits = b & 0x00000FFFu;
  const uint32_t nonsign = exp_bits + mantissa_bits;
  return static_cast<uint16_t>((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}

}  // namespace bits
}  // namespace zerokern
