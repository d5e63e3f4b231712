// The wire-format ops' arguments as the torch-free WireEncode / WireDecode (shared by the CPU and
// CUDA bindings). zerokern.kernels.wire_ops validates them in Python, the one place their rules
// live; the checks here only keep a direct call from reading or writing out of bounds.
#pragma once

#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op): 4x the parse time of each file (docs/build.md)

#include <optional>

#include "zerokern/wire.h"

namespace zerokern {

WireEncode wire_encode_args(const at::Tensor& x, const at::Tensor& out, const std::optional<at::Tensor>& error,
                            int64_t bits, int64_t seed, int64_t step, int64_t stream, int64_t base,
                            bool stochastic, const std::optional<at::Tensor>& residual);
WireDecode wire_decode_args(const at::Tensor& buf, int64_t n, int64_t bits, const at::Tensor& out, bool accumulate);

constexpr const char* kWireEncodeSchema =
    "wire_encode_(Tensor x, Tensor(a!) out, Tensor(b!)? error, int bits, int seed, int step, int stream, "
    "int base, bool stochastic=True, Tensor(b)? residual=None) -> ()";
constexpr const char* kWireDecodeSchema =
    "wire_decode_(Tensor buf, int n, int bits, Tensor(a!) out, bool accumulate) -> ()";

}  // namespace zerokern
