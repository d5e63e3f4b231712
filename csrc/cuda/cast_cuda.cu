// CUDA multi-tensor cast-copy (flatten / unflatten): one launch per
// (src dtype, dst dtype) pair and batch of up to kMaxSegments segments; see
// [Note: one launch, many tensors] in multi_tensor.cuh. Each thread moves 16
// bytes of the narrower dtype per tile (so 32 of the wider one, in two
// 16-byte accesses): every access is 128 bits wide.
#include <algorithm>
#include <type_traits>
#include <vector>

#include "multi_tensor.cuh"
#include "zerokern/cast.h"

namespace zerokern {
namespace cuda {
namespace {

constexpr int kMaxSegments = 320;

struct CastBatch {
  const void* src[kMaxSegments];
  void* dst[kMaxSegments];
  int64_t numel[kMaxSegments];
  int64_t first_tile[kMaxSegments + 1];
  bool aligned[kMaxSegments];
  int count;
};

template <typename SrcT, typename DstT>
__host__ __device__ constexpr int vec_width() {
  return 16 / (sizeof(SrcT) < sizeof(DstT) ? sizeof(SrcT) : sizeof(DstT));
}

// Same dtype: move raw bits (no float round trip, so NaN payloads survive).
template <typename SrcT, typename DstT>
__device__ __forceinline__ DstT convert(SrcT x) {
  if constexpr (std::is_same<SrcT, DstT>::value) return x;
  else return from_float<DstT>(to_float(x));
}

template <typename SrcT, typename DstT>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSM) cast_kernel(const __grid_constant__ CastBatch b) {
  constexpr int V = vec_width<SrcT, DstT>();
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * V;
  const int64_t tiles = b.first_tile[b.count];
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int t = find_tensor(b.first_tile, b.count, tile);
    const int64_t n = b.numel[t];
    const int64_t base = (tile - b.first_tile[t]) * kTile;
    const SrcT* __restrict__ src = static_cast<const SrcT*>(b.src[t]);
    DstT* __restrict__ dst = static_cast<DstT*>(b.dst[t]);
    // See [Note: tiles and the fallback] and [Note: vector stores] in multi_tensor.cuh.
    if (full_vector_tile(b.aligned[t], base, kTile, n)) {
      const int64_t i0 = base + static_cast<int64_t>(threadIdx.x) * V;
      const Pack<SrcT, V> in = load_wide<SrcT, V>(src + i0);
      Pack<DstT, V> out;
#pragma unroll
      for (int k = 0; k < V; ++k) out.v[k] = convert<SrcT, DstT>(in.v[k]);
      store_wide<DstT, V>(dst + i0, out);
    } else {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const int64_t i = base + k * kThreads + threadIdx.x;
        if (i >= n) break;
        dst[i] = convert<SrcT, DstT>(src[i]);
      }
    }
  }
}

template <typename SrcT, typename DstT>
cudaError_t launch_batches(const CastList& l, const std::vector<int64_t>& idx, cudaStream_t stream) {
  constexpr int V = vec_width<SrcT, DstT>();
  constexpr int64_t kTile = static_cast<int64_t>(kThreads) * V;
  CastBatch b;
  for (size_t begin = 0; begin < idx.size(); begin += kMaxSegments) {
    const size_t end = std::min(idx.size(), begin + kMaxSegments);
    b.count = static_cast<int>(end - begin);
    b.first_tile[0] = 0;
    for (size_t j = begin; j < end; ++j) {
      const int k = static_cast<int>(j - begin);
      const int64_t i = idx[j];
      b.src[k] = l.src[i];
      b.dst[k] = l.dst[i];
      b.numel[k] = l.numel[i];
      b.first_tile[k + 1] = b.first_tile[k] + (l.numel[i] + kTile - 1) / kTile;
      b.aligned[k] = is_aligned(l.src[i], 16) && is_aligned(l.dst[i], 16);  // 16-byte accesses only
    }
    const int64_t tiles = b.first_tile[b.count];
    cast_kernel<SrcT, DstT><<<blocks_for<cast_kernel<SrcT, DstT>>(tiles), kThreads, 0, stream>>>(b);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename SrcT>
cudaError_t launch_from(DType dst, const CastList& l, const std::vector<int64_t>& idx, cudaStream_t s) {
  switch (dst) {
    case DType::kFloat16: return launch_batches<SrcT, __half>(l, idx, s);
    case DType::kBFloat16: return launch_batches<SrcT, __nv_bfloat16>(l, idx, s);
    default: return launch_batches<SrcT, float>(l, idx, s);
  }
}

}  // namespace
}  // namespace cuda

int cast_copy_cuda(const CastList& l, void* stream_ptr) {
  using namespace cuda;
  const cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  std::vector<int64_t> groups[3][3];
  for (int64_t i = 0; i < l.count; ++i)
    if (l.numel[i] > 0) groups[static_cast<int>(l.src_dtypes[i])][static_cast<int>(l.dst_dtypes[i])].push_back(i);
  for (int s = 0; s < 3; ++s) {
    for (int d = 0; d < 3; ++d) {
      if (groups[s][d].empty()) continue;
      cudaError_t err;
      switch (static_cast<DType>(s)) {
        case DType::kFloat16: err = launch_from<__half>(static_cast<DType>(d), l, groups[s][d], stream); break;
        case DType::kBFloat16: err = launch_from<__nv_bfloat16>(static_cast<DType>(d), l, groups[s][d], stream); break;
        default: err = launch_from<float>(static_cast<DType>(d), l, groups[s][d], stream); break;
      }
      if (err != cudaSuccess) return static_cast<int>(err);
    }
  }
  return 0;
}

}  // namespace zerokern
