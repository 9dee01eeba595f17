// int8 weight-only matmul on the CPU for lmstack-int8: out[M, N] = x[M, K] @ (q[N, K] * scale[N])^T
// with fp32 activations and fp32 accumulation.
//
// Why it exists: torch's `_weight_int8pack_mm` has a fast path for bf16 activations only; an fp32
// stack (the default where the CPU lacks native bf16) had to round activations to bf16 or
// dequantize the whole weight per call. Decode is bound by reading weights, so this kernel reads
// each int8 weight row once per tile of activation rows, widens it to fp32 in registers and
// multiplies by the fp32 activations: 1 byte per weight from memory, no rounding of x.
//
// `int8_matmul_q8` is the llama.cpp way instead (the quantizer's `activations: int8`): each 32
// values of an x row are first rounded to int8 with one fp32 scale (dx = max|x| / 127, xq =
// round(x / dx)), and an output is scale[n] * sum over blocks of dx * idot(q, xq), the integer
// dot products 32 pairs at a time (AVX2 maddubs + madd). At one row the fp32 path is bound by
// its arithmetic on an AVX2 CPU (widening 8 weights costs 3 instructions per multiply-add: the
// same GB/s with the weights in cache as streaming from memory); this one spends about 7
// instructions per 32 weights. The price is x's rounding (relative error ~1 / 254 per value
// before the sums average it out).
//
// Layout: a tile is NR consecutive weight rows x MR activation rows, MR * NR vector accumulators;
// threads split the weight rows (at::parallel_for, so torch's thread count applies). Three
// implementations: AVX-512F (16 lanes), AVX2+FMA (8 lanes) and plain C++, picked at run time from
// what the CPU reports, or forced by the caller (tests); the int8-activation kernel has an
// AVX-512 VNNI version (one vpdpbusd per 64 weights) where the CPU has it, else the AVX2 one.

#include <torch/extension.h>

#include "isa_cap.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace int8_matmul {

// ISA_AVX512_VNNI changes only the int8-activation kernel; the fp32 one runs its AVX-512 code.
enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2, ISA_AVX512_VNNI = 3 };

int64_t best_isa() {  // what the CPU has, within LMSTACK_MAX_ISA (isa_cap.h)
  __builtin_cpu_init();
  int64_t found = ISA_SCALAR;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma"))
    found = __builtin_cpu_supports("avx512vnni") ? ISA_AVX512_VNNI : ISA_AVX512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    found = ISA_AVX2;
  return std::min(found, lmstack::isa_cap());
}

struct Problem {
  const float* x;
  int64_t ldx;  // row stride of x (elements)
  const int8_t* q;
  const float* scale;
  float* out;
  int64_t M, N, K;
};

// Weight rows [n0, n1) for every activation row.
void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.q + n * p.K;
    for (int64_t m = 0; m < p.M; ++m) {
      const float* xm = p.x + m * p.ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < p.K; ++k) acc += xm[k] * float(w[k]);
      p.out[m * p.N + n] = acc * p.scale[n];
    }
  }
}

// --- int8 activations ----------------------------------------------------------------------

constexpr int64_t QB = 32;  // x values per int8 block

struct Q8Problem {
  const int8_t* qx;  // x rounded, [M, K]
  const float* dx;  // one scale per 32-block of x, [M, K / QB]
  const int8_t* q;
  const float* scale;
  float* out;
  int64_t M, N, K;
};

// One block of x: dx = max|x| / 127, q = round-half-even(x * (1 / dx)) (as the AVX2 version).
void quantize_block_scalar(const float* x, int8_t* q, float& dx) {
  float amax = 0.f;
  for (int64_t i = 0; i < QB; ++i) amax = std::max(amax, std::fabs(x[i]));
  dx = amax / 127.f;
  const float id = dx != 0.f ? 1.f / dx : 0.f;
  for (int64_t i = 0; i < QB; ++i) q[i] = int8_t(std::nearbyint(x[i] * id));
}

