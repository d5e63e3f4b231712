// The CPU kernels (adam, cast, philox, lowbit and wire _isa.inc) for the avx512 variant.
#include <algorithm>
#include <cmath>
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
#include "zerokern/lowbit.h"
#include "zerokern/wire.h"

#if defined(__x86_64__) || defined(_M_X64)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi2,prefer-vector-width=512")
#endif
#define ZK_ISA avx512
#if defined(__x86_64__) || defined(_M_X64)
#define ZK_STREAM_BYTES 64  // non-temporal store width (cast_isa.inc)
#else
#define ZK_STREAM_BYTES 0
#endif
#include "dtypes.inc"
#include "adam_isa.inc"
#define ZK_LOWBIT_SIMD 512  // lowbit_isa.inc: explicit gathers
#include "philox_isa.inc"
#include "lowbit_isa.inc"
#include "wire_isa.inc"
#undef ZK_LOWBIT_SIMD
#include "cast_isa.inc"
#undef ZK_STREAM_BYTES
