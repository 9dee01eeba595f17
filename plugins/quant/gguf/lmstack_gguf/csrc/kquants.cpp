// GGUF K-quants and the 5-bit legacy types kept packed on the CPU: dequantization (fp32 bit for bit
// what gguf-py's numpy gives, or bf16) and out[M, N] = x[M, K] @ W^T with x rounded to int8 per
// 32-block first, as gguf_matmul_q8 does for Q4_0 / Q4_1 / Q8_0 (gguf_matmul.cpp).
//
//   type  id  values/block  bytes  value
//   Q5_0   6   32            22    d * (q - 16),  q 5 bits                  (fp16 d, qh[4], qs[16])
//   Q5_1   7   32            24    d * q + m,     q 5 bits                  (fp16 d, m, qh[4], qs[16])
//   Q2_K  10  256            84    d*sc * q - dmin*mn, q 2 bits, sc/mn 4 bits per 16 values
//   Q3_K  11  256           110    d*sc * (q - 4), q 3 bits (high bit inverted), sc 6 bits - 32 per 16
//   Q4_K  12  256           144    d*sc * q - dmin*mn, q 4 bits, sc/mn 6 bits per 32 values
//   Q5_K  13  256           176    as Q4_K with a fifth bit
//   Q6_K  14  256           210    d*sc * (q - 32), q 6 bits, sc int8 per 16 values
//
// Every type is first "unpacked", 256 values at a time (a super-block; for Q5_0 / Q5_1 eight blocks,
// the row's last group zero-padded), into one common form: unsigned codes u (0..63, value order),
// and per 16 values a scale s, an offset o and the type's constant bias c:
//   value = (s * float(u - c)) + o        (o = -0.0 where the type has none: adding it is exact)
// which is numpy's own order of fp32 operations for each type, so `kq_dequantize` matches
// `gguf.quants.dequantize` bit for bit (this file is compiled without contracting mul + add).
//
// The product then needs one generic kernel: with per-16 offset om = o - c * s,
//   out = sum over 16-value groups g of  s_g * dx * idot(u_g, qx_g)  +  om_g * dx * sum(qx_g)
// In batches a weight row is unpacked once per call into a small buffer (codes, s spread over the
// int32 lanes of the dot products, om), then multiplied by every activation row (32 weight rows x
// 16 activation rows at a time, for the caches); one activation row (decode) unpacks the weights
// in registers instead. AVX-512 VNNI: vpdpbusd over 64 codes (int32 lanes 0-3 = values 0-15, ...);
// AVX2: maddubs + madd over 32 (u <= 63, |qx| <= 127: no int16 saturation); both into one fp32
// vector accumulator per output (lane scale s * dx), the offsets one 16-lane multiply-add per
// super-block into the same accumulator, one horizontal sum per output. Every output is computed
// by the same operations in the same order whatever the batch or tile it falls in (rows alike),
// on each ISA; the ISAs differ from each other only in fp32 summation order.

#include "kquants.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

// Exact dequantization needs mul and add rounded separately (GCC fuses them otherwise); the
// kernels use explicit fused multiply-adds where they want them.
#pragma GCC optimize("fp-contract=off")

