// Splitting a list of tensors across OpenMP threads by elements, not by
// tensors: thread k takes the k-th equal slice of the concatenation of all
// tensors, so 200 small tensors balance as well as one big one.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace zerokern {
namespace cpu {

// Below this many elements per thread, starting a thread costs more than it saves.
constexpr int64_t kMinElementsPerThread = 1 << 15;
// Thread boundaries fall on multiples of 16 elements (a 64-byte cache line of fp32).
constexpr int64_t kBoundary = 16;

// Calls fn(k, begin, end) for the part [begin, end) of tensor k that each
// thread owns; every element of every tensor is covered exactly once.
template <class Fn>
void parallel_slices(const int64_t* numel, int64_t count, int num_threads, const Fn& fn) {
  std::vector<int64_t> start(count + 1, 0);  // start[i]: tensor i's first element in the concatenation
  for (int64_t i = 0; i < count; ++i) start[i + 1] = start[i] + numel[i];
  const int64_t total = start[count];
  if (total == 0) return;
  const int64_t by_size = (total + kMinElementsPerThread - 1) / kMinElementsPerThread;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, by_size)));

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = total * tid / nth / kBoundary * kBoundary;
    const int64_t hi = tid + 1 == nth ? total : total * (tid + 1) / nth / kBoundary * kBoundary;
    int64_t k = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; k < count && start[k] < hi; ++k) {
      const int64_t b = std::max(lo, start[k]) - start[k];
      const int64_t e = std::min(hi, start[k + 1]) - start[k];
      if (e > b) fn(k, b, e);
    }
  }
}

}  // namespace cpu
}  // namespace zerokern
