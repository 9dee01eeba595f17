// GGUF block matmul on the CPU for lmstack-gguf: out[M, N] = x[M, K] @ W^T where W [N, K] stays in
// its GGUF blocks (32 values each, along a row) exactly as the checkpoint stores them:
//
//   Q4_0: fp16 d, 16 bytes of 4-bit q   value = d * (q - 8)    18 bytes / 32 values
//   Q4_1: fp16 d, fp16 m, 16 bytes of q  value = d * q + m      20 bytes / 32 values
//   Q8_0: fp16 d, 32 int8 q              value = d * q          34 bytes / 32 values
//
// (byte j of a 4-bit block holds value j in its low nibble and value j + 16 in its high one.)
// A block's contribution to one output is d * dot(q, x_block) + m * sum(x_block): the q are
// widened to fp32 in registers and multiplied by the fp32 activations with FMA, the block sums
// of x are computed once per call. Decode reads 0.56-1.06 bytes per weight, as llama.cpp does,
// and the result is what the dequantized checkpoint gives, up to fp32 summation order.
//
// Threads split the weight rows (at::parallel_for: torch's thread count applies). AVX2+FMA+F16C
// or plain C++, picked at run time from what the CPU reports, or forced by the caller (tests).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace gguf_matmul {

enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1 };
// GGML type ids (ggml.h).
enum Type { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
constexpr int QK = 32;  // values per block, every type here

int64_t best_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return ISA_AVX2;
  return ISA_SCALAR;
}

int64_t block_bytes(int64_t type) {
  switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
  }
  TORCH_CHECK(false, "GGML type ", type, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
  return 0;
}

// IEEE half -> float without F16C (the scalar path; F16C in the vector one).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while (!(man & 0x400)) {
        man <<= 1;
        --exp;
      }
      bits = sign | (exp << 23) | ((man & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000 | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// A block's scale and offset (value = d * q + m, q as stored: 0..15 or -128..127).
inline void block_dm(int64_t type, const uint8_t* blk, float& d, float& m) {
  d = half_to_float(load_u16(blk));
  m = type == Q4_1 ? half_to_float(load_u16(blk + 2)) : type == Q4_0 ? -8.f * d : 0.f;
}

inline void block_q(int64_t type, const uint8_t* blk, float* q) {
  if (type == Q8_0) {
    const int8_t* s = reinterpret_cast<const int8_t*>(blk + 2);
    for (int j = 0; j < QK; ++j) q[j] = float(s[j]);
  } else {
    const uint8_t* s = blk + (type == Q4_1 ? 4 : 2);
    for (int j = 0; j < QK / 2; ++j) {
      q[j] = float(s[j] & 0x0F);
      q[j + QK / 2] = float(s[j] >> 4);
    }
  }
}

struct Problem {
  const float* x;
  int64_t ldx;
  const float* xsum;  // [M, K / QK]: each block's sum of x (one-row and scalar paths only)
  const uint8_t* w;
  int64_t row_bytes;
  int64_t type;
  float* out;
  int64_t M, N, K;
};

void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QK, bb = block_bytes(p.type);
  float q[QK];
  std::vector<float> acc(p.M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = p.w + n * p.row_bytes + b * bb;
      float d, m;
      block_dm(p.type, blk, d, m);
      block_q(p.type, blk, q);
      for (int64_t r = 0; r < p.M; ++r) {
        const float* xb = p.x + r * p.ldx + b * QK;
        float dot = 0.f;
        for (int j = 0; j < QK; ++j) dot += q[j] * xb[j];
        acc[r] += d * dot + m * p.xsum[r * nb + b];
      }
    }
    for (int64_t r = 0; r < p.M; ++r) p.out[r * p.N + n] = acc[r];
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

#ifndef PREFETCH_ROWS
#define PREFETCH_ROWS 8
#endif

inline float half(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// The 32 q of a block as four vectors of 8 (values 0-7, 8-15, 16-23, 24-31).
template <int TYPE>
inline void widen(const uint8_t* blk, __m256 v[4]) {
  if constexpr (TYPE == Q8_0) {
    const uint8_t* s = blk + 2;
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8 * i))));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + (TYPE == Q4_1 ? 4 : 2)));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

