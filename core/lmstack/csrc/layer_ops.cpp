// The decoder layer's small per-token ops on the CPU, one call each: RMSNorm (with the residual
// add in front of it), the rotary embedding in place and SwiGLU's silu(gate) * up in place; and
// the greedy sampler's argmax over each logits row (torch's CPU argmax does not vectorise it:
// ~50 us a 49,152-wide row on Zen 3, ~1 ms a step at batch 32). At
// batch 1 a 576-wide RMSNorm done as five torch ops costs ~60-70 us of dispatch for ~1 us of
// arithmetic; 61 of them per token were ~12 % of a decode step (lmstack.model.layer_ops says when
// these are used).
//
// fp32 only. Compiled twice, plain and for AVX2+FMA (the compiler vectorises the loops; silu * up
// is vectorised by hand), and picked at run time from what the CPU reports. -ffp-contract=off:
// no multiply-add is fused, so both variants give the same bits, and the rotary embedding gives
// the same bits as the torch reference (lmstack.model.rope.rotate_); RMSNorm differs from
// torch's only in the summation order of the mean of squares.

#include <torch/extension.h>

#include "isa_cap.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

namespace layer_ops {

enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1 };

int64_t best_isa() {
  __builtin_cpu_init();
  const int64_t found = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? ISA_AVX2 : ISA_SCALAR;
  return std::min(found, lmstack::isa_cap());
}

// One row: (optionally x += r, in place) then out = x * rsqrt(mean(x^2) + eps) * w.
// Eight partial sums, so the vectorised and the plain build add in the same order.
#define LAYER_OPS_BODIES                                                                          \
  static void norm_row(float* x, const float* r, const float* w, float* out, int64_t h, float eps) { \
    float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                                    \
    int64_t i = 0;                                                                               \
    if (r != nullptr) {                                                                          \
      for (int64_t j = 0; j < h; ++j) x[j] = x[j] + r[j];                                        \
    }                                                                                            \
    for (; i + 8 <= h; i += 8)                                                                   \
      for (int l = 0; l < 8; ++l) part[l] += x[i + l] * x[i + l];                                \
    for (int l = 0; i < h; ++i, ++l) part[l] += x[i] * x[i];                                     \
    float sum = ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7])); \
    const float inv = 1.0f / std::sqrt(sum / float(h) + eps);                                    \
    for (int64_t j = 0; j < h; ++j) out[j] = (x[j] * inv) * w[j];                                \
  }                                                                                              \
  /* One position's heads: x1' = x1 c - x2 s, x2' = x2 c + x1 s over the two halves. */          \
  static void rope_row(float* x, int64_t heads, int64_t head_stride, int64_t half, const float* c, \
                       const float* s) {                                                         \
    for (int64_t hd = 0; hd < heads; ++hd) {                                                     \
      float* a = x + hd * head_stride;                                                           \
      float* b = a + half;                                                                       \
      for (int64_t i = 0; i < half; ++i) {                                                       \
        const float x1 = a[i], x2 = b[i];                                                        \
        a[i] = x1 * c[i] - x2 * s[i];                                                            \
        b[i] = x2 * c[i] + x1 * s[i];                                                            \
      }                                                                                          \
    }                                                                                            \
  }                                                                                              \
  /* g = silu(g) * u over one row, in place. exp as 2^n e^r: n = round(x / ln 2), |r| <= ln 2 / 2, \
     a degree-6 Taylor polynomial (relative error ~1e-7); the AVX2 build runs the same operations \
     eight lanes at a time (silu_mul_row_vec). Clamped to [-87, 88]: \
     silu then tends to 0 and to g exactly as it should. */                                      \
  static void silu_mul_row(float* g, const float* u, int64_t n) {                                \
    for (int64_t i = 0; i < n; ++i) {                                                            \
      float x = -g[i];                                                                           \
      x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);                                         \
      /* round to nearest even by adding and removing 1.5 * 2^23 (|x / ln 2| < 2^22) */          \
      const float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;                    \
      float r = x - k * 0.693145751953125f;                                                      \
      r = r - k * 1.428606765330187e-06f;                                                        \
      float p = 1.0f / 720;                                                                      \
      p = p * r + 1.0f / 120;                                                                    \
      p = p * r + 1.0f / 24;                                                                     \
      p = p * r + 1.0f / 6;                                                                      \
      p = p * r + 0.5f;                                                                          \
      p = p * r + 1.0f;                                                                          \
      p = p * r + 1.0f;                                                                          \
      const int32_t bits = (int32_t(k) + 127) << 23;                                             \
      float scale;                                                                               \
      std::memcpy(&scale, &bits, 4);                                                             \
      g[i] = g[i] / (1.0f + p * scale) * u[i];                                                   \
    }                                                                                            \
  }

namespace scalar {
LAYER_OPS_BODIES
}  // namespace scalar

