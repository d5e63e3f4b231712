// CUDA low-bit Adam (lowbit.h has the numbers): one thread block of kBlock threads per quantization
// block, one element a thread, one launch per tensor. The block's absmax is a warp-shuffle and
// shared-memory reduction; the quantizer's tables are read through the read-only cache; the random
// bits are the header's random16 (Philox4x32-10), so every element draws the reference's numbers.
//
// Not yet: vector loads, a multi-tensor launch (multi_tensor.cuh's), device-side lr/step/found_inf
// (the binding reads them on the host). First run on an H200 on 2026-12-04 (block_absmax's fix below).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "multi_tensor.cuh"
#include "zerokern/adam.h"
#include "zerokern/lowbit.h"

namespace zerokern {
namespace cuda {
namespace {

static_assert(kBlock == 256, "one thread per element of a block");

// The block's absmax, to every thread: the largest |x| bit pattern, as the CPU kernel's (integer
// order is float order for non-NaN floats, and a NaN comes out NaN, as the reference's amax; fmaxf
// would drop it).
__device__ __forceinline__ float block_absmax(float x, uint32_t* shared) {
  uint32_t a = __float_as_uint(x) & 0x7FFFFFFFu;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (lane == 0) shared[warp] = a;
  __syncthreads();
  // Every group of 8 lanes reduces the 8 warps' maxima, so every thread gets the block's absmax: a
  // reduction of lanes 0-7 alone left lanes 8-31 of each warp with 0, and their codes with the zero
  // block's (found on the first GPU run, and by the SIMT emulator's tests).
  a = shared[lane & ((kBlock >> 5) - 1)];
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) a = max(a, __shfl_xor_sync(0xFFFFFFFFu, a, o));
  __syncthreads();  // shared is reused by the next reduction
  return __uint_as_float(a);
}

__device__ __forceinline__ float decode(const void* state, const float* scales, int64_t i, int64_t blk,
                                        StateFormat f, const QuantTables& q) {
  if (f == StateFormat::kInt8) return __ldg(q.map + static_cast<const uint8_t*>(state)[i]) * scales[blk];
  if (f == StateFormat::kBFloat16) return __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(state)[i]) << 16);
  return static_cast<const float*>(state)[i];
}

// Writes x (every thread of the block calls it: the int8 path reduces over the block).
__device__ __forceinline__ void encode(void* state, float* scales, int64_t i, int64_t blk, bool active, float x,
                                       StateFormat f, const QuantTables& q, const LowBitCall& call, uint32_t stream,
                                       int64_t index, uint32_t* shared) {
  if (f == StateFormat::kInt8) {
    const float absmax = block_absmax(active ? x : 0.f, shared);
    if (!active) return;
    uint32_t code;
    if (absmax > 0.f) {
      const float y = x * __frcp_rn(absmax);
      code = quantize_code(y, __float_as_uint(y), q);
    } else {
      code = quantize_code(0.f, 0u, q);
    }
    static_cast<uint8_t*>(state)[i] = static_cast<uint8_t>(code);
    if (threadIdx.x == 0) scales[blk] = absmax;
  } else if (!active) {
    return;
  } else if (f == StateFormat::kBFloat16) {
    static_cast<uint16_t*>(state)[i] =
        stochastic_round_bf16_bits(__float_as_uint(x), random16(call.seed, call.step, stream, index));
  } else {
    static_cast<float*>(state)[i] = x;
  }
}

template <typename G>
__global__ void __launch_bounds__(kBlock) lowbit_kernel(void* param, const G* grad, void* exp_avg, void* exp_avg_sq,
                                                        float* exp_avg_scales, float* exp_avg_sq_scales, void* model,
                                                        int64_t numel, int64_t base, bool param_bf16, DType model_dtype,
                                                        StateFormat state, LowBitCall call) {
  __shared__ uint32_t shared[kBlock >> 5];
  const int64_t blk = blockIdx.x, i = blk * kBlock + threadIdx.x;
  const bool active = i < numel;
  float p = 0.f, g = 0.f, m = 0.f, v = 0.f;
  if (active) {
    p = param_bf16 ? __uint_as_float(static_cast<uint32_t>(static_cast<const uint16_t*>(param)[i]) << 16)
                   : static_cast<const float*>(param)[i];
    g = to_float(grad[i]);
    m = decode(exp_avg, exp_avg_scales, i, blk, state, call.maps.sgn);
    v = decode(exp_avg_sq, exp_avg_sq_scales, i, blk, state, call.maps.uns);
    if (state == StateFormat::kInt8) v = v * v;  // int8 exp_avg_sq holds its square root
    adam_element(p, m, v, g, call.coeffs);
  }
  encode(exp_avg, exp_avg_scales, i, blk, active, m, state, call.maps.sgn, call, kStreamExpAvg, base + i, shared);
  encode(exp_avg_sq, exp_avg_sq_scales, i, blk, active, state == StateFormat::kInt8 ? __fsqrt_rn(v) : v, state,
         call.maps.uns, call, kStreamExpAvgSq, base + i, shared);
  if (!active) return;
  if (param_bf16) {
    static_cast<uint16_t*>(param)[i] =
        stochastic_round_bf16_bits(__float_as_uint(p), random16(call.seed, call.step, kStreamParam, base + i));
    return;
  }
  static_cast<float*>(param)[i] = p;
  if (model_dtype == DType::kBFloat16) static_cast<__nv_bfloat16*>(model)[i] = __float2bfloat16_rn(p);
  if (model_dtype == DType::kFloat16) static_cast<__half*>(model)[i] = __float2half_rn(p);
}

}  // namespace
}  // namespace cuda

int fused_adam_lowbit_cuda(const LowBitTensorList& t, const LowBitCall& call, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  for (int64_t k = 0; k < t.count; ++k) {
    const int64_t n = t.numel[k];
    if (n == 0) continue;
    const int64_t blocks = (n + kBlock - 1) / kBlock;
    float* ms = t.exp_avg_scales ? t.exp_avg_scales[k] : nullptr;
    float* vs = t.exp_avg_sq_scales ? t.exp_avg_sq_scales[k] : nullptr;
    void* model = t.model_params ? t.model_params[k] : nullptr;
    const DType md = t.model_params ? t.model_dtype : DType::kNone;
    switch (t.grad_dtypes[k]) {
      case DType::kFloat16:
        cuda::lowbit_kernel<__half><<<blocks, kBlock, 0, s>>>(t.params[k], static_cast<const __half*>(t.grads[k]),
                                                              t.exp_avgs[k], t.exp_avg_sqs[k], ms, vs, model, n,
                                                              t.index_base[k], t.param_bf16, md, t.state, call);
        break;
      case DType::kBFloat16:
        cuda::lowbit_kernel<__nv_bfloat16><<<blocks, kBlock, 0, s>>>(
            t.params[k], static_cast<const __nv_bfloat16*>(t.grads[k]), t.exp_avgs[k], t.exp_avg_sqs[k], ms, vs,
            model, n, t.index_base[k], t.param_bf16, md, t.state, call);
        break;
      default:
        cuda::lowbit_kernel<float><<<blocks, kBlock, 0, s>>>(t.params[k], static_cast<const float*>(t.grads[k]),
                                                             t.exp_avgs[k], t.exp_avg_sqs[k], ms, vs, model, n,
                                                             t.index_base[k], t.param_bf16, md, t.state, call);
        break;
    }
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return static_cast<int>(err);
  }
  return 0;
}

}  // namespace zerokern
