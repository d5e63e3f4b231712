// CUDA wire-format kernels (wire.h has the numbers): one thread block of kWireBlock / 2 threads per
// block of the chunk, each thread an (even, odd) pair of elements, which int4 packs into one byte.
// The block's absmax is a max over |x|'s bit patterns (warp shuffles, then shared memory), so a
// NaN is found as fmaxf would not; the random bits are lowbit.h's Philox4x32-10, one call per
// thread (a pair shares its group of 8 unless it straddles two).
//
// Every product and sum is an explicit __fmul_rn / __fadd_rn / __fsub_rn / __fdiv_rn: nvcc would
// otherwise contract x * inv + u and x - code * scale into FMAs, one rounding where the reference
// has two. The scales are written and read a byte at a time (a chunk need not start 4-aligned).
// Compiled here; no GPU has run it yet.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "multi_tensor.cuh"
#include "zerokern/wire.h"

namespace zerokern {
namespace cuda {
namespace {

constexpr int kPairs = kWireBlock / 2;  // threads per block
static_assert(kPairs % 32 == 0, "whole warps");

__device__ __forceinline__ uint32_t block_max(uint32_t a, uint32_t* shared) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) shared[warp] = a;
  __syncthreads();
  a = 0;
#pragma unroll
  for (int w = 0; w < kPairs / 32; ++w) a = max(a, shared[w]);
  return a;
}

// The 16 random bits of global elements e and e + 1 (one Philox call unless they straddle groups).
__device__ __forceinline__ void random_pair(const WireEncode& a, int64_t e, uint32_t* r0, uint32_t* r1) {
  const uint64_t g0 = static_cast<uint64_t>(e) >> 3, g1 = static_cast<uint64_t>(e + 1) >> 3;
  uint32_t c[4] = {static_cast<uint32_t>(g0), static_cast<uint32_t>(g0 >> 32), a.step, a.stream};
  philox4x32_10(c, static_cast<uint32_t>(a.seed), static_cast<uint32_t>(a.seed >> 32));
  *r0 = (c[(e >> 1) & 3] >> (16 * (e & 1))) & 0xFFFFu;
  if (g1 == g0) {
    *r1 = (c[((e + 1) >> 1) & 3] >> (16 * ((e + 1) & 1))) & 0xFFFFu;
  } else {
    *r1 = random16(a.seed, a.step, a.stream, e + 1);
  }
}

// The residual and the error: fp32 or bf16 (bf16 rounded to nearest even, as the reference's cast).
__device__ __forceinline__ float side_load(const void* p, DType d, int64_t i) {
  return d == DType::kBFloat16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i])
                               : static_cast<const float*>(p)[i];
}

__device__ __forceinline__ void side_store(void* p, DType d, int64_t i, float v) {
  if (d == DType::kBFloat16) {
    static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(v);
  } else {
    static_cast<float*>(p)[i] = v;
  }
}

__device__ __forceinline__ int32_t round_code(float x, float scale, float inv, bool divide, uint32_t r, float q) {
  const float v = divide ? __fdiv_rn(x, scale) : __fmul_rn(x, inv);
  const float t = floorf(__fadd_rn(v, __fmul_rn(static_cast<float>(r), 1.f / 65536.f)));
  return static_cast<int32_t>(fminf(fmaxf(t, -q), q));
}

