// CPU low-bit Adam: the SIMD variant chosen at run time (dispatch.cpp), the blocks of every
// tensor split over OpenMP threads in contiguous runs. A block's result depends on nothing
// but its own elements and their global indices, so any thread count gives the same bits.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "kernels_cpu.h"
#include "parallel.h"
#include "zerokern/lowbit.h"

namespace zerokern {

void fused_adam_lowbit_cpu(const LowBitTensorList& t, const LowBitCall& call, int num_threads) {
  std::vector<int64_t> start(t.count + 1, 0);  // start[k]: tensor k's first block in the concatenation
  for (int64_t k = 0; k < t.count; ++k) start[k + 1] = start[k] + (t.numel[k] + kBlock - 1) / kBlock;
  const int64_t total = start[t.count];
  if (total == 0) return;
  const int64_t by_size = (total * kBlock + cpu::kMinElementsPerThread - 1) / cpu::kMinElementsPerThread;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, by_size)));
  const cpu::LowBitBlocksFn fn = cpu::variant().lowbit;

#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = total * tid / nth, hi = total * (tid + 1) / nth;
    int64_t k = std::upper_bound(start.begin(), start.end(), lo) - start.begin() - 1;
    for (; k < t.count && start[k] < hi; ++k) {
      const int64_t b = std::max(lo, start[k]) - start[k], e = std::min(hi, start[k + 1]) - start[k];
      if (e > b) fn(t, call, k, b, e);
    }
  }
}

}  // namespace zerokern