namespace kquants {

enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
enum Type { Q5_0 = 6, Q5_1 = 7, Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
constexpr int SB = 256;  // values per super-block
constexpr int GROUPS = SB / 16;

template <int TYPE>
constexpr bool LEGACY = TYPE == Q5_0 || TYPE == Q5_1;
template <int TYPE>
constexpr int BIAS = TYPE == Q3_K ? 4 : TYPE == Q6_K ? 32 : TYPE == Q5_0 ? 16 : 0;
// Bytes per block (32 values for the legacy types, 256 for the K-quants).
template <int TYPE>
constexpr int BYTES = TYPE == Q5_0   ? 22
                      : TYPE == Q5_1 ? 24
                      : TYPE == Q2_K ? 84
                      : TYPE == Q3_K ? 110
                      : TYPE == Q4_K ? 144
                      : TYPE == Q5_K ? 176
                                     : 210;

const char* const TYPE_LIST = "Q5_0 (6), Q5_1 (7), Q2_K (10), Q3_K (11), Q4_K (12), Q5_K (13), Q6_K (14)";

// (values, bytes) per block of a type here.
std::pair<int64_t, int64_t> block_of(int64_t type) {
  switch (type) {
    case Q5_0: return {32, 22};
    case Q5_1: return {32, 24};
    case Q2_K: return {256, 84};
    case Q3_K: return {256, 110};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
  }
  TORCH_CHECK(false, "GGML type ", type, " is not one of ", TYPE_LIST);
  return {0, 0};
}

std::vector<int64_t> kq_types() { return {Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K}; }

int64_t kq_row_bytes(int64_t type, int64_t k) {
  const auto [values, bytes] = block_of(type);
  TORCH_CHECK(k > 0 && k % values == 0, "K must be a positive multiple of ", values, " for GGML type ", type,
              ", got ", k);
  return k / values * bytes;
}

// f(std::integral_constant<int, type>()).
template <class F>
inline void with_type(int64_t type, F&& f) {
  switch (type) {
    case Q5_0: f(std::integral_constant<int, Q5_0>()); break;
    case Q5_1: f(std::integral_constant<int, Q5_1>()); break;
    case Q2_K: f(std::integral_constant<int, Q2_K>()); break;
    case Q3_K: f(std::integral_constant<int, Q3_K>()); break;
    case Q4_K: f(std::integral_constant<int, Q4_K>()); break;
    case Q5_K: f(std::integral_constant<int, Q5_K>()); break;
    default: f(std::integral_constant<int, Q6_K>()); break;
  }
}

int64_t checked_isa(int64_t isa) {
  const int64_t best = gguf_matmul::best_isa();
  TORCH_CHECK(isa >= -1 && isa <= ISA_AVX512, "isa must be -1 (best), 0 (scalar), 1 (AVX2) or 2 (AVX-512), got ",
              isa);
  TORCH_CHECK(isa <= best, "this CPU lacks ", isa == ISA_AVX512 ? "AVX-512 (F, BW, DQ, VL, VNNI)" : "AVX2+FMA+F16C",
              " (isa ", isa, ")");
  return isa < 0 ? best : isa;
}

// IEEE half -> float, every value (the scalar path; F16C in the vector ones).
inline float half_scalar(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t sign = uint32_t(h & 0x8000) << 16, man = h & 0x3FF;
  const int exp = (h >> 10) & 0x1F;
  uint32_t bits;
  if (exp == 31)
    bits = sign | 0x7F800000 | (man << 13);
  else if (exp != 0)
    bits = sign | (uint32_t(exp + 112) << 23) | (man << 13);
  else if (man == 0)
    bits = sign;
  else {  // subnormal: bring the top set bit to the implicit position
    const int shift = __builtin_clz(man) - 21;
    bits = sign | (uint32_t(113 - shift) << 23) | (((man << shift) & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t bf16_of(float f) {  // round to nearest even, as torch (finite values)
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Q4_K / Q5_K: the 8 six-bit scales and mins of a super-block from its 12 packed bytes.
inline void scale_min_k4(const uint8_t* q, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
    mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}

// Super-block sb of a row: per 16 values the scale s and offset o (numpy's operations, in fp32).
// `half` converts an fp16 at a pointer. nb32: the row's 32-blocks (the legacy types' last group).
template <int TYPE, class H>
inline void scales(const uint8_t* row, int64_t sb, int64_t nb32, float* s, float* o, H half) {
  if constexpr (LEGACY<TYPE>) {
    for (int b = 0; b < 8; ++b) {
      const int64_t blk = 8 * sb + b;
      float d = 0.f, m = TYPE == Q5_1 ? 0.f : -0.f;  // (zero past the row's end)
      if (blk < nb32) {
        const uint8_t* p = row + blk * BYTES<TYPE>;
        d = half(p);
        if constexpr (TYPE == Q5_1) m = half(p + 2);
      }
      s[2 * b] = s[2 * b + 1] = d;
      o[2 * b] = o[2 * b + 1] = m;
    }
  } else {
    const uint8_t* p = row + sb * BYTES<TYPE>;
    if constexpr (TYPE == Q2_K) {
      const float d = half(p + 80), dmin = half(p + 82);
      for (int i = 0; i < 16; ++i) {
        s[i] = d * float(p[i] & 15);
        o[i] = -(dmin * float(p[i] >> 4));
      }
    } else if constexpr (TYPE == Q3_K) {
      const float d = half(p + 108);
      const uint8_t* q = p + 96;
      for (int i = 0; i < 16; ++i) {
        const int lo = i < 8 ? q[i] & 15 : q[i - 8] >> 4, hi = (q[8 + i % 4] >> (2 * (i / 4))) & 3;
        s[i] = d * float((lo | (hi << 4)) - 32);
        o[i] = -0.f;
      }
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
      const float d = half(p), dmin = half(p + 2);
      uint8_t sc[8], mn[8];
      scale_min_k4(p + 4, sc, mn);
      for (int j = 0; j < 8; ++j) {
        s[2 * j] = s[2 * j + 1] = d * float(sc[j]);
        o[2 * j] = o[2 * j + 1] = -(dmin * float(mn[j]));
      }
    } else {  // Q6_K
      const float d = half(p + 208);
      for (int i = 0; i < 16; ++i) {
        s[i] = d * float(int8_t(p[192 + i]));
        o[i] = -0.f;
      }
    }
  }
}

// Super-block sb's 256 codes u in value order (plain C++).
template <int TYPE>
inline void codes_scalar(const uint8_t* row, int64_t sb, int64_t nb32, uint8_t* u) {
  if constexpr (LEGACY<TYPE>) {
    for (int b = 0; b < 8; ++b) {
      const int64_t blk = 8 * sb + b;
      uint8_t* ub = u + 32 * b;
      if (blk >= nb32) {
        std::memset(ub, 0, 32);
        continue;
      }
      const uint8_t* p = row + blk * BYTES<TYPE> + (TYPE == Q5_1 ? 4 : 2);
      uint32_t qh;
      std::memcpy(&qh, p, 4);
      const uint8_t* qs = p + 4;
      for (int j = 0; j < 32; ++j) {
        const int low = j < 16 ? qs[j] & 15 : qs[j - 16] >> 4;
        ub[j] = uint8_t(low | (((qh >> j) & 1) << 4));
      }
    }
  } else {
    const uint8_t* p = row + sb * BYTES<TYPE>;
    for (int j = 0; j < SB; ++j) {
      int v;
      if constexpr (TYPE == Q2_K) {
        v = (p[16 + 32 * (j / 128) + j % 32] >> (2 * ((j / 32) % 4))) & 3;
      } else if constexpr (TYPE == Q3_K) {
        const int low = (p[32 + 32 * (j / 128) + j % 32] >> (2 * ((j / 32) % 4))) & 3;
        v = low | (((p[j % 32] >> (j / 32)) & 1) << 2);
      } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
        const uint8_t* qs = p + (TYPE == Q4_K ? 16 : 48);
        v = (qs[32 * (j / 64) + j % 32] >> (4 * ((j / 32) % 2))) & 15;
        if constexpr (TYPE == Q5_K) v |= ((p[16 + j % 32] >> (j / 32)) & 1) << 4;
      } else {  // Q6_K
        const int h = j / 128, r = j % 128;
        const int low = (p[64 * h + r % 64] >> (4 * (r / 64))) & 15;
        v = low | (((p[128 + 32 * h + r % 32] >> (2 * (r / 32))) & 3) << 4);
      }
      u[j] = uint8_t(v);
    }
  }
}

// One weight row unpacked for the product: codes [Kp], s per int32 lane of the dot products
// (one per 4 codes) [Kp / 4], offsets om = o - c * s per 16 codes [Kp / 16].
struct RowBuf {
  uint8_t* u;
  float* sl;
  float* om;
};

template <int TYPE>
inline void finish_scales(const float* s, const float* o, int64_t sb, const RowBuf& r) {
  for (int i = 0; i < GROUPS; ++i) {
    r.om[GROUPS * sb + i] = BIAS<TYPE> ? -float(BIAS<TYPE>) * s[i] : o[i];
    for (int l = 0; l < 4; ++l) r.sl[64 * sb + 4 * i + l] = s[i];
  }
}

// x's side of the product, zero-padded to whole super-blocks: int8 q [M, Kp], dx per int32 lane
// [M, Kp / 4], dx * sum(q) per 16 values [M, Kp / 16].
struct XSide {
  const int8_t* q;
  const float* dxl;
  const float* sx16;
  int64_t Kp;
};

void row_scalar(const RowBuf& w, const XSide& x, int64_t r, int64_t nsb, float& out) {
  const int8_t* q = x.q + r * x.Kp;
  const float* dxl = x.dxl + r * x.Kp / 4;
  const float* sx = x.sx16 + r * x.Kp / 16;
  float acc = 0.f;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    for (int g = 0; g < GROUPS; ++g) {
      const int64_t at = sb * SB + 16 * g;
      int32_t dot = 0;
      for (int j = 0; j < 16; ++j) dot += int32_t(w.u[at + j]) * int32_t(q[at + j]);
      acc += float(dot) * (w.sl[at / 4] * dxl[at / 4]);
    }
    for (int g = 0; g < GROUPS; ++g) acc += w.om[GROUPS * sb + g] * sx[GROUPS * sb + g];
  }
  out = acc;
}

template <int TYPE>
void prepare_scalar(const uint8_t* row, int64_t nsb, int64_t nb32, const RowBuf& r) {
  for (int64_t sb = 0; sb < nsb; ++sb) {
    float s[GROUPS], o[GROUPS];
    codes_scalar<TYPE>(row, sb, nb32, r.u + sb * SB);
    scales<TYPE>(row, sb, nb32, s, o, half_scalar);
    finish_scales<TYPE>(s, o, sb, r);
  }
}

// Software prefetch for one activation row: the NR weight rows a pass reads side by side are
// counted as one linear stream, every line up to PREFETCH_BYTES past where the pass has read
// (as gguf_matmul.cpp's kernels: the hardware prefetcher follows interleaved rows poorly).
constexpr int64_t PREFETCH_BYTES = 4096;
struct Ahead {
  const char* next;
  const char* end;
  Ahead(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t n)
      : next(reinterpret_cast<const char*>(w + n * row_bytes) + PREFETCH_BYTES),
        end(reinterpret_cast<const char*>(w + rows * row_bytes)) {}
  inline void to(const uint8_t* read) {
    const char* target = reinterpret_cast<const char*>(read) + PREFETCH_BYTES;
    for (; next < target && next < end; next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

inline float half_f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline void store32(uint8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
// Byte-wise (v >> n) & mask: 16-bit shifts, the mask drops what crossed from the next byte.
inline __m256i bits(__m256i v, int n, int mask) {
  return _mm256_and_si256(_mm256_srli_epi16(v, n), _mm256_set1_epi8(char(mask)));
}

// Codes 32c..32c+31 of super-block sb (c = 0..7) in value order. Called with constant c in
// unrolled loops: the compiler shares the loads between chunks.
template <int TYPE>
inline __m256i chunk(const uint8_t* row, int64_t sb, int64_t nb32, int c) {
  if constexpr (LEGACY<TYPE>) {  // block 8 sb + c
    const int64_t blk = 8 * sb + c;
    if (blk >= nb32) return _mm256_setzero_si256();
    // The 32 high bits: byte j takes qh's byte j / 8, keeps bit j % 8, and becomes 16 where set.
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                                            3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
    const uint8_t* p = row + blk * BYTES<TYPE> + (TYPE == Q5_1 ? 4 : 2);
    int32_t qh;
    std::memcpy(&qh, p, 4);
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 4));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m256i low = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
    const __m256i hb = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(qh), spread), bit);
    return _mm256_or_si256(low, _mm256_and_si256(_mm256_cmpeq_epi8(hb, bit), _mm256_set1_epi8(16)));
  } else {
    const uint8_t* p = row + sb * BYTES<TYPE>;
    const int h = c / 4, t = c % 4;
    if constexpr (TYPE == Q2_K) {
      return bits(load32(p + 16 + 32 * h), 2 * t, 3);
    } else if constexpr (TYPE == Q3_K) {
      const __m256i high = _mm256_slli_epi16(bits(load32(p), c, 1), 2);  // bytes 0 / 1: no carry
      return _mm256_or_si256(bits(load32(p + 32 + 32 * h), 2 * t, 3), high);
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
      const __m256i low = bits(load32(p + (TYPE == Q4_K ? 16 : 48) + 32 * (c / 2)), 4 * (c % 2), 15);
      if constexpr (TYPE == Q4_K) return low;
      return _mm256_or_si256(low, _mm256_slli_epi16(bits(load32(p + 16), c, 1), 4));
    } else {  // Q6_K
      const __m256i low = bits(load32(p + 64 * h + 32 * (t % 2)), 4 * (t / 2), 15);
      return _mm256_or_si256(low, _mm256_slli_epi16(bits(load32(p + 128 + 32 * h), 2 * t, 3), 4));
    }
  }
}

// Super-block sb's 256 codes u in value order.
template <int TYPE>
inline void codes(const uint8_t* row, int64_t sb, int64_t nb32, uint8_t* u) {
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) store32(u + 32 * c, chunk<TYPE>(row, sb, nb32, c));
}

// Eight bytes as fp32 (unsigned or signed).
inline __m256 floats_u8(int64_t b8) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(b8))); }
inline __m256 floats_i8(int64_t b8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(b8))); }
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline int64_t load_i64(const uint8_t* p) {
  int64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

// `scales` (the same fp32 operations, so the same values) eight at a time: groups 0-7 in [0].
template <int TYPE>
inline void scales_vec(const uint8_t* row, int64_t sb, int64_t nb32, __m256 s[2], __m256 o[2]) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  // Per-32 values v[0..7] as per-16 pairs: [v0 v0 v1 v1 ...] (lo), [v4 v4 ... v7 v7] (hi).
  const __m256i pairs_lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), pairs_hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  auto pairs = [&](__m256 dst[2], __m256 v) {
    dst[0] = _mm256_permutevar8x32_ps(v, pairs_lo);
    dst[1] = _mm256_permutevar8x32_ps(v, pairs_hi);
  };
  if constexpr (LEGACY<TYPE>) {
    const int64_t have = std::min<int64_t>(8, nb32 - 8 * sb);  // the row's last group may be short
    const uint8_t* p = row + 8 * sb * BYTES<TYPE>;
    auto u16 = [&](int64_t b, int at) {
      uint16_t v;
      std::memcpy(&v, p + b * BYTES<TYPE> + at, 2);
      return short(v);
    };
    __m128i dh = _mm_setzero_si128(), mh = _mm_setzero_si128();
    if (have == 8) {  // each block's first 4 bytes (fp16 d, then m or qh) in one gather
      const __m256i g = _mm256_i32gather_epi32(reinterpret_cast<const int*>(p),
                                               _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                                                  _mm256_set1_epi32(BYTES<TYPE>)),
                                               1);
      const __m256i lo = _mm256_and_si256(g, _mm256_set1_epi32(0xFFFF));
      dh = _mm_packus_epi32(_mm256_castsi256_si128(lo), _mm256_extracti128_si256(lo, 1));
      if constexpr (TYPE == Q5_1) {
        const __m256i hi = _mm256_srli_epi32(g, 16);
        mh = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
      }
    } else {
      alignas(16) int16_t d8[8] = {}, m8[8] = {};
      for (int64_t b = 0; b < have; ++b) {
        d8[b] = u16(b, 0);
        if constexpr (TYPE == Q5_1) m8[b] = u16(b, 2);
      }
      dh = _mm_load_si128(reinterpret_cast<const __m128i*>(d8));
      mh = _mm_load_si128(reinterpret_cast<const __m128i*>(m8));
    }
    pairs(s, _mm256_cvtph_ps(dh));
    pairs(o, TYPE == Q5_1 ? _mm256_cvtph_ps(mh) : sign);
  } else {
    const uint8_t* p = row + sb * BYTES<TYPE>;
    if constexpr (TYPE == Q2_K) {
      const __m256 d = _mm256_set1_ps(half_f16c(p + 80)), dmin = _mm256_set1_ps(half_f16c(p + 82));
      const int64_t lo = load_i64(p), hi = load_i64(p + 8), m4 = 0x0F0F0F0F0F0F0F0Fll;
      s[0] = _mm256_mul_ps(d, floats_u8(lo & m4));
      s[1] = _mm256_mul_ps(d, floats_u8(hi & m4));
      o[0] = _mm256_xor_ps(sign, _mm256_mul_ps(dmin, floats_u8((lo >> 4) & m4)));
      o[1] = _mm256_xor_ps(sign, _mm256_mul_ps(dmin, floats_u8((hi >> 4) & m4)));
    } else if constexpr (TYPE == Q3_K) {
      // Scale i: low 4 bits from byte i (i < 8) or the high nibble of byte i - 8, high 2 bits
      // from byte 8 + i % 4 at bit 2 * (i / 4); four at a time in 32-bit words.
      const uint32_t a0 = load_u32(p + 96), a1 = load_u32(p + 100), a2 = load_u32(p + 104);
      const uint32_t k4 = 0x0F0F0F0F, k2 = 0x30303030;
      const uint32_t w0 = (a0 & k4) | ((a2 << 4) & k2), w1 = (a1 & k4) | ((a2 << 2) & k2);
      const uint32_t w2 = ((a0 >> 4) & k4) | (a2 & k2), w3 = ((a1 >> 4) & k4) | ((a2 >> 2) & k2);
      const __m256 d = _mm256_set1_ps(half_f16c(p + 108)), c32 = _mm256_set1_ps(32.f);
      // (sc - 32 exactly in fp32: small integers.)
      s[0] = _mm256_mul_ps(d, _mm256_sub_ps(floats_u8(int64_t(w0) | (int64_t(w1) << 32)), c32));
      s[1] = _mm256_mul_ps(d, _mm256_sub_ps(floats_u8(int64_t(w2) | (int64_t(w3) << 32)), c32));
      o[0] = sign;
      o[1] = sign;
    } else if constexpr (TYPE == Q4_K || TYPE == Q5_K) {
      const uint32_t a0 = load_u32(p + 4), a1 = load_u32(p + 8), a2 = load_u32(p + 12);
      const uint32_t k6 = 0x3F3F3F3F, k4 = 0x0F0F0F0F, k2 = 0x30303030;
      const uint32_t sc_hi = (a2 & k4) | ((a0 >> 2) & k2), mn_hi = ((a2 >> 4) & k4) | ((a1 >> 2) & k2);
      const __m256 d = _mm256_set1_ps(half_f16c(p)), dmin = _mm256_set1_ps(half_f16c(p + 2));
      pairs(s, _mm256_mul_ps(d, floats_u8(int64_t(a0 & k6) | (int64_t(sc_hi) << 32))));
      pairs(o, _mm256_xor_ps(sign, _mm256_mul_ps(dmin, floats_u8(int64_t(a1 & k6) | (int64_t(mn_hi) << 32)))));
    } else {  // Q6_K
      const __m256 d = _mm256_set1_ps(half_f16c(p + 208));
      s[0] = _mm256_mul_ps(d, floats_i8(load_i64(p + 192)));
      s[1] = _mm256_mul_ps(d, floats_i8(load_i64(p + 200)));
      o[0] = sign;
      o[1] = sign;
    }
  }
}

