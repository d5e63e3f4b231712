// Python spellings for error messages ("float16", not "Half"), so a message
// reads the same from the C++ and the Python backends.
#pragma once

#include <c10/core/ScalarType.h>

#include <string>

#include "zerokern/dtype.h"

namespace zerokern {

inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

inline std::string where(const char* list, size_t i) { return std::string(list) + "[" + std::to_string(i) + "]"; }

// float32, float16, bfloat16: the dtypes every kernel reads and writes.
inline bool is_kernel_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

inline DType to_kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

}  // namespace zerokern