template <int TYPE>
inline void dm(const uint8_t* blk, float& d, float& m) {
  d = half(blk);
  m = TYPE == Q4_1 ? half(blk + 2) : TYPE == Q4_0 ? -8.f * d : 0.f;
}

inline __m256 dot4(const __m256 v[4], const float* xb) {
  __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(xb));
  t = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), t);
  t = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), t);
  return _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), t);
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline void prefetch_row(const Problem& p, int64_t n, int64_t b, int64_t bb) {
  if (n + PREFETCH_ROWS < p.N)
    _mm_prefetch(reinterpret_cast<const char*>(p.w + (n + PREFETCH_ROWS) * p.row_bytes + b * bb), _MM_HINT_T0);
}

// One activation row (decode at batch 1): two weight rows at a time, each with four independent
// accumulators (q * d, then one FMA per vector), so no chain of dependent FMAs per block limits it.
template <int TYPE>
inline void row_block(const uint8_t* blk, const float* xb, __m256 acc[4], float& off, float xsum) {
  __m256 v[4];
  float d, m;
  widen<TYPE>(blk, v);
  dm<TYPE>(blk, d, m);
  const __m256 dv = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(v[i], dv), _mm256_loadu_ps(xb + 8 * i), acc[i]);
  off += m * xsum;
}

inline float total(const __m256 acc[4], float off) {
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + off;
}

template <int TYPE>
void rows_m1(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QK, bb = block_bytes(TYPE);
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < 4; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
    float off0 = 0.f, off1 = 0.f;
    const uint8_t* w0 = p.w + n * p.row_bytes;
    const uint8_t* w1 = w0 + p.row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      prefetch_row(p, n, b, bb);
      prefetch_row(p, n + 1, b, bb);
      row_block<TYPE>(w0 + b * bb, p.x + b * QK, acc0, off0, p.xsum[b]);
      row_block<TYPE>(w1 + b * bb, p.x + b * QK, acc1, off1, p.xsum[b]);
    }
    p.out[n] = total(acc0, off0);
    p.out[n + 1] = total(acc1, off1);
  }
  for (; n < n1; ++n) {
    __m256 acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_ps();
    float off = 0.f;
    for (int64_t b = 0; b < nb; ++b) row_block<TYPE>(p.w + n * p.row_bytes + b * bb, p.x + b * QK, acc, off, p.xsum[b]);
    p.out[n] = total(acc, off);
  }
}

// Several activation rows: each block is widened once into its fp32 values (d * q + m, one FMA
// per vector) and used for up to MR rows, whose accumulators are independent chains (a stack
// array: std::vector<__m256> would drop the vectors' 32-byte alignment).
constexpr int MR = 16;

template <int TYPE>
void rows_many(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QK, bb = block_bytes(TYPE);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t r0 = 0; r0 < p.M; r0 += MR) {
      const int64_t rows = std::min<int64_t>(MR, p.M - r0);
      __m256 acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        prefetch_row(p, n, b, bb);
        const uint8_t* blk = p.w + n * p.row_bytes + b * bb;
        __m256 v[4];
        float d, m;
        widen<TYPE>(blk, v);
        dm<TYPE>(blk, d, m);
        const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
        for (int i = 0; i < 4; ++i) v[i] = _mm256_fmadd_ps(v[i], dv, mv);
        const float* xb = p.x + r0 * p.ldx + b * QK;
        for (int64_t i = 0; i < rows; ++i, xb += p.ldx) {
          __m256 a = _mm256_fmadd_ps(v[0], _mm256_loadu_ps(xb), acc[i]);
          a = _mm256_fmadd_ps(v[1], _mm256_loadu_ps(xb + 8), a);
          a = _mm256_fmadd_ps(v[2], _mm256_loadu_ps(xb + 16), a);
          acc[i] = _mm256_fmadd_ps(v[3], _mm256_loadu_ps(xb + 24), a);
        }
      }
      for (int64_t i = 0; i < rows; ++i) p.out[(r0 + i) * p.N + n] = hsum(acc[i]);
    }
  }
}

// Rows [n0, n1) of W in fp32: value = d * q + m, eight at a time.
template <int TYPE>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t k, float* out, int64_t n0, int64_t n1) {
  const int64_t nb = k / QK, bb = block_bytes(TYPE);
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w + n * row_bytes + b * bb;
      __m256 v[4];
      float d, m;
      widen<TYPE>(blk, v);
      dm<TYPE>(blk, d, m);
      const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
      float* o = out + n * k + b * QK;
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(o + 8 * i, _mm256_fmadd_ps(v[i], dv, mv));
    }
}

