// The Adam loop for the avx2 variant; see adam_isa.inc.
#include <cstdint>
#include <type_traits>

#include "adam_cpu.h"
#include "zerokern/adam.h"
#include "zerokern/half_bits.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c,bmi2")
#endif
#define ZK_ISA avx2
#include "adam_isa.inc"