// The lane scales: s[i] over lanes 4i..4i+3 of the 64 per super-block.
inline void spread_scales(const __m256 s[2], float* sl) {
  for (int c = 0; c < 8; ++c) {
    const __m256i idx = _mm256_set_m128i(_mm_set1_epi32(2 * (c % 4) + 1), _mm_set1_epi32(2 * (c % 4)));
    _mm256_storeu_ps(sl + 8 * c, _mm256_permutevar8x32_ps(s[c / 4], idx));
  }
}

template <int TYPE>
void prepare(const uint8_t* row, int64_t nsb, int64_t nb32, const RowBuf& r) {
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m256 s[2], o[2];
    codes<TYPE>(row, sb, nb32, r.u + sb * SB);
    scales_vec<TYPE>(row, sb, nb32, s, o);
    for (int h = 0; h < 2; ++h)
      _mm256_storeu_ps(r.om + GROUPS * sb + 8 * h,
                       BIAS<TYPE> ? _mm256_mul_ps(_mm256_set1_ps(-float(BIAS<TYPE>)), s[h]) : o[h]);
    spread_scales(s, r.sl + 64 * sb);
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// NR unpacked weight rows x MR activation rows from r0; out [M, N] at column n.
template <int NR, int MR>
inline void tile(const RowBuf* w, const XSide& x, int64_t nsb, int64_t r0, float* out, int64_t N, int64_t n) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR][MR];
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) acc[a][r] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    for (int c = 0; c < 8; ++c) {
      const int64_t at = sb * SB + 32 * c;
      __m256i wq[NR];
      __m256 ws[NR];
      for (int a = 0; a < NR; ++a) {
        wq[a] = load32(w[a].u + at);
        ws[a] = _mm256_loadu_ps(w[a].sl + at / 4);
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t xr = r0 + r;
        const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + xr * x.Kp + at));
        const __m256 dx = _mm256_loadu_ps(x.dxl + xr * x.Kp / 4 + at / 4);
        for (int a = 0; a < NR; ++a) {
          const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq[a], xq), ones);
          acc[a][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws[a], dx), acc[a][r]);
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      __m256 om[NR];
      for (int a = 0; a < NR; ++a) om[a] = _mm256_loadu_ps(w[a].om + GROUPS * sb + 8 * h);
      for (int r = 0; r < MR; ++r) {
        const __m256 sx = _mm256_loadu_ps(x.sx16 + (r0 + r) * x.Kp / 16 + GROUPS * sb + 8 * h);
        for (int a = 0; a < NR; ++a) acc[a][r] = _mm256_fmadd_ps(om[a], sx, acc[a][r]);
      }
    }
  }
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) out[(r0 + r) * N + n + a] = hsum(acc[a][r]);
}

