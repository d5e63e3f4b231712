// The CPU kernels (adam_isa.inc, cast_isa.inc) for the avx2 variant.
#include <cstdint>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif
#include <cstring>
#include <type_traits>

#include "kernels_cpu.h"
#include "zerokern/adam.h"
#include "zerokern/cast.h"
#include "zerokern/half_bits.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx2,fma,f16c,bmi2")
#endif
#define ZK_ISA avx2
#if defined(__x86_64__) || defined(_M_X64)
#define ZK_STREAM_BYTES 32  // non-temporal store width (cast_isa.inc)
#else
#define ZK_STREAM_BYTES 0
#endif
#include "dtypes.inc"
#include "adam_isa.inc"
#include "cast_isa.inc"
#undef ZK_STREAM_BYTES
