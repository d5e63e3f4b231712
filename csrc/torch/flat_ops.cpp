#include "flat_ops.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "names.h"

namespace zerokern {
namespace {

// Where each tensor lives in the flat buffer, checked: given offsets must be
// increasing without overlap; none given means packed back to back.
std::vector<int64_t> resolve_offsets(at::TensorList tensors, const char* list, at::OptionalIntArrayRef offsets) {
  const size_t n = tensors.size();
  std::vector<int64_t> out(n);
  if (!offsets.has_value()) {
    int64_t next = 0;
    for (size_t i = 0; i < n; ++i) {
      out[i] = next;
      next += tensors[i].numel();
    }
    return out;
  }
  const at::IntArrayRef off = *offsets;
  TORCH_CHECK_VALUE(off.size() == n, "offsets has ", off.size(), " entries, ", list, " has ", n);
  int64_t end = 0;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK_VALUE(off[i] >= end, "offsets[", i, "] = ", off[i],
                      i == 0 ? std::string(" is negative")
                             : " overlaps " + where(list, i - 1) + " (offsets[" + std::to_string(i - 1) +
                                   "] = " + std::to_string(off[i - 1]) + ", " +
                                   std::to_string(tensors[i - 1].numel()) + " elements); offsets must increase");
    out[i] = off[i];
    end = off[i] + tensors[i].numel();
  }
  return out;
}

// [Note: huge pages for new buffers] A new CPU buffer's first touch costs a
// page fault per 4 KB, which for a 500 MB flatten output took longer than the
// copy itself. Asking for transparent huge pages on a buffer we just allocated
// and are about to overwrite makes that one fault per 2 MB (GPT-2 small's 124M
// bf16 params flattened to fp32 on 2 cores: 108 -> 50 ms). torch does the same
// for all its allocations when THP_MEM_ALLOC_ENABLE=1; we do it for our own
// outputs only. Advice only: without THP (or off Linux) nothing changes.
constexpr uintptr_t kHugePage = uintptr_t{2} << 20;

at::Tensor with_huge_pages(at::Tensor t) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (t.device().is_cpu() && t.nbytes() >= 2 * kHugePage) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t lo = (begin + kHugePage - 1) & ~(kHugePage - 1);
    const uintptr_t hi = (begin + t.nbytes()) & ~(kHugePage - 1);
    if (hi > lo) madvise(reinterpret_cast<void*>(lo), hi - lo, MADV_HUGEPAGE);  // failure: no harm
  }
#endif
  return t;
}

int64_t end_of(at::TensorList tensors, const std::vector<int64_t>& offsets) {
  return tensors.empty() ? 0 : offsets.back() + tensors.back().numel();
}

void check_list(at::TensorList tensors, const char* list, const at::Tensor& ref, const char* ref_name) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK_TYPE(t.defined(), where(list, i), " is None");
    TORCH_CHECK_TYPE(is_kernel_float(t.scalar_type()), where(list, i), " is ", dtype_name(t.scalar_type()),
                     ", expected float32, float16 or bfloat16");
    TORCH_CHECK_VALUE(t.device() == ref.device(), where(list, i), " is on ", t.device().str(), ", ", ref_name,
                      " is on ", ref.device().str());
  }
}

void check_flat(const at::Tensor& flat, const char* name = "flat") {
  TORCH_CHECK_TYPE(flat.defined(), name, " is None");
  TORCH_CHECK_TYPE(is_kernel_float(flat.scalar_type()), name, " is ", dtype_name(flat.scalar_type()),
                   ", expected float32, float16 or bfloat16");
  TORCH_CHECK_VALUE(flat.dim() == 1 && flat.is_contiguous(), name, " must be a 1-D contiguous tensor, got shape ",
                    flat.sizes(), flat.is_contiguous() ? "" : " (not contiguous)");
}