// One activation row (decode): NR weight rows unpacked in registers as they are read, no row
// buffer. The same codes, lane scales and offsets as `prepare` gives `tile`, and the same
// operations in the same order: a row's bits do not depend on whether it came alone.
template <int TYPE, int NR>
inline void decode(const uint8_t* w, int64_t row_bytes, int64_t nsb, int64_t nb32, const XSide& x, float* out,
                   int64_t n, Ahead& ahead) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[NR];
  for (int a = 0; a < NR; ++a) acc[a] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    ahead.to(w + n * row_bytes + NR * (sb + 1) * row_bytes / nsb);
    __m256 s[NR][2], om[NR][2];
    for (int a = 0; a < NR; ++a) {
      scales_vec<TYPE>(w + (n + a) * row_bytes, sb, nb32, s[a], om[a]);
      if constexpr (BIAS<TYPE> != 0)
        for (int h = 0; h < 2; ++h) om[a][h] = _mm256_mul_ps(_mm256_set1_ps(-float(BIAS<TYPE>)), s[a][h]);
    }
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) {
      const int64_t at = sb * SB + 32 * c;
      const __m256i xq = load32(reinterpret_cast<const uint8_t*>(x.q) + at);
      const __m256 dx = _mm256_loadu_ps(x.dxl + at / 4);
      const __m256i idx = _mm256_set_m128i(_mm_set1_epi32(2 * (c % 4) + 1), _mm_set1_epi32(2 * (c % 4)));
      for (int a = 0; a < NR; ++a) {
        const __m256i wq = chunk<TYPE>(w + (n + a) * row_bytes, sb, nb32, c);
        const __m256 ws = _mm256_permutevar8x32_ps(s[a][c / 4], idx);
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq), ones);
        acc[a] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(ws, dx), acc[a]);
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 sx = _mm256_loadu_ps(x.sx16 + GROUPS * sb + 8 * h);
      for (int a = 0; a < NR; ++a) acc[a] = _mm256_fmadd_ps(om[a][h], sx, acc[a]);
    }
  }
  for (int a = 0; a < NR; ++a) out[n + a] = hsum(acc[a]);
}

