// zerokern multi-tensor cast-copy: the kernel behind flatten / unflatten.
//
// Copies `count` contiguous segments, segment i from src[i] (src_dtypes[i]) to
// dst[i] (dst_dtypes[i]), numel[i] elements each, converting fp32/fp16/bf16 in
// the same pass (round to nearest even, as torch's .to()). Segments must not
// overlap each other. Torch-free; the binding (csrc/torch/flat_ops*.cpp)
// validates and computes the pointers.
#pragma once

#include <cstdint>

#include "zerokern/dtype.h"

namespace zerokern {

struct CastList {
  int64_t count = 0;
  const void* const* src = nullptr;
  void* const* dst = nullptr;
  const int64_t* numel = nullptr;
  const DType* src_dtypes = nullptr;
  const DType* dst_dtypes = nullptr;
  // Write large destinations with non-temporal stores (csrc/cpu/cast_isa.inc):
  // a win for existing buffers the caller will not read soon, a loss for
  // freshly allocated ones (the OS just zeroed those pages into the cache).
  bool stream = false;
};

// CPU: SIMD chosen at run time, elements split across num_threads OpenMP threads.
void cast_copy_cpu(const CastList& list, int num_threads);

#if defined(ZEROKERN_WITH_CUDA)
// CUDA: one launch per (src dtype, dst dtype) pair and batch of segments.
// Returns the first launch error, or 0 (cudaSuccess).
int cast_copy_cuda(const CastList& list, void* stream);
#endif

}  // namespace zerokern
