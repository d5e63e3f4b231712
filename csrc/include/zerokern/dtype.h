// Element types the zerokern kernels read and write (torch-free).
#pragma once

#include <cstddef>
#include <cstdint>

namespace zerokern {

enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kNone = 3 };

inline size_t element_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

}  // namespace zerokern