// Eight fp32 values -> bf16 bits, rounded to nearest even.
inline __m128i to_bf16(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Rows [n0, n1) of W as fp32 (OUT float) or bf16 bits (OUT uint16_t), eight values at a time.
template <int TYPE, class OUT>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, int64_t k, OUT* out, int64_t n0, int64_t n1) {
  const int64_t nsb = (k + SB - 1) / SB, nb32 = k / 32;
  alignas(32) uint8_t u[SB];
  float s[GROUPS], o[GROUPS];
  const __m256i bias = _mm256_set1_epi32(BIAS<TYPE>);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      codes<TYPE>(row, sb, nb32, u);
      __m256 sv[2], ov[2];
      scales_vec<TYPE>(row, sb, nb32, sv, ov);
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(s + 8 * h, sv[h]), _mm256_storeu_ps(o + 8 * h, ov[h]);
      const int64_t count = std::min<int64_t>(SB, k - sb * SB);
      OUT* dst = out + n * k + sb * SB;
      for (int64_t j = 0; j < count; j += 8) {
        int64_t u8;
        std::memcpy(&u8, u + j, 8);
        const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(u8)), bias));
        const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(s[j / 16]), q), _mm256_set1_ps(o[j / 16]));
        if constexpr (std::is_same_v<OUT, float>)
          _mm256_storeu_ps(dst + j, v);
        else
          _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), to_bf16(v));
      }
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace avx512 {

// As avx2::tile, 64 codes per vpdpbusd; the 16 offsets of a super-block in one multiply-add.
template <int NR, int MR>
inline void tile(const RowBuf* w, const XSide& x, int64_t nsb, int64_t r0, float* out, int64_t N, int64_t n) {
  __m512 acc[NR][MR];
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) acc[a][r] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    for (int c = 0; c < 4; ++c) {
      const int64_t at = sb * SB + 64 * c;
      __m512i wq[NR];
      __m512 ws[NR];
      for (int a = 0; a < NR; ++a) {
        wq[a] = _mm512_loadu_si512(w[a].u + at);
        ws[a] = _mm512_loadu_ps(w[a].sl + at / 4);
      }
      for (int r = 0; r < MR; ++r) {
        const int64_t xr = r0 + r;
        const __m512i xq = _mm512_loadu_si512(x.q + xr * x.Kp + at);
        const __m512 dx = _mm512_loadu_ps(x.dxl + xr * x.Kp / 4 + at / 4);
        for (int a = 0; a < NR; ++a) {
          const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[a], xq);
          acc[a][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws[a], dx), acc[a][r]);
        }
      }
    }
    __m512 om[NR];
    for (int a = 0; a < NR; ++a) om[a] = _mm512_loadu_ps(w[a].om + GROUPS * sb);
    for (int r = 0; r < MR; ++r) {
      const __m512 sx = _mm512_loadu_ps(x.sx16 + (r0 + r) * x.Kp / 16 + GROUPS * sb);
      for (int a = 0; a < NR; ++a) acc[a][r] = _mm512_fmadd_ps(om[a], sx, acc[a][r]);
    }
  }
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) out[(r0 + r) * N + n + a] = _mm512_reduce_add_ps(acc[a][r]);
}

// Codes 64c..64c+63 of super-block sb. The legacy types' fifth bits of two blocks at once through
// a mask register: the same bytes as avx2::chunk's, in fewer instructions.
template <int TYPE>
inline __m512i chunk64(const uint8_t* row, int64_t sb, int64_t nb32, int c) {
  if constexpr (LEGACY<TYPE>) {
    const int64_t blk = 8 * sb + 2 * c;
    if (blk + 1 >= nb32)  // the row's last block, or past it: one block or none
      return _mm512_inserti64x4(_mm512_castsi256_si512(avx2::chunk<TYPE>(row, sb, nb32, 2 * c)),
                                avx2::chunk<TYPE>(row, sb, nb32, 2 * c + 1), 1);
    const uint8_t* p0 = row + blk * BYTES<TYPE> + (TYPE == Q5_1 ? 4 : 2);
    const uint8_t* p1 = p0 + BYTES<TYPE>;
    uint32_t h0, h1;
    std::memcpy(&h0, p0, 4);
    std::memcpy(&h1, p1, 4);
    // Each block's 16 code bytes in two 128-bit lanes, [b | b | b+1 | b+1]: low nibbles of lanes
    // 0 and 2, high nibbles of lanes 1 and 3 are the values in order.
    const __m512i both = _mm512_mask_blend_epi64(
        0xF0, _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p0 + 4))),
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p1 + 4))));
    const __m512i nib = _mm512_and_si512(_mm512_mask_mov_epi8(both, 0xFFFF0000FFFF0000ull, _mm512_srli_epi16(both, 4)),
                                         _mm512_set1_epi8(0x0F));
    return _mm512_mask_add_epi8(nib, _cvtu64_mask64(uint64_t(h0) | (uint64_t(h1) << 32)), nib, _mm512_set1_epi8(16));
  } else {
    return _mm512_inserti64x4(_mm512_castsi256_si512(avx2::chunk<TYPE>(row, sb, nb32, 2 * c)),
                              avx2::chunk<TYPE>(row, sb, nb32, 2 * c + 1), 1);
  }
}

// As avx2::decode: the 64 codes of a vpdpbusd at once, the lane scales spread from the 16 per
// super-block by one permute.
template <int TYPE, int NR>
inline void decode(const uint8_t* w, int64_t row_bytes, int64_t nsb, int64_t nb32, const XSide& x, float* out,
                   int64_t n, Ahead& ahead) {
  __m512 acc[NR];
  for (int a = 0; a < NR; ++a) acc[a] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < nsb; ++sb) {
    ahead.to(w + n * row_bytes + NR * (sb + 1) * row_bytes / nsb);
    __m512 s[NR], om[NR];
    for (int a = 0; a < NR; ++a) {
      __m256 sv[2], ov[2];
      avx2::scales_vec<TYPE>(w + (n + a) * row_bytes, sb, nb32, sv, ov);
      s[a] = _mm512_insertf32x8(_mm512_castps256_ps512(sv[0]), sv[1], 1);
      // (the 256-bit multiply of `prepare`, lane for lane the same rounding)
      om[a] = BIAS<TYPE> ? _mm512_mul_ps(_mm512_set1_ps(-float(BIAS<TYPE>)), s[a])
                         : _mm512_insertf32x8(_mm512_castps256_ps512(ov[0]), ov[1], 1);
    }
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      const int64_t at = sb * SB + 64 * c;
      const __m512i xq = _mm512_loadu_si512(x.q + at);
      const __m512 dx = _mm512_loadu_ps(x.dxl + at / 4);
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * c),
                                           _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
      for (int a = 0; a < NR; ++a) {
        const uint8_t* row = w + (n + a) * row_bytes;
        const __m512i wq = chunk64<TYPE>(row, sb, nb32, c);
        const __m512 ws = _mm512_permutexvar_ps(idx, s[a]);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq);
        acc[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(ws, dx), acc[a]);
      }
    }
    const __m512 sx = _mm512_loadu_ps(x.sx16 + GROUPS * sb);
    for (int a = 0; a < NR; ++a) acc[a] = _mm512_fmadd_ps(om[a], sx, acc[a]);
  }
  for (int a = 0; a < NR; ++a) out[n + a] = _mm512_reduce_add_ps(acc[a]);
}

}  // namespace avx512
#pragma GCC pop_options