void rows_q8_scalar(const Q8Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QB;
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* w = p.q + n * p.K;
    for (int64_t m = 0; m < p.M; ++m) {
      const int8_t* xq = p.qx + m * p.K;
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        int32_t dot = 0;
        for (int64_t k = b * QB; k < (b + 1) * QB; ++k) dot += int32_t(xq[k]) * int32_t(w[k]);
        acc = std::fma(float(dot), p.dx[m * nb + b], acc);
      }
      p.out[m * p.N + n] = acc * p.scale[n];
    }
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {

// Software prefetch runs this many bytes ahead of the tile being read. On the 2-core AVX2 EPYC
// VM this was measured on, the hardware prefetcher alone streamed decode weights at ~6 GB/s;
// prefetching 16 rows ahead of each of the tile's rows reached ~11.5 GB/s, and one linear
// stream over the tile's bytes (a tile's NR rows are contiguous) ~14-16 GB/s (2 KB ahead 13-15,
// 4 KB 15-17, 8 KB 15-16). Other CPUs may prefer another distance; it only moves speed.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

inline __m256 widen8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// NR weight rows from n, MR activation rows from m. MR * NR accumulators plus NR widened weight
// vectors and one activation vector stay within the 16 ymm registers for (MR, NR) = (1, 4),
// (2, 4) and (1, 1).
template <int MR, int NR>
inline void tile(const Problem& p, int64_t m, int64_t n) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = p.q + (n + j) * p.K;
  const float* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = p.x + (m + i) * p.ldx;
  int64_t k = 0;
  // The tile's NR rows are NR * K contiguous bytes, read as NR interleaved streams, which the
  // hardware prefetcher follows poorly: one cache line PREFETCH_BYTES ahead per 64 bytes read
  // keeps a single linear stream in flight (it runs on into the next tile's rows).
  const char* ahead = reinterpret_cast<const char*>(p.q + n * p.K) + PREFETCH_BYTES;
  const char* end = reinterpret_cast<const char*>(p.q + p.N * p.K);
  for (; k + 8 <= p.K; k += 8) {
    if ((k & 63) == 0) {
      for (int j = 0; j < NR; ++j)
        if (ahead + 64 * j < end) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
      ahead += 64 * NR;
    }
    __m256 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = widen8(w[j] + k);
    for (int i = 0; i < MR; ++i) {
      const __m256 xv = _mm256_loadu_ps(xr[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = hsum(acc[i][j]);
      for (int64_t t = k; t < p.K; ++t) s += xr[i][t] * float(w[j][t]);
      p.out[(m + i) * p.N + n + j] = s * p.scale[n + j];
    }
}

void rows(const Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    if (p.M >= 4) {
      for (; m + 4 <= p.M; m += 4) {
        tile<4, 2>(p, m, n);
        tile<4, 2>(p, m, n + 2);
      }
    }
    for (; m + 2 <= p.M; m += 2) tile<2, 4>(p, m, n);
    if (m < p.M) tile<1, 4>(p, m, n);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) tile<1, 1>(p, m, n);
}

// One 32-block of x to int8, the same float operations as quantize_block_scalar.
inline void quantize_block(const float* x, int8_t* q, float& dx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  __m256 amax = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  dx = _mm_cvtss_f32(m4) / 127.f;
  const __m256 idv = _mm256_set1_ps(dx != 0.f ? 1.f / dx : 0.f);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // MXCSR: nearest-even
  // int32 -> int8 in order: the packs work per 128-bit lane, the permute puts the lanes back.
  const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
}

// NR weight rows from n x MR activation rows from m: per 32-block, |w| once per weight row, then
// per pair maddubs(|w|, x with w's sign) (pairs of products <= 2 * 127 * 127: no saturation), madd
// to 8 int32 sums, and one fp32 multiply-add by the block's dx. Every output takes the same
// operations in the same order whatever the tile (a row's result does not depend on its batch).
template <int MR, int NR>
inline void tile_q8(const Q8Problem& p, int64_t m, int64_t n) {
  const int64_t nb = p.K / QB;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  const int8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = p.q + (n + j) * p.K;
  const char* ahead = reinterpret_cast<const char*>(p.q + n * p.K) + PREFETCH_BYTES;
  const char* end = reinterpret_cast<const char*>(p.q + p.N * p.K);
  for (int64_t b = 0; b < nb; ++b) {
    if ((b & 1) == 0) {  // as the fp32 tile: one line PREFETCH_BYTES ahead per 64 bytes read
      for (int j = 0; j < NR; ++j)
        if (ahead + 64 * j < end) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
      ahead += 64 * NR;
    }
    __m256i wv[NR], wa[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[j] + b * QB));
      wa[j] = _mm256_abs_epi8(wv[j]);
    }
    for (int i = 0; i < MR; ++i) {
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qx + (m + i) * p.K + b * QB));
      const __m256 dx = _mm256_set1_ps(p.dx[(m + i) * nb + b]);
      for (int j = 0; j < NR; ++j) {
        const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[j], _mm256_sign_epi8(xq, wv[j])), ones);
        acc[i][j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), dx, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) p.out[(m + i) * p.N + n + j] = hsum(acc[i][j]) * p.scale[n + j];
}

