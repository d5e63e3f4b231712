// CPU multi-tensor cast-copy (flatten / unflatten): SIMD variant chosen at run
// time, elements split across OpenMP threads.
#include "kernels_cpu.h"
#include "parallel.h"
#include "zerokern/cast.h"

namespace zerokern {

void cast_copy_cpu(const CastList& l, int num_threads) {
  const cpu::CastSpanFn fn = cpu::variant().cast;
  cpu::parallel_slices(l.numel, l.count, num_threads, [&](int64_t k, int64_t b, int64_t e) {
    fn(static_cast<const char*>(l.src[k]) + b * element_size(l.src_dtypes[k]), l.src_dtypes[k],
       static_cast<char*>(l.dst[k]) + b * element_size(l.dst_dtypes[k]), l.dst_dtypes[k], e - b, l.stream);
  });
}

}  // namespace zerokern
