// Which SIMD variant of the CPU kernels runs: chosen once, at first use, from
// the CPU's features (a build without -march flags runs on any x86-64).
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "kernels_cpu.h"
#include "zerokern/adam.h"

namespace zerokern {
namespace cpu {
namespace {

bool cpu_has(const char* feature) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (!std::strcmp(feature, "avx512"))
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("bmi2");
  if (!std::strcmp(feature, "avx2"))
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c") && __builtin_cpu_supports("bmi2");
#endif
  return !std::strcmp(feature, "baseline");
}

// The widest variant this CPU runs, or the one ZEROKERN_CPU_CAPABILITY names
// (for tests and for comparing variants; asking for one the CPU lacks is an error).
Variant choose_variant() {
  static const Variant variants[] = {
      {"avx512", avx512::adam_span, avx512::roof_span, avx512::cast_span, avx512::lowbit_blocks,
       avx512::wire_encode_blocks, avx512::wire_decode_blocks},
      {"avx2", avx2::adam_span, avx2::roof_span, avx2::cast_span, avx2::lowbit_blocks,
       avx2::wire_encode_blocks, avx2::wire_decode_blocks},
      {"baseline", baseline::adam_span, baseline::roof_span, baseline::cast_span, baseline::lowbit_blocks,
       baseline::wire_encode_blocks, baseline::wire_decode_blocks},
  };
  const char* wanted = std::getenv("ZEROKERN_CPU_CAPABILITY");
  if (wanted && *wanted) {
    for (const Variant& v : variants) {
      if (!std::strcmp(v.name, wanted)) {
        if (!cpu_has(v.name))
          throw std::runtime_error(std::string("ZEROKERN_CPU_CAPABILITY=") + wanted +
                                   " but this CPU lacks the instructions it needs");
        return v;
      }
    }
    throw std::runtime_error(std::string("ZEROKERN_CPU_CAPABILITY=") + wanted +
                             " is not one of avx512, avx2, baseline");
  }
  for (const Variant& v : variants)
    if (cpu_has(v.name)) return v;
  return variants[2];
}

}  // namespace

const Variant& variant() {
  static const Variant chosen = choose_variant();
  return chosen;
}

}  // namespace cpu

const char* cpu_capability() { return cpu::variant().name; }

}  // namespace zerokern
