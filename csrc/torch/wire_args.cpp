#include "wire_args.h"

#include <c10/util/Exception.h>

#include "names.h"

namespace zerokern {
namespace {

void check_bits(int64_t bits) { TORCH_CHECK_VALUE(bits == 8 || bits == 4, "wire: bits must be 8 or 4, got ", bits); }

void check_flat(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t numel, const at::Tensor& like) {
  TORCH_CHECK_VALUE(t.scalar_type() == dtype, "wire: ", name, " is ", dtype_name(t.scalar_type()), ", expected ",
                    dtype_name(dtype));
  TORCH_CHECK_VALUE(t.is_contiguous() && t.numel() == numel, "wire: ", name, " must be contiguous with ", numel,
                    " elements, has ", t.numel());
  TORCH_CHECK_VALUE(t.device() == like.device(), "wire: ", name, " is on ", t.device(), ", expected ", like.device());
}

// error and residual: fp32 or bf16, one per element of x
void check_side(const at::Tensor& t, const char* name, int64_t numel, const at::Tensor& x) {
  const at::ScalarType d = t.scalar_type();
  TORCH_CHECK_VALUE(d == at::kFloat || d == at::kBFloat16, "wire: ", name, " is ", dtype_name(d),
                    ", expected float32 or bfloat16");
  check_flat(t, name, d, numel, x);
}

}  // namespace

WireEncode wire_encode_args(const at::Tensor& x, const at::Tensor& out, const std::optional<at::Tensor>& error,
                            int64_t bits, int64_t seed, int64_t step, int64_t stream, int64_t base,
                            bool stochastic, const std::optional<at::Tensor>& residual) {
  check_bits(bits);
  TORCH_CHECK_VALUE(is_kernel_float(x.scalar_type()) && x.is_contiguous(),
                    "wire: x must be a contiguous float32, float16 or bfloat16 tensor, is ",
                    dtype_name(x.scalar_type()));
  TORCH_CHECK_VALUE(stream >= 0 && stream + kStreamWire <= 0xFFFFFFFFu, "wire: stream out of range: ", stream);
  WireEncode a;
  a.n = x.numel();
  check_flat(out, "out", at::kByte, wire_bytes(a.n, static_cast<int>(bits)), x);
  if (error.has_value()) check_side(*error, "error", a.n, x);
  if (residual.has_value()) check_side(*residual, "residual", a.n, x);
  a.x = x.data_ptr();
  a.dtype = to_kernel_dtype(x.scalar_type());
  a.out = out.data_ptr<uint8_t>();
  if (error.has_value()) {
    a.error = error->data_ptr();
    a.error_dtype = to_kernel_dtype(error->scalar_type());
  }
  if (residual.has_value()) {
    a.residual = residual->data_ptr();
    a.residual_dtype = to_kernel_dtype(residual->scalar_type());
  }
  a.bits = static_cast<int>(bits);
  a.seed = static_cast<uint64_t>(seed);
  a.step = static_cast<uint32_t>(step);  // the counter's word 2: the step's low 32 bits, as wire.py
  a.stream = kStreamWire + static_cast<uint32_t>(stream);
  a.base = base;
  a.stochastic = stochastic;
  return a;
}

WireDecode wire_decode_args(const at::Tensor& buf, int64_t n, int64_t bits, const at::Tensor& out, bool accumulate) {
  check_bits(bits);
  TORCH_CHECK_VALUE(n >= 0, "wire: n must be >= 0, got ", n);
  check_flat(buf, "buf", at::kByte, wire_bytes(n, static_cast<int>(bits)), out);
  check_flat(out, "out", at::kFloat, n, buf);
  WireDecode a;
  a.buf = buf.data_ptr<uint8_t>();
  a.n = n;
  a.bits = static_cast<int>(bits);
  a.out = out.data_ptr<float>();
  a.accumulate = accumulate;
  return a;
}

}  // namespace zerokern
