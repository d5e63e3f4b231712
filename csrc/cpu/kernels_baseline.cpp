// The CPU kernels (adam_isa.inc, cast_isa.inc) for the baseline variant.
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels_cpu.h"
#include "zerokern/adam.h"
#include "zerokern/cast.h"
#include "zerokern/half_bits.h"

// No target pragma: the compiler baseline (SSE2 on x86-64), safe on every machine.
#define ZK_ISA baseline
#include "dtypes.inc"
#include "adam_isa.inc"
#include "cast_isa.inc"