template <typename T>
__global__ void __launch_bounds__(kPairs) wire_encode_kernel(const T* __restrict__ x, WireEncode a) {
  __shared__ uint32_t shared[kPairs / 32];
  const int64_t blk = blockIdx.x, i = blk * kWireBlock + 2 * threadIdx.x;
  const bool has0 = i < a.n, has1 = i + 1 < a.n;
  float x0 = has0 ? to_float(x[i]) : 0.f, x1 = has1 ? to_float(x[i + 1]) : 0.f;
  if (a.residual) {  // x + residual, one fp32 add (the residual is read before the error overwrites it)
    x0 = __fadd_rn(x0, has0 ? side_load(a.residual, a.residual_dtype, i) : 0.f);
    x1 = __fadd_rn(x1, has1 ? side_load(a.residual, a.residual_dtype, i + 1) : 0.f);
  }
  const uint32_t top = block_max(max(__float_as_uint(x0) & 0x7FFFFFFFu, __float_as_uint(x1) & 0x7FFFFFFFu), shared);
  const bool finite = top < 0x7F800000u;
  const float q = wire_qmax(a.bits);
  const float scale = finite ? __fdiv_rn(__uint_as_float(top), q) : __uint_as_float(0x7FC00000u);
  if (threadIdx.x < 4) a.out[4 * blk + threadIdx.x] = static_cast<uint8_t>(__float_as_uint(scale) >> (8 * threadIdx.x));
  int32_t c0 = 0, c1 = 0;
  if (finite && scale > 0.f) {  // not top != 0: a subnormal absmax under qmax x 2^-149 gives scale 0
    const float inv = __fdiv_rn(1.f, scale);
    const bool divide = isinf(inv);  // scale < 2^-128 ([Note: the wire format])
    uint32_t r0 = kWireNearest, r1 = kWireNearest;
    if (a.stochastic) random_pair(a, a.base + i, &r0, &r1);
    c0 = round_code(x0, scale, inv, divide, r0, q);
    c1 = round_code(x1, scale, inv, divide, r1, q);
  }
  uint8_t* codes = a.out + 4 * wire_blocks(a.n);
  if (a.bits == 8) {
    if (has0) codes[i] = static_cast<uint8_t>(c0);
    if (has1) codes[i + 1] = static_cast<uint8_t>(c1);
  } else if (has0) {
    codes[i / 2] = static_cast<uint8_t>((c0 + 8) | (has1 ? (c1 + 8) << 4 : 0));
  }
  if (a.error) {
    const float e0 = finite ? __fsub_rn(x0, __fmul_rn(static_cast<float>(c0), scale)) : 0.f;
    const float e1 = finite ? __fsub_rn(x1, __fmul_rn(static_cast<float>(c1), scale)) : 0.f;
    if (has0) side_store(a.error, a.error_dtype, i, e0);
    if (has1) side_store(a.error, a.error_dtype, i + 1, e1);
  }
}

__global__ void __launch_bounds__(kPairs) wire_decode_kernel(WireDecode a) {
  const int64_t blk = blockIdx.x, i = blk * kWireBlock + 2 * threadIdx.x;
  if (i >= a.n) return;
  const bool has1 = i + 1 < a.n;
  const uint8_t* s = a.buf + 4 * blk;
  const float scale = __uint_as_float(static_cast<uint32_t>(s[0]) | static_cast<uint32_t>(s[1]) << 8 |
                                      static_cast<uint32_t>(s[2]) << 16 | static_cast<uint32_t>(s[3]) << 24);
  const uint8_t* codes = a.buf + 4 * wire_blocks(a.n);
  int32_t c0, c1 = 0;
  if (a.bits == 8) {
    c0 = static_cast<int8_t>(codes[i]);
    if (has1) c1 = static_cast<int8_t>(codes[i + 1]);
  } else {
    const uint32_t b = codes[i / 2];
    c0 = static_cast<int32_t>(b & 0xF) - 8;
    c1 = static_cast<int32_t>(b >> 4) - 8;
  }
  const float y0 = __fmul_rn(static_cast<float>(c0), scale), y1 = __fmul_rn(static_cast<float>(c1), scale);
  a.out[i] = a.accumulate ? __fadd_rn(a.out[i], y0) : y0;
  if (has1) a.out[i + 1] = a.accumulate ? __fadd_rn(a.out[i + 1], y1) : y1;
}

}  // namespace
}  // namespace cuda

int wire_encode_cuda(const WireEncode& a, void* stream) {
  if (a.n == 0) return 0;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const unsigned blocks = static_cast<unsigned>(wire_blocks(a.n));
  switch (a.dtype) {
    case DType::kFloat16:
      cuda::wire_encode_kernel<__half><<<blocks, cuda::kPairs, 0, s>>>(static_cast<const __half*>(a.x), a);
      break;
    case DType::kBFloat16:
      cuda::wire_encode_kernel<__nv_bfloat16>
          <<<blocks, cuda::kPairs, 0, s>>>(static_cast<const __nv_bfloat16*>(a.x), a);
      break;
    default:
      cuda::wire_encode_kernel<float><<<blocks, cuda::kPairs, 0, s>>>(static_cast<const float*>(a.x), a);
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

int wire_decode_cuda(const WireDecode& a, void* stream) {
  if (a.n == 0) return 0;
  cuda::wire_decode_kernel<<<static_cast<unsigned>(wire_blocks(a.n)), cuda::kPairs, 0,
                             static_cast<cudaStream_t>(stream)>>>(a);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace zerokern