// The index of a row's largest value, the first of equal ones; where the row holds a NaN, the
// first NaN (torch.argmax's rule: NaN counts as the largest).
static int64_t argmax_row_plain(const float* x, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(x[i])) return i;
    if (x[i] > x[best]) best = i;
  }
  return best;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
LAYER_OPS_BODIES

// silu_mul_row with eight lanes at a time: the same operations in the same order (no fused
// multiply-add), so the same bits as the plain loop, which does the tail. The compiler does not
// vectorise that loop by itself (the float -> int -> float bit trick).
static void silu_mul_row_vec(float* g, const float* u, int64_t n) {
  const __m256 lo = _mm256_set1_ps(-87.0f), hi = _mm256_set1_ps(88.0f), magic = _mm256_set1_ps(12582912.0f);
  const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = _mm256_loadu_ps(g + i);
    __m256 x = _mm256_min_ps(_mm256_max_ps(_mm256_xor_ps(gv, sign), lo), hi);
    const __m256 k = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
    __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(k, _mm256_set1_ps(0.693145751953125f)));
    r = _mm256_sub_ps(r, _mm256_mul_ps(k, _mm256_set1_ps(1.428606765330187e-06f)));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 120));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 24));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(1.0f / 6));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(0.5f));
    p = _mm256_add_ps(_mm256_mul_ps(p, r), one);
    p = _mm256_add_ps(_mm256_mul_ps(p, r), one);
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(k), _mm256_set1_epi32(127)), 23);
    const __m256 e = _mm256_add_ps(one, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
    _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, e), _mm256_loadu_ps(u + i)));
  }
  silu_mul_row(g + i, u + i, n - i);
}

// argmax_row_plain's result in two vector passes: the maximum (and whether any NaN is there),
// then the first index holding it. A row with a NaN goes to the plain loop.
static int64_t argmax_row_vec(const float* x, int64_t n) {
  __m256 mx = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    mx = _mm256_max_ps(mx, v);
  }
  if (_mm256_movemask_ps(nan)) return argmax_row_plain(x, n);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float m = _mm_cvtss_f32(m4);
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) return argmax_row_plain(x, n);
    m = x[j] > m ? x[j] : m;
  }
  const __m256 mv = _mm256_set1_ps(m);
  for (i = 0; i + 8 <= n; i += 8) {
    const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), mv, _CMP_EQ_OQ));
    if (hit) return i + __builtin_ctz(hit);
  }
  for (; i < n; ++i)
    if (x[i] == m) return i;
  return 0;
}
}  // namespace avx2
#pragma GCC pop_options

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.dim() == 2 && t.stride(1) == 1,
              name, " must be a CPU float32 tensor [T, H] with contiguous rows");
}

// rms_norm(x [T, H], w [H], eps, residual [T, H] or None, isa) -> [T, H]. With a residual, x
// becomes x + residual first (in place: the residual stream the layer carries on).
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps,
                       const std::optional<torch::Tensor>& residual, int64_t isa) {
  check_rows(x, "x");
  const int64_t t = x.size(0), h = x.size(1);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat32 && w.dim() == 1 && w.size(0) == h &&
                  w.is_contiguous(),
              "w must be a contiguous CPU float32 tensor [", h, "]");
  if (residual) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == t && residual->size(1) == h, "residual must have x's shape");
  }
  if (isa < 0) isa = best_isa();
  auto out = torch::empty({t, h}, x.options());
  float* xp = x.data_ptr<float>();
  const float* rp = residual ? residual->data_ptr<float>() : nullptr;
  const int64_t lx = x.stride(0), lr = residual ? residual->stride(0) : 0;
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float e = float(eps);
  // A row is ~1 us: split across threads only when there are many.
  at::parallel_for(0, t, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      const float* r = rp ? rp + i * lr : nullptr;
      if (isa >= ISA_AVX2)
        avx2::norm_row(xp + i * lx, r, wp, op + i * h, h, e);
      else
        scalar::norm_row(xp + i * lx, r, wp, op + i * h, h, e);
    }
  });
  return out;
}

// rope_(x [T, heads, D] with contiguous head dims, cos [T, D/2], sin [T, D/2], isa): rotates x in
// place (rotate-half convention) and returns it.
torch::Tensor rope_(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 3 && x.stride(2) == 1,
              "x must be a CPU float32 tensor [T, heads, D] with contiguous heads");
  const int64_t t = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0, "the head dimension must be even, got ", d);
  for (const auto* tab : {&cos, &sin})
    TORCH_CHECK(tab->device().is_cpu() && tab->scalar_type() == torch::kFloat32 && tab->dim() == 2 &&
                    tab->size(0) == t && tab->size(1) == half && tab->stride(1) == 1,
                "cos and sin must be CPU float32 tensors [", t, ", ", half, "] with contiguous rows");
  if (isa < 0) isa = best_isa();
  float* xp = x.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t lx = x.stride(0), hs = x.stride(1), lc = cos.stride(0), ls = sin.stride(0);
  at::parallel_for(0, t, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      if (isa >= ISA_AVX2)
        avx2::rope_row(xp + i * lx, heads, hs, half, cp + i * lc, sp + i * ls);
      else
        scalar::rope_row(xp + i * lx, heads, hs, half, cp + i * lc, sp + i * ls);
    }
  });
  return x;
}

