// Torch-free tests of the CPU kernel and its bit conversions, built by CMake
// (ctest) against csrc/ alone: the kernel layer must stand without torch.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "zerokern/adam.h"
#include "zerokern/half_bits.h"

namespace zk = zerokern;
static int failures = 0;
#define EXPECT(cond, ...)                 \
  do {                                    \
    if (!(cond)) {                        \
      std::printf("FAIL %s:%d: ", __FILE__, __LINE__); \
      std::printf(__VA_ARGS__);           \
      std::printf("\n");                  \
      ++failures;                         \
    }                                     \
  } while (0)

static uint16_t bits16(_Float16 h) { uint16_t u; std::memcpy(&u, &h, 2); return u; }

// Every fp16 value converts to the float the compiler's own _Float16 gives.
static void test_f16_to_f32_exhaustive() {
  for (uint32_t u = 0; u < 65536; ++u) {
    _Float16 h; const uint16_t b = static_cast<uint16_t>(u); std::memcpy(&h, &b, 2);
    const float want = static_cast<float>(h), got = zk::bits::f16_to_f32(b);
    EXPECT((std::isnan(want) && std::isnan(got)) || std::memcmp(&want, &got, 4) == 0, "f16 0x%04x", u);
  }
}

// fp32 -> fp16 rounds to nearest even like the compiler's conversion, on a sweep
// of float bit patterns that covers normals, subnormals, overflow and NaN.
static void test_f32_to_f16_sweep() {
  for (uint64_t w = 0; w < (1ull << 32); w += 4099) {
    float f; const uint32_t b = static_cast<uint32_t>(w); std::memcpy(&f, &b, 4);
    const _Float16 h = static_cast<_Float16>(f);
    const uint16_t got = zk::bits::f32_to_f16(f);
    if (std::isnan(f)) { EXPECT((got & 0x7C00u) == 0x7C00u && (got & 0x3FFu), "nan 0x%08x", b); continue; }
    EXPECT(got == bits16(h), "f32 0x%08x -> 0x%04x, want 0x%04x", b, got, bits16(h));
  }
}

// bf16 = the upper half of fp32 after round-to-nearest-even, checked against
// a double-precision rounding on the same sweep.
static void test_f32_to_bf16_sweep() {
  for (uint64_t w = 0; w < (1ull << 32); w += 4099) {
    float f; const uint32_t b = static_cast<uint32_t>(w); std::memcpy(&f, &b, 4);
    const uint16_t got = zk::bits::f32_to_bf16(f);
    if (std::isnan(f)) { EXPECT(got == 0x7FC0u, "nan 0x%08x", b); continue; }
    const uint32_t lo = b & 0xFFFF0000u, hi = lo + 0x10000u;
    float flo, fhi; std::memcpy(&flo, &lo, 4); std::memcpy(&fhi, &hi, 4);
    const double dlo = std::fabs(static_cast<double>(f) - flo);
    const double dhi = std::isinf(fhi) ? INFINITY : std::fabs(static_cast<double>(fhi) - f);
    uint16_t want = static_cast<uint16_t>(lo >> 16);
    if (dhi < dlo || (dhi == dlo && (want & 1u))) want = static_cast<uint16_t>(hi >> 16);
    if (std::isinf(fhi) && dhi == INFINITY && (b & 0x7FFFFFFFu) >= 0x7F7F8000u) want = static_cast<uint16_t>(hi >> 16);
    EXPECT(got == want, "f32 0x%08x -> 0x%04x, want 0x%04x", b, got, want);
  }
}

// The multi-tensor CPU kernel against a double-precision loop of the documented update.
static void test_adam_against_double_reference() {
  std::mt19937 rng(0);
  std::normal_distribution<float> nd;
  const std::vector<int64_t> sizes = {0, 1, 3, 127, 4097, 70001};
  std::vector<std::vector<float>> p, g, m, v;
  for (int64_t n : sizes) {
    p.emplace_back(n); g.emplace_back(n); m.emplace_back(n, 0.f); v.emplace_back(n, 0.f);
    for (int64_t i = 0; i < n; ++i) { p.back()[i] = nd(rng); g.back()[i] = 0.1f * nd(rng); }
  }
  auto p_ref = p; auto m_ref = m; auto v_ref = v;
  std::vector<float*> pp, mp, vp; std::vector<const void*> gp; std::vector<zk::DType> gd;
  for (size_t k = 0; k < sizes.size(); ++k) {
    pp.push_back(p[k].data()); mp.push_back(m[k].data()); vp.push_back(v[k].data());
    gp.push_back(g[k].data()); gd.push_back(zk::DType::kFloat32);
  }
  zk::AdamTensorList t;
  t.count = static_cast<int64_t>(sizes.size());
  t.params = pp.data(); t.grads = gp.data(); t.exp_avgs = mp.data(); t.exp_avg_sqs = vp.data();
  t.numel = sizes.data(); t.grad_dtypes = gd.data();
  zk::AdamHyper h; h.lr = 1e-2; h.weight_decay = 0.1;
  for (int step = 1; step <= 3; ++step) {
    h.step = step;
    zk::fused_adam_cpu(t, h, 2);
    const double bc1 = 1 - std::pow(h.beta1, step), bc2 = 1 - std::pow(h.beta2, step);
    for (size_t k = 0; k < sizes.size(); ++k)
      for (int64_t i = 0; i < sizes[k]; ++i) {
        double pr = p_ref[k][i] * (1 - h.lr * h.weight_decay), gr = g[k][i];
        double mr = h.beta1 * m_ref[k][i] + (1 - h.beta1) * gr;
        double vr = h.beta2 * v_ref[k][i] + (1 - h.beta2) * gr * gr;
        pr -= h.lr / bc1 * mr / (std::sqrt(vr) / std::sqrt(bc2) + h.eps);
        p_ref[k][i] = static_cast<float>(pr); m_ref[k][i] = static_cast<float>(mr); v_ref[k][i] = static_cast<float>(vr);
      }
  }
  double worst = 0;
  for (size_t k = 0; k < sizes.size(); ++k)
    for (int64_t i = 0; i < sizes[k]; ++i)
      worst = std::fmax(worst, std::fabs(p[k][i] - p_ref[k][i]) / (std::fabs(p_ref[k][i]) + 1e-3));
  // fp32 arithmetic against double: a few float ulps after three steps.
  EXPECT(worst < 1e-5, "worst relative error %g", worst);
}

int main() {
  test_f16_to_f32_exhaustive();
  test_f32_to_f16_sweep();
  test_f32_to_bf16_sweep();
  test_adam_against_double_reference();
  std::printf("%s (cpu variant %s)\n", failures ? "FAILED" : "all kernel tests passed", zk::cpu_capability());
  return failures ? 1 : 0;
}