// Activation rows in blocks of 64, so that a block's int8 rows stay in L2 while the task's
// weight rows pass over them (512 rows of a 1,536-wide x would not).
void rows_q8(const Q8Problem& p, int64_t n0, int64_t n1) {
  constexpr int64_t MB = 64;
  for (int64_t m0 = 0; m0 < p.M; m0 += MB) {
    const int64_t m1 = std::min(p.M, m0 + MB);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      int64_t m = m0;
      for (; m + 2 <= m1; m += 2) {
        tile_q8<2, 2>(p, m, n);
        tile_q8<2, 2>(p, m, n + 2);
      }
      if (m < m1) tile_q8<1, 4>(p, m, n);
    }
    for (; n < n1; ++n)
      for (int64_t m = m0; m < m1; ++m) tile_q8<1, 1>(p, m, n);
  }
}

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl")
namespace avx512 {

// The AVX2 tiles at 16 lanes: twice the multiply-adds per instruction where a batch makes the
// kernel compute-bound (decode of many streams), 32 registers for a (4, 4) tile. The K remainder
// below 16 runs through a masked load (zeros add nothing).
inline __m512 widen16(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}

inline __m512 widen_tail(const int8_t* w, __mmask16 mask) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w)));
}

template <int MR, int NR>
inline void tile(const Problem& p, int64_t m, int64_t n) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = p.q + (n + j) * p.K;
  const float* xr[MR];
  for (int i = 0; i < MR; ++i) xr[i] = p.x + (m + i) * p.ldx;
  int64_t k = 0;
  const char* ahead = reinterpret_cast<const char*>(p.q + n * p.K) + PREFETCH_BYTES;
  const char* end = reinterpret_cast<const char*>(p.q + p.N * p.K);
  for (; k + 16 <= p.K; k += 16) {
    if ((k & 63) == 0) {
      for (int j = 0; j < NR; ++j)
        if (ahead + 64 * j < end) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
      ahead += 64 * NR;
    }
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = widen16(w[j] + k);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_loadu_ps(xr[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  if (k < p.K) {
    const __mmask16 mask = __mmask16((1u << (p.K - k)) - 1);
    __m512 wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = widen_tail(w[j] + k, mask);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, xr[i] + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_fmadd_ps(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) p.out[(m + i) * p.N + n + j] = _mm512_reduce_add_ps(acc[i][j]) * p.scale[n + j];
}

void rows(const Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + 4 <= n1; n += 4) {
    int64_t m = 0;
    for (; m + 4 <= p.M; m += 4) tile<4, 4>(p, m, n);
    for (; m + 2 <= p.M; m += 2) tile<2, 4>(p, m, n);
    if (m < p.M) tile<1, 4>(p, m, n);
  }
  for (; n < n1; ++n)
    for (int64_t m = 0; m < p.M; ++m) tile<1, 1>(p, m, n);
}

}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
namespace vnni {

// `int8_matmul_q8` with AVX-512 VNNI: vpdpbusd multiplies unsigned by signed bytes and adds each
// 4 products into an int32 lane, so x goes in as xq + 128 (xq ^ 0x80, unsigned) and each lane's
// sum starts at -128 * (its 4 weights' sum) to cancel the +128 exactly (integer arithmetic): one
// instruction per 64 weights and activation row, where AVX2 spends three per 32 (sign, maddubs,
// madd). A zmm holds two 32-blocks, lanes 0-7 block b and 8-15 block b + 1, converted to fp32
// and multiplied by (dx_b x 8, dx_b+1 x 8). An odd last block is read through a 32-byte masked
// load: its other lanes are zero and add nothing. Every output takes the same operations in the
// same order whatever the tile (a row's result does not depend on its batch); the sums are
// grouped otherwise than the AVX2 version's, so the two differ in the last bits.
template <int MR, int NR>
inline void tile_q8(const Q8Problem& p, int64_t m, int64_t n) {
  const int64_t nb = p.K / QB;
  const __m512i flip = _mm512_set1_epi8(char(0x80)), zero = _mm512_setzero_si512();
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  const int8_t* w[NR];
  for (int j = 0; j < NR; ++j) w[j] = p.q + (n + j) * p.K;
  const char* ahead = reinterpret_cast<const char*>(p.q + n * p.K) + PREFETCH_BYTES;
  const char* end = reinterpret_cast<const char*>(p.q + p.N * p.K);
  for (int64_t b = 0; b < nb; b += 2) {
    const bool pair = b + 1 < nb;
    const __mmask64 mask = pair ? ~__mmask64(0) : __mmask64(0xFFFFFFFFu);
    for (int j = 0; j < NR; ++j)  // as the AVX2 tile: one line PREFETCH_BYTES ahead per 64 bytes read
      if (ahead + 64 * j < end) _mm_prefetch(ahead + 64 * j, _MM_HINT_T0);
    ahead += 64 * NR;
    __m512i wv[NR], base[NR];
    for (int j = 0; j < NR; ++j) {
      wv[j] = _mm512_maskz_loadu_epi8(mask, w[j] + b * QB);
      base[j] = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, flip, wv[j]));  // -128 * sum
    }
    for (int i = 0; i < MR; ++i) {
      const int8_t* xr = p.qx + (m + i) * p.K + b * QB;
      const __m512i xu = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, xr), flip);
      const float* d = p.dx + (m + i) * nb + b;
      const __m512 dx = _mm512_mask_blend_ps(__mmask16(0xFF00), _mm512_set1_ps(d[0]), _mm512_set1_ps(pair ? d[1] : 0.f));
      for (int j = 0; j < NR; ++j) {
        const __m512i dot = _mm512_dpbusd_epi32(base[j], xu, wv[j]);
        acc[i][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), dx, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) p.out[(m + i) * p.N + n + j] = _mm512_reduce_add_ps(acc[i][j]) * p.scale[n + j];
}

