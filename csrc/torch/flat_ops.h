// flatten / unflatten / unflatten_into_: validation, allocation and the split
// between the multi-tensor cast kernel (contiguous tensors, one launch) and
// torch's strided copy (non-contiguous ones, one pass each). Device-agnostic:
// the CPU and CUDA bindings pass in their kernel launcher.
#pragma once

#include <ATen/core/Tensor.h>  // not ATen/ATen.h (every op): 4x the parse time of each file (docs/build.md)

#include <optional>
#include <vector>

#include "zerokern/cast.h"

namespace zerokern {

inline constexpr const char* kFlattenSchema =
    "flatten(Tensor[] tensors, ScalarType dtype, int[]? offsets=None, int? numel=None) -> Tensor";
inline constexpr const char* kFlattenIntoSchema =
    "flatten_into_(Tensor[] tensors, Tensor(a!) out, int[]? offsets=None) -> ()";
inline constexpr const char* kUnflattenSchema =
    "unflatten(Tensor flat, Tensor[] like, int[]? offsets=None) -> Tensor[]";
inline constexpr const char* kUnflattenIntoSchema =
    "unflatten_into_(Tensor flat, Tensor(a!)[] targets, int[]? offsets=None) -> ()";

// Runs the cast kernel on `list`, on the device of `device_of`.
using CastLauncher = void (*)(const CastList& list, const at::Tensor& device_of);

at::Tensor flatten_impl(at::TensorList tensors, at::ScalarType dtype, at::OptionalIntArrayRef offsets,
                        std::optional<int64_t> numel, CastLauncher launch);
// Into an existing buffer: no allocation (a fresh buffer's first touch, page
// faults and zeroing by the OS, costs more than the copy on CPUs). Gaps are left as they are.
void flatten_into_impl(at::TensorList tensors, const at::Tensor& out, at::OptionalIntArrayRef offsets,
                       CastLauncher launch);
std::vector<at::Tensor> unflatten_impl(const at::Tensor& flat, at::TensorList like, at::OptionalIntArrayRef offsets,
                                       CastLauncher launch);
void unflatten_into_impl(const at::Tensor& flat, at::TensorList targets, at::OptionalIntArrayRef offsets,
                         CastLauncher launch);

// The four ops for one device, bound to its launcher (the registrations in
// ops_cpu.cpp and ops_cuda.cpp take these).
template <CastLauncher Launch>
struct FlatOps {
  static at::Tensor flatten(at::TensorList tensors, at::ScalarType dtype, at::OptionalIntArrayRef offsets,
                            std::optional<int64_t> numel) {
    return flatten_impl(tensors, dtype, offsets, numel, Launch);
  }
  static void flatten_into(at::TensorList tensors, const at::Tensor& out, at::OptionalIntArrayRef offsets) {
    flatten_into_impl(tensors, out, offsets, Launch);
  }
  static std::vector<at::Tensor> unflatten(const at::Tensor& flat, at::TensorList like,
                                           at::OptionalIntArrayRef offsets) {
    return unflatten_impl(flat, like, offsets, Launch);
  }
  static void unflatten_into(const at::Tensor& flat, at::TensorList targets, at::OptionalIntArrayRef offsets) {
    unflatten_into_impl(flat, targets, offsets, Launch);
  }
};

}  // namespace zerokern