// Activation rows [r0, r1) in tiles of 4 and one of the rest (MR a compile-time constant).
template <class Tile>
inline void row_tiles(int64_t r0, int64_t r1, Tile&& tile) {
  int64_t r = r0;
  for (; r + 4 <= r1; r += 4) tile(std::integral_constant<int, 4>(), r);
  switch (r1 - r) {
    case 3: tile(std::integral_constant<int, 3>(), r); break;
    case 2: tile(std::integral_constant<int, 2>(), r); break;
    case 1: tile(std::integral_constant<int, 1>(), r); break;
    default: break;
  }
}

struct Problem {
  const uint8_t* w;
  int64_t row_bytes, nsb, nb32, M, N;
  XSide x;
  float* out;
};

// Weight rows [n0, n1): NR at a time unpacked, then multiplied by every activation row.
// NR unpacked weight rows times activation rows [r0, r1) into out [M, ldo] at column col.
template <int NR>
void rows_nr(const Problem& p, int64_t isa, const RowBuf* buf, int64_t r0, int64_t r1, float* out, int64_t ldo,
             int64_t col) {
  if (isa >= ISA_AVX512) {
    row_tiles(r0, r1, [&](auto mr, int64_t r) { avx512::tile<NR, decltype(mr)::value>(buf, p.x, p.nsb, r, out, ldo, col); });
  } else if (isa >= ISA_AVX2) {
    row_tiles(r0, r1, [&](auto mr, int64_t r) { avx2::tile<NR, decltype(mr)::value>(buf, p.x, p.nsb, r, out, ldo, col); });
  } else {
    for (int a = 0; a < NR; ++a)
      for (int64_t r = r0; r < r1; ++r) row_scalar(buf[a], p.x, r, p.nsb, out[r * ldo + col + a]);
  }
}

template <int TYPE, int NR>
inline void decode(const Problem& p, int64_t isa, int64_t n, Ahead& ahead) {
  if (isa >= ISA_AVX512)
    avx512::decode<TYPE, NR>(p.w, p.row_bytes, p.nsb, p.nb32, p.x, p.out, n, ahead);
  else
    avx2::decode<TYPE, NR>(p.w, p.row_bytes, p.nsb, p.nb32, p.x, p.out, n, ahead);
}

template <int TYPE>
void rows(const Problem& p, int64_t isa, int64_t n0, int64_t n1) {
  if (p.M == 1 && isa >= ISA_AVX2) {  // decode: four weight rows at a time, unpacked in registers
    Ahead ahead(p.w, p.row_bytes, p.N, n0);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) decode<TYPE, 4>(p, isa, n, ahead);
    for (; n < n1; ++n) decode<TYPE, 1>(p, isa, n, ahead);
    return;
  }
  // COLS weight rows at a time are unpacked (Kp codes, Kp / 4 lane scales, Kp / 16 offsets
  // each), then multiplied by ROWS activation rows at a time, so that x's side of a chunk of rows
  // stays in L1 while the unpacked weights pass over it (with all rows at once, a 32-row batch ran
  // 3-4x slower per output as soon as the weights no longer fitted in L2). Outputs are gathered
  // per block and written as whole row pieces (straight into out, a tile's column of outputs lies
  // N floats apart, and at N of a few thousand those lines alias in the caches).
  constexpr int64_t COLS = 32, ROWS = 16;
  const int64_t Kp = p.nsb * SB, per_row = Kp / 4 + Kp / 16;
  std::vector<uint8_t> code_bytes(COLS * Kp);
  std::vector<float> floats(COLS * per_row), block(p.M * COLS);
  RowBuf buf[COLS];
  for (int64_t a = 0; a < COLS; ++a)
    buf[a] = {code_bytes.data() + a * Kp, floats.data() + a * per_row, floats.data() + a * per_row + Kp / 4};
  const int wide = isa >= ISA_AVX512 || p.M == 1 ? 4 : 2;  // (AVX-512 has registers for 4 x 4 tiles)
  for (int64_t c0 = n0; c0 < n1; c0 += COLS) {
    const int64_t c1 = std::min(n1, c0 + COLS);
    for (int64_t n = c0; n < c1; ++n) {
      const uint8_t* row = p.w + n * p.row_bytes;
      if (isa >= ISA_AVX2)
        avx2::prepare<TYPE>(row, p.nsb, p.nb32, buf[n - c0]);
      else
        prepare_scalar<TYPE>(row, p.nsb, p.nb32, buf[n - c0]);
    }
    for (int64_t r0 = 0; r0 < p.M; r0 += ROWS) {
      const int64_t r1 = std::min(p.M, r0 + ROWS);
      int64_t n = c0;
      if (wide == 4)
        for (; n + 4 <= c1; n += 4) rows_nr<4>(p, isa, buf + (n - c0), r0, r1, block.data(), COLS, n - c0);
      else
        for (; n + 2 <= c1; n += 2) rows_nr<2>(p, isa, buf + (n - c0), r0, r1, block.data(), COLS, n - c0);
      for (; n < c1; ++n) rows_nr<1>(p, isa, buf + (n - c0), r0, r1, block.data(), COLS, n - c0);
    }
    for (int64_t r = 0; r < p.M; ++r) std::memcpy(p.out + r * p.N + c0, block.data() + r * COLS, (c1 - c0) * 4);
  }
}

void check_weight(const torch::Tensor& w, int64_t type, int64_t k) {
  const int64_t bytes = kq_row_bytes(type, k);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous CPU uint8 tensor [N, bytes per row]");
  TORCH_CHECK(w.size(1) == bytes, "w rows hold ", w.size(1), " bytes; K = ", k, " needs ", bytes);
}

