// zerokern wire format: the torch-free interface of the quantized-collective kernels (the numbers
// are defined by zerokern/kernels/wire.py, [Note: the wire format]; tests compare every kernel
// against it).
//
// A chunk of n values is cut into blocks of kWireBlock elements; per block:
//   scale   absmax / qmax (qmax 127 for int8, 7 for int4) in fp32; NaN if the block holds an inf
//           or a NaN (then every code is 0)
//   code    floor(v + r / 65536) clamped to [-qmax, qmax], v = x * (1 / scale), or x / scale where
//           1 / scale is inf; r: the 16 random bits of the element's global index (lowbit.h's
//           random16, stream kStreamWire + the caller's) when stochastic, else 2^15 (round to
//           nearest, floor(v + 0.5)); 0 in a block whose scale is 0 or NaN
//   bytes   all the chunk's scales (fp32, 4 bytes each, not necessarily 4-aligned), then its codes:
//           int8 one byte each; int4 code + 8, two to a byte, the even element in the low nibble
//   error   (optional) x - code * scale, 0 in a block whose scale is NaN, stored as fp32 or bf16
// x may come with a residual (fp32 or bf16, n): the chunk encoded is then x + residual, summed in
// fp32 ([Note: error feedback] adds last round's loss in the same pass as the encode, not in a copy
// of the bucket). error may be the residual itself: each block reads it before it writes it.
// Decoding: code * scale, written or added to fp32 out. A NaN scale decodes to NaN; its payload is
// the hardware's (x86 keeps the scale's 0x7FC00000, a GPU writes 0x7FFFFFFF), no part of the format.
#pragma once

#include <cstdint>

#include "zerokern/dtype.h"
#include "zerokern/lowbit.h"

namespace zerokern {

// wire.py's BLOCK: 64, not the low-bit state's 256 (kBlock): int4 grads (stochastic rounding) in blocks
// of 256 lost 0.7-1% of a GPT's eval loss, in blocks of 64 0.3-0.6% (bench/lowbit_loss.py, 2026-12-03)
constexpr int64_t kWireBlock = 64;
constexpr uint32_t kStreamWire = 8;  // wire.py's STREAM_WIRE: counter word 3 is this + the caller's stream

struct WireEncode {
  const void* x = nullptr;  // n values of `dtype`
  DType dtype = DType::kFloat32;
  int64_t n = 0;
  uint8_t* out = nullptr;  // wire_bytes(n, bits)
  void* error = nullptr;  // n values of error_dtype (fp32 or bf16), or null: not wanted
  DType error_dtype = DType::kFloat32;
  const void* residual = nullptr;  // n values of residual_dtype (fp32 or bf16) added to x, or null
  DType residual_dtype = DType::kFloat32;
  int bits = 8;
  uint64_t seed = 0;
  uint32_t step = 0;
  uint32_t stream = kStreamWire;  // the Philox counter's word 3 (kStreamWire + the caller's stream)
  int64_t base = 0;               // global index of x[0]
  bool stochastic = true;         // stochastic rounding (seed, step, stream); false: to nearest
};

constexpr uint16_t kWireNearest = 0x8000;  // the r of round to nearest: u = 2^15 / 2^16 = 0.5

struct WireDecode {
  const uint8_t* buf = nullptr;  // wire_bytes(n, bits)
  int64_t n = 0;
  int bits = 8;
  float* out = nullptr;  // n fp32
  bool accumulate = false;  // out += decoded, else out = decoded
};

ZK_HOST_DEVICE int64_t wire_blocks(int64_t n) { return (n + kWireBlock - 1) / kWireBlock; }
ZK_HOST_DEVICE int64_t wire_code_bytes(int64_t n, int bits) { return bits == 8 ? n : (n + 1) / 2; }
ZK_HOST_DEVICE int64_t wire_bytes(int64_t n, int bits) { return 4 * wire_blocks(n) + wire_code_bytes(n, bits); }
ZK_HOST_DEVICE float wire_qmax(int bits) { return bits == 8 ? 127.f : 7.f; }

// floor(t) for |t| < 2^31, by truncation (SSE2 has no vector floor; this loop vectorizes everywhere)
ZK_HOST_DEVICE int32_t wire_floor(float t) {
  const int32_t i = static_cast<int32_t>(t);
  return i - (static_cast<float>(i) > t ? 1 : 0);
}

// CPU: SIMD variant chosen at run time, OpenMP over blocks (any thread count gives the same bytes).
void wire_encode_cpu(const WireEncode& a, int num_threads);
void wire_decode_cpu(const WireDecode& a, int num_threads);

#if defined(ZEROKERN_WITH_CUDA)
// CUDA: one launch on `stream` (a cudaStream_t); the launch error, or 0.
int wire_encode_cuda(const WireEncode& a, void* stream);
int wire_decode_cuda(const WireDecode& a, void* stream);
#endif

}  // namespace zerokern
