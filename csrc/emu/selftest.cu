// Kernels that check the SIMT emulator itself (tests/kernels/test_simt_emulator.py): each construct of
// simt.h against what the CUDA programming guide says it does, and the errors a GPU would raise.
// Built only into the emulated library (tests/kernels/simt_emu.py), never by nvcc.
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr unsigned kFull = 0xFFFFFFFFu;

__global__ void shuffle_kernel(int mode, int b, int width, int* out) {
  const int v = 1000 + static_cast<int>(threadIdx.x);
  int r = 0;
  switch (mode) {
    case 0: r = __shfl_sync(kFull, v, b, width); break;
    case 1: r = __shfl_up_sync(kFull, v, static_cast<unsigned>(b), width); break;
    case 2: r = __shfl_down_sync(kFull, v, static_cast<unsigned>(b), width); break;
    default: r = __shfl_xor_sync(kFull, v, b, width); break;
  }
  out[threadIdx.x] = r;
}

// out per thread: ballot, any, all (of lane % 3 == 0), then __syncthreads_count/and/or of tid < k.
__global__ void vote_kernel(int k, unsigned* out) {
  const unsigned lane = threadIdx.x & 31u;
  out[4 * threadIdx.x] = __ballot_sync(kFull, lane % 3 == 0);
  out[4 * threadIdx.x + 1] = __any_sync(kFull, lane == 7) + 2 * __all_sync(kFull, lane < 32);
  out[4 * threadIdx.x + 2] = static_cast<unsigned>(__syncthreads_count(static_cast<int>(threadIdx.x) < k));
  out[4 * threadIdx.x + 3] = static_cast<unsigned>(__syncthreads_and(static_cast<int>(threadIdx.x) < k) +
                                                   2 * __syncthreads_or(static_cast<int>(threadIdx.x) < k));
}

// A block sum through shared memory (tree, one barrier a level), then atomics across blocks.
__global__ void reduce_kernel(const float* x, float* block_sums, float* total, int* count, unsigned* maximum) {
  __shared__ float s[256];
  const unsigned t = threadIdx.x, i = blockIdx.x * blockDim.x + t;
  s[t] = x[i];
  __syncthreads();
  for (unsigned h = blockDim.x / 2; h > 0; h >>= 1) {
    if (t < h) s[t] += s[t + h];
    __syncthreads();
  }
  if (t == 0) {
    block_sums[blockIdx.x] = s[0];
    atomicAdd(total, s[0]);
  }
  atomicAdd(count, 1);
  atomicMax(maximum, i);
}

// Each thread writes its linear index and coordinates (3-D grids and blocks).
__global__ void index_kernel(unsigned* out) {
  const unsigned bx = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  const unsigned tx = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned i = bx * (blockDim.x * blockDim.y * blockDim.z) + tx;
  out[4 * i] = i;
  out[4 * i + 1] = threadIdx.x | threadIdx.y << 8 | threadIdx.z << 16;
  out[4 * i + 2] = blockIdx.x | blockIdx.y << 8 | blockIdx.z << 16;
  out[4 * i + 3] = blockDim.x | blockDim.y << 8 | blockDim.z << 16;
}

// What a GPU reports as an error: a barrier some threads left before, a shuffle with a lane that
// returned, a misaligned 16-byte load, a deadlock between a barrier and a shuffle.
__global__ void faulty_kernel(int which, const float* x, float* out) {
  if (which == 0) {
    if (threadIdx.x == 5) return;
    __syncthreads();
  } else if (which == 1) {
    if (threadIdx.x == 3) return;
    out[threadIdx.x] = __shfl_xor_sync(kFull, 1.f, 1);
  } else if (which == 2) {
    const float4 v = *reinterpret_cast<const float4*>(x + 1);
    out[threadIdx.x] = v.x;
  } else {
    if (threadIdx.x < 32) out[threadIdx.x] = __shfl_xor_sync(kFull, 1.f, 1);
    else __syncthreads();
  }
}

}  // namespace

ZK_EMU_API int zk_emu_selftest_shuffle(int mode, int b, int width, int* out) {
  shuffle_kernel<<<1, 64>>>(mode, b, width, out);
  return static_cast<int>(cudaGetLastError());
}

ZK_EMU_API int zk_emu_selftest_vote(int threads, int k, unsigned* out) {
  vote_kernel<<<1, threads>>>(k, out);
  return static_cast<int>(cudaGetLastError());
}

ZK_EMU_API int zk_emu_selftest_reduce(int blocks, const float* x, float* block_sums, float* total, int* count,
                                      unsigned* maximum) {
  reduce_kernel<<<blocks, 256>>>(x, block_sums, total, count, maximum);
  return static_cast<int>(cudaGetLastError());
}

ZK_EMU_API int zk_emu_selftest_index(const unsigned* grid, const unsigned* block, unsigned* out) {
  index_kernel<<<dim3(grid[0], grid[1], grid[2]), dim3(block[0], block[1], block[2])>>>(out);
  return static_cast<int>(cudaGetLastError());
}

ZK_EMU_API int zk_emu_selftest_faulty(int which, int threads, const float* x, float* out) {
  faulty_kernel<<<1, threads>>>(which, x, out);
  return static_cast<int>(cudaGetLastError());
}