template <int TYPE>
void rows(const Problem& p, int64_t n0, int64_t n1) {
  if (p.M == 1)
    rows_m1<TYPE>(p, n0, n1);
  else
    rows_many<TYPE>(p, n0, n1);
}

}  // namespace avx2
#pragma GCC pop_options

void check_weight(const torch::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous CPU uint8 tensor [N, bytes per row]");
  TORCH_CHECK(k > 0 && k % QK == 0, "K must be a positive multiple of ", QK, ", got ", k);
  TORCH_CHECK(w.size(1) == k / QK * block_bytes(type), "w rows hold ", w.size(1), " bytes; K = ", k,
              " needs ", k / QK * block_bytes(type));
}

torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be a CPU float32 tensor [M, K]");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, type, K);
  if (isa < 0) isa = best_isa();
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  // Each block's sum of x, once per call, for the offset term m * sum(x_block) of the one-row
  // and scalar paths (the several-row vector path folds m into the widened weights instead).
  std::vector<float> xsum;
  if (M == 1 || isa < ISA_AVX2) {
    const int64_t nb = K / QK;
    xsum.assign(M * nb, 0.f);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b)
        for (int j = 0; j < QK; ++j) xsum[r * nb + b] += xp[r * x.stride(0) + b * QK + j];
  }
  Problem p{xp, x.stride(0), xsum.data(), w.data_ptr<uint8_t>(), w.size(1), type, out.data_ptr<float>(), M, N, K};
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (isa >= ISA_AVX2) {
      switch (type) {
        case Q4_0: avx2::rows<Q4_0>(p, n0, n1); break;
        case Q4_1: avx2::rows<Q4_1>(p, n0, n1); break;
        default: avx2::rows<Q8_0>(p, n0, n1); break;
      }
    } else {
      rows_scalar(p, n0, n1);
    }
  });
  return out;
}

torch::Tensor gguf_dequantize(const torch::Tensor& w, int64_t type, int64_t k, std::optional<torch::Tensor> into) {
  check_weight(w, type, k);
  const int64_t N = w.size(0), nb = k / QK, bb = block_bytes(type);
  torch::Tensor out;
  if (into) {  // a reused buffer: a fresh allocation per call costs page faults on every call
    out = *into;
    TORCH_CHECK(out.scalar_type() == torch::kFloat32 && out.is_contiguous() && out.dim() == 2 && out.size(0) == N &&
                    out.size(1) == k,
                "into must be a contiguous float32 tensor [", N, ", ", k, "]");
  } else {
    out = torch::empty({N, k}, torch::kFloat32);
  }
  const uint8_t* src = w.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  if (best_isa() >= ISA_AVX2) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      switch (type) {
        case Q4_0: avx2::dequantize_rows<Q4_0>(src, w.size(1), k, dst, n0, n1); break;
        case Q4_1: avx2::dequantize_rows<Q4_1>(src, w.size(1), k, dst, n0, n1); break;
        default: avx2::dequantize_rows<Q8_0>(src, w.size(1), k, dst, n0, n1); break;
      }
    });
    return out;
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float q[QK];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* blk = src + n * w.size(1) + b * bb;
        float d, m;
        block_dm(type, blk, d, m);
        block_q(type, blk, q);
        float* o = dst + n * k + b * QK;
        for (int j = 0; j < QK; ++j) o[j] = d * q[j] + m;
      }
  });
  return out;
}

}  // namespace gguf_matmul

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmstack-gguf CPU kernels";
  m.def("gguf_matmul", &gguf_matmul::gguf_matmul, "x fp32 [M, K] @ W^T, W [N, K] in GGUF blocks (uint8 rows)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("isa") = -1);
  m.def("gguf_dequantize", &gguf_matmul::gguf_dequantize, "GGUF block rows -> float32 [N, K]", py::arg("w"),
        py::arg("type"), py::arg("k"), py::arg("into") = py::none());
  m.def("block_bytes", &gguf_matmul::block_bytes, "bytes per 32-value block of a GGML type");
  m.def("best_isa", &gguf_matmul::best_isa, "1: AVX2+FMA+F16C, 0: scalar");
}