torch::Tensor kq_matmul_q8(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU float32 tensor [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, type, K);
  isa = checked_isa(isa);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // x rounded per 32-block exactly as gguf_matmul_q8 rounds it, then laid out padded.
  const auto qx = gguf_matmul::quantize_q8(x, isa);
  const int64_t nb32 = K / 32, nsb = (K + SB - 1) / SB, Kp = nsb * SB;
  auto xq = torch::zeros({M, Kp}, x.options().dtype(torch::kInt8));
  auto xf = torch::zeros({M, Kp / 4 + Kp / 16}, x.options());
  {
    const int8_t* q = qx[0].data_ptr<int8_t>();
    const float* dx = qx[1].data_ptr<float>();
    int8_t* dq = xq.data_ptr<int8_t>();
    float* f = xf.data_ptr<float>();
    for (int64_t r = 0; r < M; ++r) {
      std::memcpy(dq + r * Kp, q + r * K, K);
      float* dxl = f + r * (Kp / 4);
      float* sx16 = f + M * (Kp / 4) + r * (Kp / 16);
      for (int64_t b = 0; b < nb32; ++b) {
        const float d = dx[r * nb32 + b];
        int32_t lo = 0, hi = 0;
        for (int j = 0; j < 16; ++j) lo += q[r * K + 32 * b + j], hi += q[r * K + 32 * b + 16 + j];
        for (int l = 0; l < 8; ++l) dxl[8 * b + l] = d;
        sx16[2 * b] = d * float(lo);
        sx16[2 * b + 1] = d * float(hi);
      }
    }
  }
  // (xf holds [M, Kp / 4] lane scales, then [M, Kp / 16] offset sums.)
  const float* f = xf.data_ptr<float>();
  Problem p{w.data_ptr<uint8_t>(), w.size(1), nsb, nb32, M, N, {xq.data_ptr<int8_t>(), f, f + M * (Kp / 4), Kp},
            out.data_ptr<float>()};
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    with_type(type, [&](auto t) { rows<decltype(t)::value>(p, isa, n0, n1); });
  });
  return out;
}

// Q4_K panels (gguf_pack_panels, gguf_matmul.cpp's layout: per 16 rows and super-block, 8 blocks
// of codes in Q4's panel layout, 256 bytes each, then the rows' scales as bytes (block t: 16
// bytes, row c at 16t + c), their mins likewise, d and dmin as fp16 bits, 2368 bytes): rows
// [r0, r1) dequantized into `into` (fp32 or bf16 [r1 - r0, k]) with exactly kq_dequantize's
// operations, so the values are the blocks' bit for bit (the slabs of a layer kept as panels).
// Q5_K panels: the same with each block's codes followed by their fifth bits as 8 64-bit masks
// (Q5_0's: mask 2j + h for panel vector j's low (h 0) or high nibbles, bit 4c + i): 320 bytes a
// block, the scales from 2560, 2880 bytes.
// Q6_K panels likewise (gguf_matmul.cpp): per block t 384 bytes (Q4's 256 bytes of the codes' low
// 4 bits, then bits 4 and 5 as masks: 32 bytes per panel vector j, the low-nibble values' bit 4,
// bit 5, the high-nibble values' bit 4, bit 5, bit 4c + i for row c), then the rows' int8 scales
// (group g: 16 bytes, row c at 16g + c), then d as fp16 bits: 3360 bytes.
namespace q6k_panel {
constexpr int64_t SUPER = 3360, SCALES = 3072, D = 3328;
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
// 32 bits (value order) as bytes: `value` where set.
inline __m256i bit_bytes(uint32_t bits, char value) {
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
  const __m256i picked = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(picked, bit), _mm256_set1_epi8(value));
}

// 32 codes (values 0-31 of a block, bytes in value order) -> (s_lo or s_hi) * float(u - bias) + o into
// dst (values 0-15 with s_lo, 16-31 with s_hi), kq_dequantize's operations; all in registers (a
// store of the codes and narrower loads back stalled the store forwarding).
template <class OUT>
inline void write32(__m256i codes, int bias, float s_lo, float s_hi, float o, OUT* dst) {
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
  const __m256i b = _mm256_set1_epi32(bias);
  for (int j = 0; j < 4; ++j) {
    const __m128i bytes = j % 2 ? _mm_srli_si128(halves[j / 2], 8) : halves[j / 2];
    const __m256 q = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_cvtepu8_epi32(bytes), b));
    const __m256 value = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(j < 2 ? s_lo : s_hi), q), _mm256_set1_ps(o));
    if constexpr (std::is_same_v<OUT, float>)
      _mm256_storeu_ps(dst + 8 * j, value);
    else
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 8 * j), to_bf16(value));
  }
}

template <bool FIVE, class OUT>
void panel_rows_q4_k(const uint8_t* packed, int64_t panel_bytes, int64_t k, int64_t r0, int64_t r1, OUT* out) {
  constexpr int64_t CODES = FIVE ? 320 : 256, SCALES = 8 * CODES, MINS = SCALES + 128, D = SCALES + 256,
                    DMIN = SCALES + 288, SUPER = SCALES + 320;
  const int64_t nsb = k / SB;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t n = r0; n < r1; ++n) {
    const int64_t c = n % 16;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* sup = packed + (n / 16) * panel_bytes + sb * SUPER;
      const float d = half_f16c(sup + D + 2 * c), dmin = half_f16c(sup + DMIN + 2 * c);
      for (int t = 0; t < 8; ++t) {
        const float s = d * float(sup[SCALES + 16 * t + c]), o = -(dmin * float(sup[MINS + 16 * t + c]));
        // Row c's 4 bytes of each of the block's 4 panel vectors: values 4j..4j+3 (low nibbles)
        // and 16 + 4j.. (high), so the 16 bytes' low nibbles are values 0-15 in order.
        const uint8_t* v = sup + CODES * t + 4 * c;
        const __m128i raw = _mm_setr_epi32(int(load_u32(v)), int(load_u32(v + 64)), int(load_u32(v + 128)),
                                           int(load_u32(v + 192)));
        __m256i codes = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        if constexpr (FIVE) {  // row c's nibble of each mask 2j + h: values 16h + 4j.. 's fifth bits
          const uint8_t* masks = sup + CODES * t + 256;
          const __m256i at = _mm256_set1_epi64x(4 * c), nib = _mm256_set1_epi64x(15);
          const __m256i w0 = _mm256_and_si256(_mm256_srlv_epi64(load32(masks), at), nib);
          const __m256i w1 = _mm256_and_si256(_mm256_srlv_epi64(load32(masks + 32), at), nib);
          const __m256i both = _mm256_or_si256(_mm256_sllv_epi64(w0, _mm256_setr_epi64x(0, 16, 4, 20)),
                                               _mm256_sllv_epi64(w1, _mm256_setr_epi64x(8, 24, 12, 28)));
          const __m128i half2 = _mm_or_si128(_mm256_castsi256_si128(both), _mm256_extracti128_si256(both, 1));
          const uint32_t b5 = uint32_t(_mm_cvtsi128_si64(_mm_or_si128(half2, _mm_unpackhi_epi64(half2, half2))));
          codes = _mm256_or_si256(codes, bit_bytes(b5, 16));
        }
        write32(codes, 0, s, s, o, out + (n - r0) * k + sb * SB + 32 * t);
      }
    }
  }
}

