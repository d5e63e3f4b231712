// The CPU kernels (adam, cast, philox, lowbit and wire _isa.inc) for the baseline variant.
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

// No target pragma: the compiler baseline (SSE2 on x86-64), safe on every machine.
#define ZK_ISA baseline
#if defined(__x86_64__) || defined(_M_X64)
#define ZK_STREAM_BYTES 16  // non-temporal store width (cast_isa.inc)
#else
#define ZK_STREAM_BYTES 0
#endif
#include "dtypes.inc"
#include "adam_isa.inc"
#define ZK_LOWBIT_SIMD 0  // lowbit_isa.inc: explicit gathers
#include "philox_isa.inc"
#include "lowbit_isa.inc"
#include "wire_isa.inc"
#undef ZK_LOWBIT_SIMD
#include "cast_isa.inc"
#undef ZK_STREAM_BYTES
