// The Adam loop for the baseline variant; see adam_isa.inc.
#include <cstdint>
#include <type_traits>

#include "adam_cpu.h"
#include "zerokern/adam.h"
#include "zerokern/half_bits.h"

// No target pragma: the compiler baseline (SSE2 on x86-64), safe on every machine.
#define ZK_ISA baseline
#include "adam_isa.inc"