template <class OUT>
void panel_rows_q6_k(const uint8_t* packed, int64_t panel_bytes, int64_t k, int64_t r0, int64_t r1, OUT* out) {
  using namespace q6k_panel;
  const int64_t nsb = k / SB;
  const __m128i m4 = _mm_set1_epi8(0x0F);
  for (int64_t n = r0; n < r1; ++n) {
    const int64_t c = n % 16;
    for (int64_t sb = 0; sb < nsb; ++sb) {
      const uint8_t* sup = packed + (n / 16) * panel_bytes + sb * SUPER;
      const float d = half_f16c(sup + D + 2 * c);
      for (int t = 0; t < 8; ++t) {
        const uint8_t* blk = sup + 384 * t;
        const uint8_t* v = blk + 4 * c;
        const __m128i raw = _mm_setr_epi32(int(load_u32(v)), int(load_u32(v + 64)), int(load_u32(v + 128)),
                                           int(load_u32(v + 192)));
        // Bits 4 and 5 of values 0-31: row c's nibble (bits 4c..4c+3) of each mask, value
        // 16h + 4j + i from vector j's masks (bit 4, bit 5 of the low nibbles, then the high's).
        const __m256i at = _mm256_set1_epi64x(4 * c), nib = _mm256_set1_epi64x(15);
        __m256i acc = _mm256_setzero_si256();
        for (int j = 0; j < 4; ++j) {
          const __m256i w = _mm256_and_si256(_mm256_srlv_epi64(load32(blk + 256 + 32 * j), at), nib);
          acc = _mm256_or_si256(acc, _mm256_sllv_epi64(w, _mm256_setr_epi64x(4 * j, 4 * j, 16 + 4 * j, 16 + 4 * j)));
        }
        const __m128i pair = _mm_or_si128(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
        const uint32_t b4 = uint32_t(_mm_cvtsi128_si64(pair)), b5 = uint32_t(_mm_extract_epi64(pair, 1));
        const __m256i low = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
        const __m256i codes = _mm256_or_si256(low, _mm256_or_si256(bit_bytes(b4, 16), bit_bytes(b5, 32)));
        const float s_lo = d * float(int8_t(sup[SCALES + 16 * (2 * t) + c]));
        const float s_hi = d * float(int8_t(sup[SCALES + 16 * (2 * t + 1) + c]));
        write32(codes, 32, s_lo, s_hi, -0.f, out + (n - r0) * k + sb * SB + 32 * t);
      }
    }
  }
}
}  // namespace avx2
#pragma GCC pop_options

torch::Tensor kq_panel_dequantize(const torch::Tensor& packed, int64_t type, int64_t k, int64_t r0, int64_t r1,
                                  torch::Tensor into) {
  TORCH_CHECK(type == Q4_K || type == Q5_K || type == Q6_K,
              "kq_panel_dequantize reads Q4_K (12), Q5_K (13) or Q6_K (14) panels, got type ", type);
  TORCH_CHECK(k > 0 && k % SB == 0, "K must be a positive multiple of 256 for the K-quants, got ", k);
  TORCH_CHECK(gguf_matmul::best_isa() >= ISA_AVX2, "kq_panel_dequantize needs AVX2 (as the panels)");
  const int64_t panel_bytes = k / SB * (type == Q4_K ? 2368 : type == Q5_K ? 2880 : q6k_panel::SUPER);
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                  packed.dim() == 2 && packed.size(1) == panel_bytes,
              "packed must be gguf_pack_panels' output for K = ", k);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= packed.size(0) * 16, "rows [", r0, ", ", r1, ") are not in the panels");
  TORCH_CHECK(into.device().is_cpu() &&
                  (into.scalar_type() == torch::kFloat32 || into.scalar_type() == torch::kBFloat16) &&
                  into.is_contiguous() && into.dim() == 2 && into.size(0) == r1 - r0 && into.size(1) == k,
              "into must be a contiguous CPU float32 or bfloat16 tensor [", r1 - r0, ", ", k, "]");
  const uint8_t* src = packed.data_ptr<uint8_t>();
  const bool bf16 = into.scalar_type() == torch::kBFloat16;
  at::parallel_for(r0, r1, 16, [&](int64_t n0, int64_t n1) {
    uint16_t* o16 = bf16 ? reinterpret_cast<uint16_t*>(into.data_ptr<at::BFloat16>()) + (n0 - r0) * k : nullptr;
    float* o32 = bf16 ? nullptr : into.data_ptr<float>() + (n0 - r0) * k;
    if (type == Q4_K)
      bf16 ? avx2::panel_rows_q4_k<false>(src, panel_bytes, k, n0, n1, o16)
           : avx2::panel_rows_q4_k<false>(src, panel_bytes, k, n0, n1, o32);
    else if (type == Q5_K)
      bf16 ? avx2::panel_rows_q4_k<true>(src, panel_bytes, k, n0, n1, o16)
           : avx2::panel_rows_q4_k<true>(src, panel_bytes, k, n0, n1, o32);
    else
      bf16 ? avx2::panel_rows_q6_k(src, panel_bytes, k, n0, n1, o16) : avx2::panel_rows_q6_k(src, panel_bytes, k, n0, n1, o32);
  });
  return into;
}

torch::Tensor kq_dequantize(const torch::Tensor& w, int64_t type, int64_t k, std::optional<torch::Tensor> into,
                            int64_t isa) {
  check_weight(w, type, k);
  isa = checked_isa(isa);
  const int64_t N = w.size(0);
  torch::Tensor out;
  if (into) {
    out = *into;
    TORCH_CHECK(out.device().is_cpu() &&
                    (out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16) &&
                    out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == k,
                "into must be a contiguous CPU float32 or bfloat16 tensor [", N, ", ", k, "]");
  } else {
    out = torch::empty({N, k}, torch::kFloat32);
  }
  const uint8_t* src = w.data_ptr<uint8_t>();
  const int64_t rb = w.size(1);
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  float* dst = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* dst16 = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    with_type(type, [&](auto t) {
      constexpr int TYPE = decltype(t)::value;
      if (isa >= ISA_AVX2) {
        if (bf16)
          avx2::dequantize_rows<TYPE>(src, rb, k, dst16, n0, n1);
        else
          avx2::dequantize_rows<TYPE>(src, rb, k, dst, n0, n1);
        return;
      }
      const int64_t nsb = (k + SB - 1) / SB, nb32 = k / 32;
      uint8_t u[SB];
      float s[GROUPS], o[GROUPS];
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t sb = 0; sb < nsb; ++sb) {
          codes_scalar<TYPE>(src + n * rb, sb, nb32, u);
          scales<TYPE>(src + n * rb, sb, nb32, s, o, half_scalar);
          const int64_t count = std::min<int64_t>(SB, k - sb * SB);
          for (int64_t j = 0; j < count; ++j) {
            const float v = (s[j / 16] * float(int(u[j]) - BIAS<TYPE>)) + o[j / 16];
            if (bf16)
              dst16[n * k + sb * SB + j] = bf16_of(v);
            else
              dst[n * k + sb * SB + j] = v;
          }
        }
    });
  });
  return out;
}

}  // namespace kquants
