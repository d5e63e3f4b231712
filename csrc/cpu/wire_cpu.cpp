// CPU wire-format kernels: the SIMD variant chosen at run time (dispatch.cpp), a chunk's blocks
// split over OpenMP threads in contiguous runs. A block's bytes depend on nothing but its own
// elements and their global indices, so any thread count gives the same bytes.
#include <omp.h>

#include <algorithm>

#include "kernels_cpu.h"
#include "parallel.h"
#include "zerokern/wire.h"

namespace zerokern {
namespace {

template <class Fn>
void over_blocks(int64_t n, int num_threads, const Fn& fn) {
  const int64_t total = wire_blocks(n);
  if (total == 0) return;
  const int64_t by_size = (n + cpu::kMinElementsPerThread - 1) / cpu::kMinElementsPerThread;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(num_threads, by_size)));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = total * tid / nth, hi = total * (tid + 1) / nth;
    if (hi > lo) fn(lo, hi);
  }
}

}  // namespace

void wire_encode_cpu(const WireEncode& a, int num_threads) {
  const cpu::WireEncodeFn fn = cpu::variant().wire_encode;
  over_blocks(a.n, num_threads, [&](int64_t lo, int64_t hi) { fn(a, lo, hi); });
}

void wire_decode_cpu(const WireDecode& a, int num_threads) {
  const cpu::WireDecodeFn fn = cpu::variant().wire_decode;
  over_blocks(a.n, num_threads, [&](int64_t lo, int64_t hi) { fn(a, lo, hi); });
}

}  // namespace zerokern