// As avx2::rows_q8, with 4-row tiles (32 registers: 16 accumulators, 8 weight vectors).
void rows_q8(const Q8Problem& p, int64_t n0, int64_t n1) {
  constexpr int64_t MB = 64;
  for (int64_t m0 = 0; m0 < p.M; m0 += MB) {
    const int64_t m1 = std::min(p.M, m0 + MB);
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) {
      int64_t m = m0;
      for (; m + 4 <= m1; m += 4) tile_q8<4, 4>(p, m, n);
      for (; m + 2 <= m1; m += 2) tile_q8<2, 4>(p, m, n);
      if (m < m1) tile_q8<1, 4>(p, m, n);
    }
    for (; n < n1; ++n)
      for (int64_t m = m0; m < m1; ++m) tile_q8<1, 1>(p, m, n);
  }
}

}  // namespace vnni
#pragma GCC pop_options

void check_inputs(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.device().is_cpu() && q.device().is_cpu() && scale.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(q.scalar_type() == torch::kInt8, "q must be int8, got ", q.scalar_type());
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32, "scale must be float32, got ", scale.scalar_type());
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && scale.dim() == 1, "shapes: x [M, K], q [N, K], scale [N]");
  TORCH_CHECK(x.size(1) == q.size(1), "x has ", x.size(1), " columns, q has ", q.size(1));
  TORCH_CHECK(scale.size(0) == q.size(0), "scale has ", scale.size(0), " entries for ", q.size(0), " rows");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  TORCH_CHECK(q.is_contiguous() && scale.is_contiguous(), "q and scale must be contiguous");
}

torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                          int64_t isa) {
  check_inputs(x, q, scale);
  if (isa < 0) isa = best_isa();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  Problem p{x.data_ptr<float>(), x.stride(0), q.data_ptr<int8_t>(), scale.data_ptr<float>(),
            out.data_ptr<float>(), M, N, K};
  // Blocks of 16 weight rows (a multiple of the tile's 4); enough rows per task that a thread
  // streams whole pages of weights, few enough that two threads share a 576-row layer evenly.
  constexpr int64_t BLOCK = 16;
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * BLOCK, n1 = std::min(N, b1 * BLOCK);
    if (isa >= ISA_AVX512)
      avx512::rows(p, n0, n1);
    else if (isa >= ISA_AVX2)
      avx2::rows(p, n0, n1);
    else
      rows_scalar(p, n0, n1);
  });
  return out;
}

torch::Tensor int8_matmul_q8(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale,
                             int64_t isa) {
  check_inputs(x, q, scale);
  TORCH_CHECK(x.size(1) % QB == 0, "int8 activations need K to be a multiple of 32, got ", x.size(1));
  if (isa < 0) isa = best_isa();
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), nb = K / QB;
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  // x rounded first (M x K values: a few microseconds at decode sizes), then the weights.
  std::vector<int8_t> qx(size_t(M * K));
  std::vector<float> dx(size_t(M * nb));
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* src = xp + m * x.stride(0) + b * QB;
      if (isa >= ISA_AVX2)
        avx2::quantize_block(src, qx.data() + m * K + b * QB, dx[m * nb + b]);
      else
        quantize_block_scalar(src, qx.data() + m * K + b * QB, dx[m * nb + b]);
    }
  Q8Problem p{qx.data(), dx.data(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), out.data_ptr<float>(), M, N, K};
  constexpr int64_t BLOCK = 16;  // weight rows per task, as int8_matmul
  const int64_t blocks = (N + BLOCK - 1) / BLOCK;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    const int64_t n0 = b0 * BLOCK, n1 = std::min(N, b1 * BLOCK);
    if (isa >= ISA_AVX512_VNNI)
      vnni::rows_q8(p, n0, n1);
    else if (isa >= ISA_AVX2)  // AVX-512 without VNNI runs the AVX2 code
      avx2::rows_q8(p, n0, n1);
    else
      rows_q8_scalar(p, n0, n1);
  });
  return out;
}

}  // namespace int8_matmul

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmstack-int8 CPU kernels";
  m.def("int8_matmul", &int8_matmul::int8_matmul, "x fp32 [M, K] @ (q int8 [N, K] * scale [N])^T",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("isa") = -1);
  m.def("int8_matmul_q8", &int8_matmul::int8_matmul_q8,
        "x fp32 [M, K] rounded to int8 per 32 values, @ (q int8 [N, K] * scale [N])^T; K % 32 == 0",
        py::arg("x"), py::arg("q"), py::arg("scale"), py::arg("isa") = -1);
  m.def("best_isa", &int8_matmul::best_isa, "3: AVX-512 (F, BW, VL) + VNNI, 2: AVX-512 (F, BW, VL), 1: AVX2+FMA, 0: scalar");
}