// qkv_rope_(qkv [T, (Hq + 2 Hkv) D] with contiguous rows, cos [T, D/2], sin [T, D/2], Hq, Hkv,
// isa): the fused projection's query and key heads rotated in place (rope_), and (q [T, Hq, D],
// k [T, Hkv, D], v [T, Hkv, D]), views of it. One call for what took four slices, four views and
// the rotation from Python (~22 us a layer at batch 1 on Zen 3, ~4 % of a decode step).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> qkv_rope_(torch::Tensor qkv, const torch::Tensor& cos,
                                                                   const torch::Tensor& sin, int64_t num_heads,
                                                                   int64_t num_kv_heads, int64_t isa) {
  check_rows(qkv, "qkv");
  const int64_t t = qkv.size(0), heads = num_heads + 2 * num_kv_heads;
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && qkv.size(1) % heads == 0,
              "qkv: ", qkv.size(1), " columns are not ", heads, " heads");
  const int64_t d = qkv.size(1) / heads, ld = qkv.stride(0), off = qkv.storage_offset();
  // The rotation is rope_'s on the first Hq + Hkv heads, so the bits are the same.
  rope_(qkv.as_strided({t, num_heads + num_kv_heads, d}, {ld, d, 1}, off), cos, sin, isa);
  return {qkv.as_strided({t, num_heads, d}, {ld, d, 1}, off),
          qkv.as_strided({t, num_kv_heads, d}, {ld, d, 1}, off + num_heads * d),
          qkv.as_strided({t, num_kv_heads, d}, {ld, d, 1}, off + (num_heads + num_kv_heads) * d)};
}

// silu_mul_(gate_up [T, 2I] with contiguous rows, isa): SwiGLU's silu(gate) * up written into
// the gate half, in place; returns that half [T, I] (a view). Within ~5 fp32 ulps of the exact
// value (torch's F.silu(gate) * up: ~3); the plain and AVX2 builds give the same bits.
torch::Tensor silu_mul_(torch::Tensor gate_up, int64_t isa) {
  check_rows(gate_up, "gate_up");
  const int64_t t = gate_up.size(0), n = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns, got ", gate_up.size(1));
  if (isa < 0) isa = best_isa();
  float* p = gate_up.data_ptr<float>();
  const int64_t ld = gate_up.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t i = t0; i < t1; ++i) {
      if (isa >= ISA_AVX2)
        avx2::silu_mul_row_vec(p + i * ld, p + i * ld + n, n);
      else
        scalar::silu_mul_row(p + i * ld, p + i * ld + n, n);
    }
  });
  return gate_up.narrow(1, 0, n);
}

// argmax_rows(x [T, V] with contiguous rows, isa) -> int64 [T]: each row's argmax, as
// torch.argmax(x, dim=-1) gives it (the first of equal maxima; the first NaN where there is one).
torch::Tensor argmax_rows(const torch::Tensor& x, int64_t isa) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) > 0, "argmax over an empty row");
  if (isa < 0) isa = best_isa();
  const int64_t t = x.size(0), n = x.size(1), ld = x.stride(0);
  auto out = torch::empty({t}, x.options().dtype(torch::kInt64));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, t, 4, [&](int64_t t0, int64_t t1) {
    for (int64_t r = t0; r < t1; ++r)
      o[r] = isa >= ISA_AVX2 ? avx2::argmax_row_vec(p + r * ld, n) : argmax_row_plain(p + r * ld, n);
  });
  return out;
}

}  // namespace layer_ops

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmstack core: fused per-token layer ops for the CPU";
  m.def("rms_norm", &layer_ops::rms_norm, "RMSNorm of x [T, H] (residual first added to x in place)", py::arg("x"),
        py::arg("w"), py::arg("eps"), py::arg("residual") = py::none(), py::arg("isa") = -1);
  m.def("rope_", &layer_ops::rope_, "rotary embedding in place on x [T, heads, D]", py::arg("x"), py::arg("cos"),
        py::arg("sin"), py::arg("isa") = -1);
  m.def("qkv_rope_", &layer_ops::qkv_rope_,
        "rotary embedding in place on the query and key heads of qkv [T, (Hq + 2 Hkv) D]; (q, k, v) views",
        py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("isa") = -1);
  m.def("silu_mul_", &layer_ops::silu_mul_, "silu(gate) * up into the gate half of gate_up [T, 2I], in place",
        py::arg("gate_up"), py::arg("isa") = -1);
  m.def("argmax_rows", &layer_ops::argmax_rows, "each row's argmax of x [T, V] (torch.argmax's ties and NaN rule)",
        py::arg("x"), py::arg("isa") = -1);
  m.def("best_isa", &layer_ops::best_isa, "1: AVX2+FMA, 0: scalar");
}