// Copies between the tensors and their slices of flat: contiguous ones through
// one multi-tensor kernel call, the others through torch's strided copy.
void copy_all(const at::Tensor& flat, at::TensorList tensors, const std::vector<int64_t>& offsets, bool to_flat,
              bool existing_dst, CastLauncher launch) {
  std::vector<const void*> src;
  std::vector<void*> dst;
  std::vector<int64_t> numel;
  std::vector<DType> src_dt, dst_dt;
  const DType flat_dt = to_kernel_dtype(flat.scalar_type());
  char* const base = static_cast<char*>(flat.data_ptr());
  const size_t esize = flat.element_size();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    if (t.numel() == 0) continue;
    if (!t.is_contiguous()) {
      at::Tensor slice = flat.narrow(0, offsets[i], t.numel()).view(t.sizes());
      if (to_flat) slice.copy_(t); else t.copy_(slice);
      continue;
    }
    void* slot = base + offsets[i] * esize;
    src.push_back(to_flat ? t.data_ptr() : slot);
    dst.push_back(to_flat ? slot : t.data_ptr());
    numel.push_back(t.numel());
    src_dt.push_back(to_flat ? to_kernel_dtype(t.scalar_type()) : flat_dt);
    dst_dt.push_back(to_flat ? flat_dt : to_kernel_dtype(t.scalar_type()));
  }
  if (src.empty()) return;
  CastList l;
  l.count = static_cast<int64_t>(src.size());
  l.src = src.data();
  l.dst = dst.data();
  l.numel = numel.data();
  l.src_dtypes = src_dt.data();
  l.dst_dtypes = dst_dt.data();
  l.stream = existing_dst;
  launch(l, flat);
}

}  // namespace

at::Tensor flatten_impl(at::TensorList tensors, at::ScalarType dtype, at::OptionalIntArrayRef offsets,
                        std::optional<int64_t> numel, CastLauncher launch) {
  TORCH_CHECK_VALUE(!tensors.empty(), "flatten needs at least one tensor (it takes the device from tensors[0])");
  TORCH_CHECK_TYPE(is_kernel_float(dtype), "dtype is ", dtype_name(dtype), ", expected float32, float16 or bfloat16");
  check_list(tensors, "tensors", tensors[0], "tensors[0]");
  const std::vector<int64_t> off = resolve_offsets(tensors, "tensors", offsets);
  const int64_t need = end_of(tensors, off);
  const int64_t size = numel.value_or(need);
  TORCH_CHECK_VALUE(size >= need, "numel ", size, " is less than the ", need, " elements the tensors need");
  const at::TensorOptions opts = tensors[0].options().dtype(dtype);
  // Gaps (alignment padding) are zeroed, so reducing a padded buffer is deterministic.
  const bool gaps = size != need || offsets.has_value();
  at::Tensor flat = with_huge_pages(at::empty({size}, opts));
  if (gaps) flat.zero_();
  copy_all(flat, tensors, off, /*to_flat=*/true, /*existing_dst=*/false, launch);
  return flat;
}

static void check_fits(const at::Tensor& flat, at::TensorList tensors, const char* list,
                       const std::vector<int64_t>& off, bool packed, const char* name = "flat") {
  const int64_t need = end_of(tensors, off);
  if (packed) {
    TORCH_CHECK_VALUE(flat.numel() == need, name, " has ", flat.numel(), " elements, the ", list, " hold ", need);
  } else {
    TORCH_CHECK_VALUE(flat.numel() >= need, list, "[", tensors.size() - 1, "] ends at element ", need,
                      ", past ", name, "'s ", flat.numel());
  }
}

void flatten_into_impl(at::TensorList tensors, const at::Tensor& out, at::OptionalIntArrayRef offsets,
                       CastLauncher launch) {
  check_flat(out, "out");
  check_list(tensors, "tensors", out, "out");
  const std::vector<int64_t> off = resolve_offsets(tensors, "tensors", offsets);
  check_fits(out, tensors, "tensors", off, !offsets.has_value(), "out");
  copy_all(out, tensors, off, /*to_flat=*/true, /*existing_dst=*/true, launch);
}

std::vector<at::Tensor> unflatten_impl(const at::Tensor& flat, at::TensorList like, at::OptionalIntArrayRef offsets,
                                       CastLauncher launch) {
  check_flat(flat);
  check_list(like, "like", flat, "flat");
  const std::vector<int64_t> off = resolve_offsets(like, "like", offsets);
  check_fits(flat, like, "like", off, !offsets.has_value());
  std::vector<at::Tensor> out;
  out.reserve(like.size());
  for (const at::Tensor& t : like) out.push_back(with_huge_pages(at::empty(t.sizes(), t.options())));
  copy_all(flat, out, off, /*to_flat=*/false, /*existing_dst=*/false, launch);
  return out;
}

void unflatten_into_impl(const at::Tensor& flat, at::TensorList targets, at::OptionalIntArrayRef offsets,
                         CastLauncher launch) {
  check_flat(flat);
  check_list(targets, "targets", flat, "flat");
  const std::vector<int64_t> off = resolve_offsets(targets, "targets", offsets);
  check_fits(flat, targets, "targets", off, !offsets.has_value());
  copy_all(flat, targets, off, /*to_flat=*/false, /*existing_dst=*/true, launch);
}

}  // namespace zerokern
