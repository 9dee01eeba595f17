// GGUF block matmul on the CPU for lmstack-gguf: out[M, N] = x[M, K] @ W^T where W [N, K] stays in
// its GGUF blocks (32 values each, along a row) exactly as the checkpoint stores them:
//
//   Q4_0: fp16 d, 16 bytes of 4-bit q   value = d * (q - 8)    18 bytes / 32 values
//   Q4_1: fp16 d, fp16 m, 16 bytes of q  value = d * q + m      20 bytes / 32 values
//   Q8_0: fp16 d, 32 int8 q              value = d * q          34 bytes / 32 values
//
// (byte j of a 4-bit block holds value j in its low nibble and value j + 16 in its high one.)
//
// One layout of lmstack's own beside them, for int4 checkpoints quantized in groups of 64-256
// columns (AWQ's 128): Q4_1G, Q4_1 whose 2^g consecutive blocks of a group share one header. A
// row is its groups in order, each fp16 d, fp16 m, then the group's blocks' 16 code bytes as in
// Q4_1 (the row's last group may hold fewer blocks): 68 bytes per 128 values where Q4_1 takes 80.
// Its type id is Q4_1G + g (1001: groups of 64 columns, 1002: 128, 1003: 256).
// A block's contribution to one output is d * dot(q, x_block) + m * sum(x_block): the q are
// widened to fp32 in registers and multiplied by the fp32 activations with FMA, the block sums
// of x are computed once per call. Decode reads 0.56-1.06 bytes per weight, as llama.cpp does,
// and the result is what the dequantized checkpoint gives, up to fp32 summation order.
//
// `gguf_matmul_q8` is the llama.cpp way instead: each 32-block of x is first rounded to int8 with
// one fp32 scale (dx = max|x| / 127, q = round(x / dx)), and a block's contribution becomes
// d * dx * idot(q_w, q_x) + m * dx * sum(q_x), the integer dot product done 32 pairs at a time
// (maddubs). About a third of the instructions per weight of the fp32 path, so batch-1 decode is
// bound by memory instead of arithmetic; the price is x's rounding (relative error ~1 / 254 per
// value before the sums average it out; the quantizer's `activations: int8` option, README).
//
// Threads split the weight rows (at::parallel_for: torch's thread count applies). AVX-512,
// AVX2+FMA+F16C or plain C++, picked at run time from what the CPU reports, or forced by the
// caller (tests). With AVX-512 the fp32 path computes each output the same way whatever the
// number of rows (batch invariance, `tile_f32`); the int8-activation path uses VNNI there.

#include <torch/extension.h>

#include "isa_cap.h"

#include "kquants.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

namespace gguf_matmul {

enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };
// GGML type ids (ggml.h).
enum Type { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q4_1G = 1000 };  // Q5_x, K: panels only
constexpr int QK = 32;  // values per block, every type here
constexpr int MAX_GSHIFT = 3;  // Q4_1G's groups: at most 8 blocks (256 columns)

int64_t best_isa() {  // what the CPU has, within LMSTACK_MAX_ISA (isa_cap.h)
  __builtin_cpu_init();
  int64_t found = ISA_SCALAR;
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") &&
      __builtin_cpu_supports("f16c"))
    found = ISA_AVX512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    found = ISA_AVX2;
  return std::min(found, lmstack::isa_cap());
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

// Where block b of a weight row keeps its header (fp16 d, then fp16 m for the Q4_1 kinds) and its
// codes, as byte offsets from the row's start: one header per block for the GGML types, one per
// group of 2^gshift blocks for Q4_1G.
struct Layout {
  int64_t kind;  // Q4_0, Q4_1, Q8_0 or Q4_1G (the kernels' template parameter)
  int gshift;
  int64_t head, codes, group;  // header bytes, code bytes per block, bytes per whole group
  int64_t head_at(int64_t b) const { return (b >> gshift) * group; }
  int64_t codes_at(int64_t b) const { return head_at(b) + head + (b & ((int64_t(1) << gshift) - 1)) * codes; }
  // Bytes of a row of nb blocks (the last group may be short).
  int64_t row_bytes(int64_t nb) const {
    const int64_t rest = nb & ((int64_t(1) << gshift) - 1);
    return (nb >> gshift) * group + (rest ? head + rest * codes : 0);
  }
};

Layout layout_of(int64_t type) {
  if (type > Q4_1G && type <= Q4_1G + MAX_GSHIFT) {
    const int g = int(type - Q4_1G);
    return {Q4_1G, g, 4, 16, 4 + (int64_t(16) << g)};
  }
  TORCH_CHECK(type == Q4_0 || type == Q4_1 || type == Q8_0, "type ", type,
              " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_1G (1001-1003)");
  return {type, 0, type == Q4_1 ? 4 : 2, type == Q8_0 ? 32 : 16, block_bytes(type)};
}

int64_t row_bytes(int64_t type, int64_t k) {
  TORCH_CHECK(k > 0 && k % QK == 0, "K must be a positive multiple of ", QK, ", got ", k);
  return layout_of(type).row_bytes(k / QK);
}

// The same offsets with the GGML types' constants known at compile time (the hot loops).
template <int TYPE>
constexpr bool HAS_M = TYPE == Q4_1 || TYPE == Q4_1G;

template <int TYPE>
inline int64_t head_at(const Layout& L, int64_t b) {
  if constexpr (TYPE == Q4_1G)
    return L.head_at(b);
  else
    return b * (TYPE == Q4_0 ? 18 : TYPE == Q4_1 ? 20 : 34);
}

template <int TYPE>
inline int64_t codes_at(const Layout& L, int64_t b) {
  if constexpr (TYPE == Q4_1G)
    return L.codes_at(b);
  else
    return head_at<TYPE>(L, b) + (TYPE == Q4_1 ? 4 : 2);
}

// f(std::integral_constant<int, kind>) for the layout kind of a type id.
template <class F>
inline void with_kind(const Layout& L, F&& f) {
  switch (L.kind) {
    case Q4_0: f(std::integral_constant<int, Q4_0>()); break;
    case Q4_1: f(std::integral_constant<int, Q4_1>()); break;
    case Q4_1G: f(std::integral_constant<int, Q4_1G>()); break;
    default: f(std::integral_constant<int, Q8_0>()); break;
  }
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

// fp32 -> bf16 bits, rounded to nearest even (finite values: what torch's conversion gives them).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return uint16_t((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
}

// Block b of a row: its scale and offset (value = d * q + m, q as stored: 0..15 or -128..127).
inline void block_dm(const Layout& L, const uint8_t* row, int64_t b, float& d, float& m) {
  const uint8_t* h = row + L.head_at(b);
  d = half_to_float(load_u16(h));
  m = L.kind == Q4_1 || L.kind == Q4_1G ? half_to_float(load_u16(h + 2)) : L.kind == Q4_0 ? -8.f * d : 0.f;
}

inline void block_q(const Layout& L, const uint8_t* row, int64_t b, float* q) {
  if (L.kind == Q8_0) {
    const int8_t* s = reinterpret_cast<const int8_t*>(row + L.codes_at(b));
    for (int j = 0; j < QK; ++j) q[j] = float(s[j]);
  } else {
    const uint8_t* s = row + L.codes_at(b);
    for (int j = 0; j < QK / 2; ++j) {
      q[j] = float(s[j] & 0x0F);
      q[j + QK / 2] = float(s[j] >> 4);
    }
  }
}

struct Problem {
  const float* x;
  int64_t ldx;
  const float* xsum;  // [M, K / QK]: each block's sum of x (one-row and scalar paths)
  const float* xsum_by_block;  // the same sums as [K / QK, M] (the AVX-512 path)
  const uint8_t* w;
  int64_t row_bytes;
  Layout L;
  float* out;
  int64_t M, N, K;
};

// What an AVX-512 panel tile writes: its products (PLAIN); a SwiGLU pair's silu(gate) * up, the
// gate panel's outputs and the up panel's side by side in the tile (GLU, NR = 2); or, one panel at
// a time, silu of the gate outputs a PLAIN tile left in out times this up panel's (UP, NR = 1); or
// its products added to what out holds (ADD: a residual stream, out += x @ W^T).
enum Store { PLAIN, GLU, UP, ADD };

// The int8-activation path's operands (gguf_matmul_q8).
struct Q8Problem {
  const int8_t* qx;  // [M, K] int8
  const float* dx;   // [M, K / QK]
  const float* sx;   // [M, K / QK]
  const uint8_t* w;
  int64_t row_bytes;
  Layout L;
  float* out;
  int64_t M, N, K;
  // out's row stride: N, except in the panel paths' segments of a wider output
  // (gguf_matmul_panel_segments).
  int64_t ldo;
};

void rows_scalar(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QK;
  float q[QK];
  std::vector<float> acc(p.M);
  for (int64_t n = n0; n < n1; ++n) {
    std::fill(acc.begin(), acc.end(), 0.f);
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      float d, m;
      block_dm(p.L, row, b, d, m);
      block_q(p.L, row, b, q);
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

// --- panels: the weights re-laid out for batches ---------------------------------------------
//
// The block tiles give each output its own vector lanes, so every block ends in a horizontal sum;
// at 8-64 activation rows that, not memory, bounds them (~140 G multiply-adds a second on a
// 2-core Zen 5, where bf16 matmuls reach ~300). Panels turn the lanes around: 16 output rows of W
// side by side, so that one vpdpbusd (AVX-512 VNNI; AVX2: maddubs over 8 of the rows) multiplies
// 4 consecutive x values (one broadcast int32) by the same 4 positions of 16 weight rows and adds
// into 16 outputs, with no horizontal sum at all.
//
// Layout (`gguf_pack_panels`): panel p holds weight rows [16p, 16p + 16) (zero rows pad N), block
// by block; a panel block is the codes then the 16 rows' d then (Q4_1, Q4_1G, Q5_1) their 16 m,
// each the fp16 bits the row's block header holds (so the panels take exactly the blocks' bytes,
// 0.625 a weight for Q4_1, and the kernels widen them with F16C):
//   Q4_0 / Q4_1: 4 vectors of 64 bytes; byte 4c + i of vector j holds row c's value 4j + i in its
//                low nibble and value 16 + 4j + i in its high nibble (codes 0..15); Q4_0's m = -8d,
//                made in fp32 by the AVX2 kernels (AVX-512 takes -8 q_x off in integers)
//   Q5_0 / Q5_1: Q4's 4 vectors of the codes' low 4 bits, then their fifth bits as 8 64-bit masks:
//                mask 2j holds vector j's low-nibble values, mask 2j + 1 its high-nibble ones, bit
//                4c + i for byte 4c + i (one AVX-512 mask register each: a masked add of 16 makes
//                the codes 0..31); Q5_0's m = -16d. 0.6875 / 0.75 bytes a weight, as the blocks
//   Q8_0:        8 vectors of 64 bytes; byte 4c + i of vector t holds row c's value 4t + i + 128
//                (unsigned): VNNI's sums then carry 128 * sum(q_x), taken off in integers; AVX2
//                flips the bit back and multiplies signed (maddubs would saturate on 255 x 127)
// A block's contribution is then, per row and output, cvt(idot) * (d * dx) + m * sx exactly as in
// the tiles above: integer sums exact, fp32 summation order the only difference.

constexpr int PANEL = 16;

template <int TYPE>
constexpr bool FIVE_BIT = TYPE == Q5_0 || TYPE == Q5_1 || TYPE == Q5_K;
// The panel kinds whose batches widen their codes once per call (`wide_pair`, `wide_half`): the
// 5- and 6-bit ones, whose per-tile widening (mask adds, spread bits) costs most. For the 4-bit
// kinds it was slower (one process, alternating, a 1536 x 1536 layer, 2-core Zen 4: Q4_0 / Q4_1 /
// Q4_K 1.04-1.40x the per-tile time at 16-256 rows with AVX-512, 1.02-1.17x with AVX2; Q5_0 /
// Q5_1 / Q5_K / Q6_K 0.72-0.93x at 64 rows and more with AVX-512, 0.51-0.90x from 32 with AVX2).
template <int TYPE>
constexpr bool WIDE = FIVE_BIT<TYPE> || TYPE == Q6_K;
// Q4_K and Q5_K (Q4_K with Q5's fifth bits): the same panel super-block but for the code bytes.
template <int TYPE>
constexpr bool K4 = TYPE == Q4_K || TYPE == Q5_K;
// Types whose panels hold an m per block (Q4_1G's panels are Q4_1's).
template <int TYPE>
constexpr bool PANEL_M = TYPE == Q4_1 || TYPE == Q5_1;
// After a block's codes (and fifth bits): the 16 rows' d as the fp16 bits their blocks hold, then
// (PANEL_M) the 16 m (Q4_0's and Q5_0's offsets, -8 d and -16 d: made by the AVX2 kernels, taken
// off in integers by the AVX-512 ones).
template <int TYPE>
constexpr int64_t PANEL_CODES = TYPE == Q8_0 ? 512 : FIVE_BIT<TYPE> ? 320 : 256;
// (the K-quants: a super-block's bytes per block, K4_SUPER / 8, Q6K_PANEL_SUPER / 8.)
template <int TYPE>
constexpr int64_t PANEL_BLOCK = TYPE == Q4_K ? 296 : TYPE == Q5_K ? 360 : TYPE == Q6_K ? 420 : PANEL_CODES<TYPE> + (PANEL_M<TYPE> ? 64 : 32);
inline int64_t panel_code_bytes(int64_t type) { return type == Q8_0 ? 512 : type == Q5_0 || type == Q5_1 ? 320 : 256; }
inline bool panel_has_m(int64_t type) { return type != Q4_0 && type != Q5_0 && type != Q8_0; }  // Q4_1G too
inline int64_t panel_block_bytes(int64_t type) {
  return type == Q4_K ? 296 : type == Q5_K ? 360 : type == Q6_K ? 420 : panel_code_bytes(type) + (panel_has_m(type) ? 64 : 32);
}
// The bias c of value = d * (q - c) for the types without an m (0: Q8_0, and the types with one).
template <int TYPE>
constexpr float PANEL_BIAS = TYPE == Q4_0 ? 8.f : TYPE == Q5_0 ? 16.f : 0.f;

// Q4_K (256-value super-blocks: fp16 d, dmin, 8 x 6-bit (scale, min), 4-bit q; value of block t
// = d * sc_t * q - dmin * mn_t): a panel super-block is its 8 blocks' codes in Q4's panel layout
// (256 bytes each), then the 16 rows' 6-bit scales as bytes (16 per block t: row c at 16t + c),
// their mins likewise, then d and dmin as fp16 bits (16 each): 2368 bytes for 16 x 256 values,
// 148 a row where the file's super-block holds 144 (1.028x: the 6-bit pairs spread to bytes). The
// kernels make a block's d * sc_t and -(dmin * mn_t) in fp32 (kquants.cpp's operations) and go
// on as for Q4_1.
// Q5_K: as Q4_K with each block's codes followed by their fifth bits as Q5_0's (64 bytes): 2880
// bytes, 180 a row per super-block where the file's holds 176 (1.023x). K4_* give either's offsets.
template <int TYPE>
constexpr int64_t K4_CODES = TYPE == Q5_K ? 320 : 256;  // bytes of a block's codes
template <int TYPE>
constexpr int64_t K4_SCALES = 8 * K4_CODES<TYPE>;  // then mins at + 128, d at + 256, dmin at + 288
template <int TYPE>
constexpr int64_t K4_SUPER = K4_SCALES<TYPE> + 320;
// Q6_K (256-value super-blocks: 4 low + 2 high bits of q, 16 int8 scales per 16 values, fp16 d;
// value = d * sc_g * (q - 32)): a panel super-block is per block t (384 bytes) Q4's 256 bytes of
// the codes' low 4 bits, then their bits 4 and 5 as masks (as Q5's fifth bits: 32 bytes per panel
// vector j: the low-nibble values' bit 4, bit 5, then the high-nibble values' bit 4, bit 5); then
// the 16 rows' scales (group g of 16 values: 16 bytes, row c at 16g + c) and d as fp16 bits:
// 3360 bytes for 16 x 256 values, exactly the blocks' 210 a row. A block's low-nibble values are
// group 2t, its high-nibble ones 2t + 1: two integer dot products, each less 32 * sum(q_x) of its
// 16 values (exact), then times d * sc_g * dx.
constexpr int64_t Q6K_PANEL_SUPER = 8 * 384 + 256 + 32;
template <int TYPE>
inline int64_t panel_codes_at(int64_t b) {
  if constexpr (K4<TYPE>)
    return (b >> 3) * K4_SUPER<TYPE> + K4_CODES<TYPE> * (b & 7);
  else if constexpr (TYPE == Q6_K)
    return (b >> 3) * Q6K_PANEL_SUPER + 384 * (b & 7);
  else
    return b * PANEL_BLOCK<TYPE>;
}

// The last tile of `for_row_tiles`: n (< N + 1) rows from r, if any.
template <int N, class Tile>
inline void rest_tile(int64_t n, int64_t r, Tile& tile) {
  if constexpr (N > 0) {
    if (n == N)
      tile(std::integral_constant<int, N>(), r);
    else
      rest_tile<N - 1>(n, r, tile);
  }
}

// Activation rows [r0, r1) in tiles of MR (4 unless given) and one tile of the rest: tile(MR, r)
// for each, MR a std::integral_constant so that the tile's row count is a compile-time constant.
template <int MR = 4, class Tile>
inline void for_row_tiles(int64_t r0, int64_t r1, Tile&& tile) {
  int64_t r = r0;
  for (; r + MR <= r1; r += MR) tile(std::integral_constant<int, MR>(), r);
  rest_tile<MR - 1>(r1 - r, r, tile);
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {

// Software prefetch: one linear stream PREFETCH_BYTES ahead of what a tile has read. A tile's
// rows are contiguous, read block by block as interleaved streams that the hardware prefetcher
// follows poorly (lmstack-int8's kernel measured ~6 GB/s on its own, ~11.5 prefetching each row
// some rows ahead, ~15-17 with one linear stream 4 KB ahead, on a 2-core AVX2 EPYC VM). Other
// CPUs may prefer another distance; it only moves speed.
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 4096
#endif

struct Ahead {
  const char* next;
  const char* end;
  Ahead(const uint8_t* w, int64_t row_bytes, int64_t rows, int64_t n)
      : next(reinterpret_cast<const char*>(w + n * row_bytes) + PREFETCH_BYTES),
        end(reinterpret_cast<const char*>(w + rows * row_bytes)) {}
  // Every line up to PREFETCH_BYTES past `read` (how far the tile has read, counted linearly).
  inline void to(const uint8_t* read) {
    const char* target = reinterpret_cast<const char*>(read) + PREFETCH_BYTES;
    for (; next < target && next < end; next += 64) _mm_prefetch(next, _MM_HINT_T0);
  }
};

inline float half(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

// The 32 q of a block (its code bytes at `s`) as four vectors of 8 (values 0-7, 8-15, 16-23, 24-31).
template <int TYPE>
inline void widen(const uint8_t* s, __m256 v[4]) {
  if constexpr (TYPE == Q8_0) {
    for (int i = 0; i < 4; ++i)
      v[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + 8 * i))));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask), hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    v[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    v[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)));
    v[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    v[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)));
  }
}

// A block's d and m from its header `h`.
template <int TYPE>
inline void dm(const uint8_t* h, float& d, float& m) {
  d = half(h);
  m = HAS_M<TYPE> ? half(h + 2) : TYPE == Q4_0 ? -8.f * d : 0.f;
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

// One activation row (decode at batch 1): two weight rows at a time, each with four independent
// accumulators (q * d, then one FMA per vector), so no chain of dependent FMAs per block limits it.
template <int TYPE>
inline void row_block(const uint8_t* row, const Layout& L, int64_t b, const float* xb, __m256 acc[4], float& off,
                      float xsum) {
  __m256 v[4];
  float d, m;
  widen<TYPE>(row + codes_at<TYPE>(L, b), v);
  dm<TYPE>(row + head_at<TYPE>(L, b), d, m);
  const __m256 dv = _mm256_set1_ps(d);
  for (int i = 0; i < 4; ++i) acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(v[i], dv), _mm256_loadu_ps(xb + 8 * i), acc[i]);
  off += m * xsum;
}

inline float total(const __m256 acc[4], float off) {
  return hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + off;
}

template <int TYPE>
void rows_m1(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QK;
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    __m256 acc0[4], acc1[4];
    for (int i = 0; i < 4; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
    float off0 = 0.f, off1 = 0.f;
    const uint8_t* w0 = p.w + n * p.row_bytes;
    const uint8_t* w1 = w0 + p.row_bytes;
    Ahead ahead(p.w, p.row_bytes, p.N, n);
    for (int64_t b = 0; b < nb; ++b) {
      ahead.to(w0 + 2 * head_at<TYPE>(p.L, b + 1));
      row_block<TYPE>(w0, p.L, b, p.x + b * QK, acc0, off0, p.xsum[b]);
      row_block<TYPE>(w1, p.L, b, p.x + b * QK, acc1, off1, p.xsum[b]);
    }
    p.out[n] = total(acc0, off0);
    p.out[n + 1] = total(acc1, off1);
  }
  for (; n < n1; ++n) {
    __m256 acc[4];
    for (int i = 0; i < 4; ++i) acc[i] = _mm256_setzero_ps();
    float off = 0.f;
    for (int64_t b = 0; b < nb; ++b) row_block<TYPE>(p.w + n * p.row_bytes, p.L, b, p.x + b * QK, acc, off, p.xsum[b]);
    p.out[n] = total(acc, off);
  }
}

// Several activation rows: each block is widened once into its fp32 values (d * q + m, one FMA
// per vector) and used for up to MR rows, whose accumulators are independent chains (a stack
// array: std::vector<__m256> would drop the vectors' 32-byte alignment).
constexpr int MR = 16;

template <int TYPE>
void rows_many(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.w + n * p.row_bytes;
    for (int64_t r0 = 0; r0 < p.M; r0 += MR) {
      const int64_t rows = std::min<int64_t>(MR, p.M - r0);
      __m256 acc[MR];
      for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
      Ahead ahead(p.w, p.row_bytes, p.N, n);
      for (int64_t b = 0; b < nb; ++b) {
        ahead.to(row + head_at<TYPE>(p.L, b + 1));
        __m256 v[4];
        float d, m;
        widen<TYPE>(row + codes_at<TYPE>(p.L, b), v);
        dm<TYPE>(row + head_at<TYPE>(p.L, b), d, m);
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

// Eight fp32 values -> bf16 bits, rounded to nearest even as float_to_bf16.
inline __m128i to_bf16(__m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

// Rows [n0, n1) of W: value = d * q + m, eight at a time, stored as fp32 (OUT float) or bf16
// (OUT uint16_t: the batches a native-bf16 CPU multiplies in bf16, written in one pass).
template <int TYPE, class OUT>
void dequantize_rows(const uint8_t* w, int64_t row_bytes, const Layout& L, int64_t k, OUT* out, int64_t n0,
                     int64_t n1) {
  const int64_t nb = k / QK;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* row = w + n * row_bytes;
      __m256 v[4];
      float d, m;
      widen<TYPE>(row + codes_at<TYPE>(L, b), v);
      dm<TYPE>(row + head_at<TYPE>(L, b), d, m);
      const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
      OUT* o = out + n * k + b * QK;
      for (int i = 0; i < 4; ++i) {
        const __m256 value = _mm256_fmadd_ps(v[i], dv, mv);
        if constexpr (std::is_same_v<OUT, float>)
          _mm256_storeu_ps(o + 8 * i, value);
        else
          _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8 * i), to_bf16(value));
      }
    }
}

template <int TYPE>
void rows(const Problem& p, int64_t n0, int64_t n1) {
  if (p.M == 1)
    rows_m1<TYPE>(p, n0, n1);
  else
    rows_many<TYPE>(p, n0, n1);
}


// --- int8 activations ------------------------------------------------------------------------

// One 32-block of x to int8: dx = max|x| / 127, q = round-to-nearest-even(x * (1 / dx)), and
// sx = dx * sum(q) (the offset term's sum). The same float operations as the plain path.
inline void quantize_block(const float* x, int8_t* q, float& dx, float& sx) {
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
  const float d = _mm_cvtss_f32(m4) / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  const __m256 idv = _mm256_set1_ps(id);
  __m256i i32[4];
  for (int i = 0; i < 4; ++i) i32[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], idv));  // MXCSR: nearest-even
  const __m256i total = _mm256_add_epi32(_mm256_add_epi32(i32[0], i32[1]), _mm256_add_epi32(i32[2], i32[3]));
  __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
  t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1));
  // int32 -> int8 in order: the packs work per 128-bit lane, the permute puts the lanes back.
  const __m256i p16a = _mm256_packs_epi32(i32[0], i32[1]), p16b = _mm256_packs_epi32(i32[2], i32[3]);
  const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), p8);
  dx = d;
  sx = d * float(_mm_cvtsi128_si32(t4));
}

// A weight block's 32 q (its code bytes at `s`) as unsigned (Q4: 0..15, the block's order) or,
// for Q8_0, signed bytes.
template <int TYPE>
inline __m256i load_q(const uint8_t* s) {
  if constexpr (TYPE == Q8_0) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s));
    const __m128i mask = _mm_set1_epi8(0x0F);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
  }
}

// Eight int32 partial sums of q_w . q_x over the block (exact).
template <int TYPE>
inline __m256i idot(__m256i w, __m256i x) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (TYPE == Q8_0)  // maddubs takes unsigned x signed: move w's sign onto x
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), ones);
  else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones);
}

// NR weight rows x MR activation rows, NR * MR accumulators: each weight block is read and
// unpacked once for MR rows, each activation block loaded once for NR weight rows.
template <int TYPE, int NR, int MR>
inline void tile_q8(const Q8Problem& p, int64_t n, int64_t r0) {
  const int64_t nb = p.K / QK;
  __m256 acc[NR][MR];
  float off[NR][MR];
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) acc[a][r] = _mm256_setzero_ps(), off[a][r] = 0.f;
  Ahead ahead(p.w, p.row_bytes, p.N, n);
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wq[NR];
    float d[NR], m[NR];
    ahead.to(p.w + n * p.row_bytes + NR * head_at<TYPE>(p.L, b + 1));
    for (int a = 0; a < NR; ++a) {
      const uint8_t* row = p.w + (n + a) * p.row_bytes;
      wq[a] = load_q<TYPE>(row + codes_at<TYPE>(p.L, b));
      dm<TYPE>(row + head_at<TYPE>(p.L, b), d[a], m[a]);
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t xb = (r0 + r) * nb + b;
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.qx + xb * QK));
      const float dx = p.dx[xb], sx = p.sx[xb];
      for (int a = 0; a < NR; ++a) {
        acc[a][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot<TYPE>(wq[a], xq)), _mm256_set1_ps(d[a] * dx), acc[a][r]);
        // An explicit fused multiply-add: left to the compiler, the sum is contracted in some tile
        // shapes and not in others, and a row would round differently by its batch.
        if constexpr (TYPE != Q8_0) off[a][r] = std::fma(m[a], sx, off[a][r]);
      }
    }
  }
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) p.out[(r0 + r) * p.N + n + a] = hsum(acc[a][r]) + off[a][r];
}

template <int TYPE, int NR>
inline void rows_tile_q8(const Q8Problem& p, int64_t n) {
  int64_t r0 = 0;
  for (; r0 + 4 <= p.M; r0 += 4) tile_q8<TYPE, NR, 4>(p, n, r0);
  switch (p.M - r0) {
    case 3: tile_q8<TYPE, NR, 3>(p, n, r0); break;
    case 2: tile_q8<TYPE, NR, 2>(p, n, r0); break;
    case 1: tile_q8<TYPE, NR, 1>(p, n, r0); break;
  }
}

template <int TYPE>
void rows_q8(const Q8Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M == 1) {  // decode at batch 1: four weight rows at a time
    for (; n + 4 <= n1; n += 4) tile_q8<TYPE, 4, 1>(p, n, 0);
  } else {
    for (; n + 2 <= n1; n += 2) rows_tile_q8<TYPE, 2>(p, n);
  }
  for (; n < n1; ++n) rows_tile_q8<TYPE, 1>(p, n);
}


// 32 mask bits (a panel's fifth / sixth code bits for one half-vector) as bytes: `value` where
// set, else 0.
inline __m256i sixteens(const uint8_t* bits4, char value = 16) {
  int32_t m;
  std::memcpy(&m, bits4, 4);
  const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                                          3, 3, 3, 3, 3, 3);
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201ll);
  const __m256i picked = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(m), spread), bit);
  return _mm256_and_si256(_mm256_cmpeq_epi8(picked, bit), _mm256_set1_epi8(value));
}

// Panels (layout above) with AVX2: each 64-byte panel vector is two halves of 8 weight rows;
// maddubs multiplies 4 x values by 4 positions of 8 rows into pairs of int16. For Q4 codes (0..15)
// the int16 sums of a whole block stay below 2^15 (16 x 15 x 127), so they are widened once per
// block, Q5's (0..31: the fifth bits or-ed in as 16) once per half block; Q8_0's are widened per
// maddubs. The pieces below serve both `panel_half` (codes widened per tile, in registers) and
// `wide_half` (codes widened once per call into a buffer), so both compute the same way.

// Vector j (0..3) of block b of a half, its codes as bytes: lo the values 4j .. 4j + 3 of the 8
// rows, hi 16 + 4j .. 16 + 4j + 3 (Q5's fifth bits, Q6_K's fifth and sixth or-ed in).
template <int TYPE>
inline void half_codes(const uint8_t* w, int half, int64_t b, int j, __m256i& lo, __m256i& hi) {
  const __m256i mask = _mm256_set1_epi8(0x0F);
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + panel_codes_at<TYPE>(b) + 32 * half + 64 * j));
  lo = _mm256_and_si256(raw, mask), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
  if constexpr (TYPE == Q6_K) {
    const uint8_t* bits = w + panel_codes_at<TYPE>(b) + 256 + 32 * j + 4 * half;
    lo = _mm256_or_si256(_mm256_or_si256(lo, sixteens(bits)), sixteens(bits + 8, 32));
    hi = _mm256_or_si256(_mm256_or_si256(hi, sixteens(bits + 16)), sixteens(bits + 24, 32));
  } else if constexpr (FIVE_BIT<TYPE>) {  // this half's 32 bits of masks 2j and 2j + 1
    const uint8_t* fifth = w + panel_codes_at<TYPE>(b) + 256 + 16 * j + 4 * half;
    lo = _mm256_or_si256(lo, sixteens(fifth));
    hi = _mm256_or_si256(hi, sixteens(fifth + 8));
  }
}

// Block b's scales for the 8 rows of a half: d and m (value = d * q + m; Q4_0 / Q5_0: m = -bias d;
// Q8_0: m unused), or for Q6_K its two groups' d * sc in d (low nibbles) and m (high nibbles).
template <int TYPE>
inline void half_scales(const uint8_t* w, int half, int64_t b, __m256& d, __m256& m) {
  m = _mm256_setzero_ps();
  if constexpr (TYPE == Q6_K) {
    const uint8_t* sup = w + (b >> 3) * Q6K_PANEL_SUPER;
    const int64_t t = b & 7;
    auto bytes8 = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + 3328 + 16 * half)));
    d = _mm256_mul_ps(dd, bytes8(sup + 3072 + 32 * t + 8 * half));
    m = _mm256_mul_ps(dd, bytes8(sup + 3072 + 32 * t + 16 + 8 * half));
  } else if constexpr (K4<TYPE>) {  // d * sc_t and -(dmin * mn_t), 8 rows
    const uint8_t* sup = w + (b >> 3) * K4_SUPER<TYPE> + K4_SCALES<TYPE>;
    const int64_t t = b & 7;
    auto bytes8 = [](const uint8_t* p) {
      return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    const __m256 dd = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + 256 + 16 * half)));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sup + 288 + 16 * half)));
    d = _mm256_mul_ps(dd, bytes8(sup + 16 * t + 8 * half));
    m = _mm256_xor_ps(_mm256_set1_ps(-0.f), _mm256_mul_ps(dmin, bytes8(sup + 128 + 16 * t + 8 * half)));
  } else {
    const uint8_t* head = w + b * PANEL_BLOCK<TYPE> + PANEL_CODES<TYPE> + 16 * half;
    d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head)));
    if constexpr (PANEL_BIAS<TYPE> != 0.f)
      m = _mm256_mul_ps(d, _mm256_set1_ps(-PANEL_BIAS<TYPE>));
    else if constexpr (TYPE != Q8_0)
      m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(head + 32)));
  }
}

// Holds v in a register as it is at this point (no instruction): GCC may then not reassociate the
// additions into v across it.
inline void pin(__m256i& v) { asm volatile("" : "+x"(v)); }

// A block's integer sums for MR rows, one vector j (0..3) of codes at a time: the maddubs sums
// of lo and hi in int16 (s_lo, s_hi), widened into the int32 sums (d_lo, d_hi) where the codes'
// size requires. Q6_K (codes 0..63): lo and hi apart (two scale groups), widened every second j;
// the others: one sum (s_lo, d_lo), widened every second j for 5-bit codes, at the end for 4-bit.
template <int TYPE, int MR>
inline void half_step(__m256i lo, __m256i hi, const int8_t* xb, int64_t K, int j, __m256i* s_lo, __m256i* s_hi,
                      __m256i* d_lo, __m256i* d_hi) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r) {
    int32_t xl, xh;
    std::memcpy(&xl, xb + r * K + 4 * j, 4);
    std::memcpy(&xh, xb + r * K + 16 + 4 * j, 4);
    if constexpr (TYPE == Q6_K) {
      s_lo[r] = _mm256_add_epi16(s_lo[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)));
      s_hi[r] = _mm256_add_epi16(s_hi[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
      if (j % 2 == 1) {
        d_lo[r] = _mm256_add_epi32(d_lo[r], _mm256_madd_epi16(s_lo[r], ones));
        d_hi[r] = _mm256_add_epi32(d_hi[r], _mm256_madd_epi16(s_hi[r], ones));
        s_lo[r] = s_hi[r] = _mm256_setzero_si256();
      }
    } else {
      s_lo[r] = _mm256_add_epi16(s_lo[r], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)));
      s_lo[r] = _mm256_add_epi16(s_lo[r], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)));
      // 4-bit codes: each row's int16 sum added to in j order, in its register. Left free, GCC
      // reassociated these adds across the block's four steps, made all of a 4-row tile's 32
      // products first and spilled them and the fp32 accumulators to the stack (41 of ~160
      // instructions a block); pinned, a Q4_1 model's layers took 0.76-0.89x the time at 32-2048
      // rows (AVX2 code on Zen 4, LMSTACK_MAX_ISA=avx2). The same integer sums: the same bits.
      // (The 5-bit kinds, widened every second step: no clear gain, 0.92x at 32 rows, 1.03-1.14x
      // at 2048; left free.)
      if constexpr (!FIVE_BIT<TYPE>) pin(s_lo[r]);
    }
  }
  // 5-bit codes (0..31): 4 maddubs sums (4 x 2 x 31 x 127 < 2^15) at most in int16.
  if constexpr (TYPE != Q6_K && FIVE_BIT<TYPE>)
    if (j % 2 == 1)
      for (int r = 0; r < MR; ++r) {
        d_lo[r] = _mm256_add_epi32(d_lo[r], _mm256_madd_epi16(s_lo[r], ones));
        s_lo[r] = _mm256_setzero_si256();
      }
}

// A block's sums (after its four `half_step`s) into the rows' accumulators, times its scales
// (`half_scales`) and each row's dx (and sx, or Q6_K's c32 bias sums).
template <int TYPE, int MR>
inline void half_finish(__m256* acc, __m256i* s_lo, __m256i* d_lo, __m256i* d_hi, __m256 d, __m256 m,
                        const float* dx, const float* sx, const int32_t* c32, int64_t nb, int64_t b) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (TYPE == Q6_K) {
    for (int r = 0; r < MR; ++r) {
      const __m256 dxr = _mm256_set1_ps(dx[r * nb + b]);
      const int32_t* c = c32 + r * 2 * nb + 2 * b;
      const __m256i il = _mm256_sub_epi32(d_lo[r], _mm256_set1_epi32(c[0]));
      const __m256i ih = _mm256_sub_epi32(d_hi[r], _mm256_set1_epi32(c[1]));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(il), _mm256_mul_ps(d, dxr), acc[r]);
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih), _mm256_mul_ps(m, dxr), acc[r]);
    }
    return;
  }
  if constexpr (!FIVE_BIT<TYPE> && TYPE != Q8_0)
    for (int r = 0; r < MR; ++r) d_lo[r] = _mm256_madd_epi16(s_lo[r], ones);
  for (int r = 0; r < MR; ++r) {
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d_lo[r]), _mm256_mul_ps(d, _mm256_set1_ps(dx[r * nb + b])), acc[r]);
    if constexpr (TYPE != Q8_0) acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), acc[r]);
  }
}

// MR activation rows x one half, the codes widened per block (`half_codes`) in registers.
template <int TYPE, int MR>
inline void panel_half(const uint8_t* w, int half, const int8_t* qx, int64_t K, const float* dx, const float* sx,
                       const int32_t* c32, float* out, int64_t ldo, int valid) {
  constexpr int64_t PB = PANEL_BLOCK<TYPE>;
  const int64_t nb = K / QK;
  const __m256i ones = _mm256_set1_epi16(1), flip = _mm256_set1_epi8(char(0x80));
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // The panel's stream PREFETCH_BYTES ahead (as the AVX-512 panel tile; the second half's pass
    // finds these lines in cache already).
    const char* next = reinterpret_cast<const char*>(w + panel_codes_at<TYPE>(b)) + PREFETCH_BYTES;
    for (int64_t o = 0; o < PB; o += 64) _mm_prefetch(next + o, _MM_HINT_T0);
    const int8_t* xb = qx + b * QK;
    __m256i s_lo[MR], s_hi[MR], d_lo[MR], d_hi[MR];
    for (int r = 0; r < MR; ++r) s_lo[r] = s_hi[r] = d_lo[r] = d_hi[r] = _mm256_setzero_si256();
    if constexpr (TYPE == Q8_0) {
      const uint8_t* blk = w + panel_codes_at<TYPE>(b) + 32 * half;
      for (int t = 0; t < 8; ++t) {
        const __m256i ws = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 64 * t)), flip);
        const __m256i wa = _mm256_abs_epi8(ws);
        for (int r = 0; r < MR; ++r) {
          int32_t x4;
          std::memcpy(&x4, xb + r * K + 4 * t, 4);
          const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(x4), ws);  // w's sign moved onto x
          d_lo[r] = _mm256_add_epi32(d_lo[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xs), ones));
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m256i lo, hi;
        half_codes<TYPE>(w, half, b, j, lo, hi);
        half_step<TYPE, MR>(lo, hi, xb, K, j, s_lo, s_hi, d_lo, d_hi);
      }
    }
    __m256 d, m;
    half_scales<TYPE>(w, half, b, d, m);
    half_finish<TYPE, MR>(acc, s_lo, d_lo, d_hi, d, m, dx, sx, c32, nb, b);
  }
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int r = 0; r < MR; ++r) _mm256_maskstore_ps(out + r * ldo, keep, acc[r]);
}

// Batches from WIDE_MIN_ROWS rows (as the AVX-512 `wide_pair`): a half's codes widened to bytes
// once over the whole K (per block 8 x 32 bytes: vectors j = 0..3 the low-nibble values 4j ..
// 4j + 3 of its 8 rows, 4 + j the high-nibble ones: `half_codes`) and its scales (`half_scales`),
// then every row tile runs over the buffer: `panel_half` widens a block once per 4-row tile.
// The same pieces in the same order: a row's bits whatever the batch. The 5- and 6-bit kinds
// only (`WIDE`), from 32 rows (Q5_1 at 16 rows: 1.03x the per-tile time, above).
constexpr int64_t WIDE_MIN_ROWS = 32;

template <int TYPE>
void widen_half(const uint8_t* w, int half, int64_t nb, uint8_t* codes, float* dv, float* mv) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 4; ++j) {
      __m256i lo, hi;
      half_codes<TYPE>(w, half, b, j, lo, hi);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * 256 + 32 * j), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes + b * 256 + 32 * (4 + j)), hi);
    }
    __m256 d, m;
    half_scales<TYPE>(w, half, b, d, m);
    _mm256_storeu_ps(dv + b * 8, d);
    _mm256_storeu_ps(mv + b * 8, m);
  }
}

// MR activation rows x one half widened by `widen_half`.
template <int TYPE, int MR>
inline void wide_half(const uint8_t* codes, const float* dv, const float* mv, const int8_t* qx, int64_t K,
                      const float* dx, const float* sx, const int32_t* c32, float* out, int64_t ldo, int valid) {
  const int64_t nb = K / QK;
  __m256 acc[MR];
  for (int r = 0; r < MR; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = codes + b * 256;
    __m256i s_lo[MR], s_hi[MR], d_lo[MR], d_hi[MR];
    for (int r = 0; r < MR; ++r) s_lo[r] = s_hi[r] = d_lo[r] = d_hi[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * j));
      const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + 32 * (4 + j)));
      half_step<TYPE, MR>(lo, hi, qx + b * QK, K, j, s_lo, s_hi, d_lo, d_hi);
    }
    half_finish<TYPE, MR>(acc, s_lo, d_lo, d_hi, _mm256_loadu_ps(dv + b * 8), _mm256_loadu_ps(mv + b * 8), dx, sx, c32,
                          nb, b);
  }
  const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  for (int r = 0; r < MR; ++r) _mm256_maskstore_ps(out + r * ldo, keep, acc[r]);
}

// Halves [u0, u1) of the output (half u: weight rows [8u, 8u + 8)), every activation row, in
// chunks of rows that stay in cache while the thread's halves pass over them (the `WIDE` kinds
// from WIDE_MIN_ROWS rows: each half widened once, `wide_half`).
template <int TYPE>
void panels_q8(const Q8Problem& p, const uint8_t* packed, const int32_t* c32, int64_t u0, int64_t u1) {
  const int64_t nb = p.K / QK, panel_bytes = nb * panel_block_bytes(TYPE);
  if (WIDE<TYPE> && p.M >= WIDE_MIN_ROWS) {
    thread_local std::vector<uint8_t> codes;
    thread_local std::vector<float> scales;
    codes.resize(size_t(nb * 256));
    scales.resize(size_t(2 * nb * 8));
    float* dv = scales.data();
    float* mv = dv + nb * 8;
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t col = 8 * u;
      const int valid = int(std::min<int64_t>(8, p.N - col));
      if (valid <= 0) continue;
      widen_half<TYPE>(packed + (u / 2) * panel_bytes, int(u % 2), nb, codes.data(), dv, mv);
      for_row_tiles(0, p.M, [&](auto mr, int64_t r) {
        wide_half<TYPE, decltype(mr)::value>(codes.data(), dv, mv, p.qx + r * p.K, p.K, p.dx + r * nb, p.sx + r * nb,
                                             c32 ? c32 + r * 2 * nb : nullptr, p.out + r * p.ldo + col, p.ldo, valid);
      });
    }
    return;
  }
  constexpr int64_t ROW_CHUNK = 64;
  for (int64_t rc = 0; rc < p.M; rc += ROW_CHUNK) {
    const int64_t rc1 = std::min(p.M, rc + ROW_CHUNK);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t col = 8 * u;
      const int valid = int(std::min<int64_t>(8, p.N - col));
      if (valid <= 0) continue;
      const uint8_t* w = packed + (u / 2) * panel_bytes;
      const int half = int(u % 2);
      for_row_tiles(rc, rc1, [&](auto mr, int64_t r) {
        panel_half<TYPE, decltype(mr)::value>(w, half, p.qx + r * p.K, p.K, p.dx + r * nb, p.sx + r * nb,
                                              c32 ? c32 + r * 2 * nb : nullptr, p.out + r * p.ldo + col, p.ldo, valid);
      });
    }
  }
}

}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")
namespace avx512 {

// The int8-activation path with AVX-512 VNNI: two consecutive blocks per 512-bit vector (block b
// in bytes / int32 lanes 0-7, b + 1 in lanes 8-15), one vpdpbusd per block pair and row pair
// instead of AVX2's maddubs + madd per block. What depends only on x (its int8 values, and each
// pair's scales spread over the lanes) is laid out once per call, so a tile's inner loop is the
// dot product, its conversion and two multiply-adds. Integer sums are exact: the result differs
// from the AVX2 path's only in fp32 summation order.

// x's side of the product for block pairs: per row and pair, 64 bytes of int8 x (+128 for Q8_0,
// see tile), 16 floats of dx spread over the pair's halves, and 16 floats holding sx at lanes 0
// and 8 only (the offset term m * sx must count once per block, and the lanes are summed).
struct XPairs {
  const int8_t* q;   // [M, pairs, 64]
  const float* dx;   // [M, pairs, 16]
  const float* sx;   // [M, pairs, 16]
  int64_t pairs;
};

// Blocks b and b + 1 of a weight row as 64 bytes in x's order, and their scale d and offset m
// spread over the halves.
template <int TYPE>
inline void load_pair(const uint8_t* row, const Layout& L, int64_t b, __m512i& q, __m512& d, __m512& m) {
  // (b is even: in Q4_1G, whose groups are 2, 4 or 8 blocks from the row's start, b + 1 shares
  // b's group, so its header, and its codes follow b's.)
  const uint8_t* h0 = row + head_at<TYPE>(L, b);
  const uint8_t* s0 = row + codes_at<TYPE>(L, b);
  const uint8_t* h1 = TYPE == Q4_1G ? h0 : row + head_at<TYPE>(L, b + 1);
  const uint8_t* s1 = TYPE == Q4_1G ? s0 + 16 : row + codes_at<TYPE>(L, b + 1);
  if constexpr (TYPE == Q8_0) {
    q = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s0))),
                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s1)), 1);
  } else {
    // Each block's 16 bytes broadcast to two 128-bit lanes by the loads themselves (no shuffle
    // instruction): [b | b | b+1 | b+1]; the low nibbles of lanes 0 and 2 and the high ones of
    // lanes 1 and 3 are then the values in block order: q0-15 of b, q16-31 of b, same for b + 1.
    const __m512i both = _mm512_mask_blend_epi64(
        0xF0, _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s0))),
        _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s1))));
    const __m512i nibbles = _mm512_mask_mov_epi8(both, 0xFFFF0000FFFF0000ull, _mm512_srli_epi16(both, 4));
    q = _mm512_and_si512(nibbles, _mm512_set1_epi8(0x0F));
  }
  // The fp16 scales (and Q4_1's offsets) of both blocks converted at once, then spread.
  if constexpr (HAS_M<TYPE>) {
    uint32_t a, c;
    std::memcpy(&a, h0, 4);
    std::memcpy(&c, h1, 4);
    const __m512 dm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_unpacklo_epi32(_mm_cvtsi32_si128(int(a)), _mm_cvtsi32_si128(int(c)))));
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2), dm);
    m = _mm512_permutexvar_ps(_mm512_setr_epi32(1, 1, 1, 1, 1, 1, 1, 1, 3, 3, 3, 3, 3, 3, 3, 3), dm);
  } else {
    const int32_t two = int32_t(load_u16(h0)) | (int32_t(load_u16(h1)) << 16);
    const __m512 dd = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two)));
    d = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1), dd);
    m = TYPE == Q4_0 ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f)) : _mm512_setzero_ps();
  }
}

// The last block of a row with an odd number of blocks, as a pair whose second half is zero.
template <int TYPE>
inline void load_last(const uint8_t* row, const Layout& L, int64_t b, __m512i& q, __m512& d, __m512& m) {
  float d0, m0;
  avx2::dm<TYPE>(row + head_at<TYPE>(L, b), d0, m0);
  q = _mm512_castsi256_si512(avx2::load_q<TYPE>(row + codes_at<TYPE>(L, b)));
  q = _mm512_inserti64x4(q, _mm256_setzero_si256(), 1);
  d = _mm512_maskz_mov_ps(0x00FF, _mm512_set1_ps(d0));
  m = _mm512_maskz_mov_ps(0x00FF, _mm512_set1_ps(m0));
}

// NR weight rows x MR activation rows. vpdpbusd multiplies unsigned by signed bytes: Q4 weights
// are unsigned (0..15) and x signed, as it wants. For Q8_0 both are signed, so x arrives moved to
// unsigned (x + 128) and the excess 128 * sum(w) is taken off by starting each sum at
// -128 * sum(w) (one vpdpbusd per weight block pair, shared by the MR rows).
template <int TYPE, int NR, int MR>
inline void tile_q8(const Q8Problem& p, const XPairs& xp, int64_t n, int64_t r0) {
  const int64_t nb = p.K / QK;
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  __m512 acc[NR][MR];
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) acc[a][r] = _mm512_setzero_ps();
  avx2::Ahead ahead(p.w, p.row_bytes, p.N, n);
  for (int64_t j = 0; j < xp.pairs; ++j) {
    const int64_t b = 2 * j;
    ahead.to(p.w + n * p.row_bytes + NR * head_at<TYPE>(p.L, b + 2));
    __m512i wq[NR], start[NR];
    __m512 d[NR], m[NR];
    for (int a = 0; a < NR; ++a) {
      const uint8_t* row = p.w + (n + a) * p.row_bytes;
      if (b + 1 < nb)
        load_pair<TYPE>(row, p.L, b, wq[a], d[a], m[a]);
      else
        load_last<TYPE>(row, p.L, b, wq[a], d[a], m[a]);
      if constexpr (TYPE == Q8_0)
        start[a] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), bias, wq[a]));
    }
    for (int r = 0; r < MR; ++r) {
      const int64_t at = (r0 + r) * xp.pairs + j;
      const __m512i xq = _mm512_loadu_si512(xp.q + at * 64);
      const __m512 dx = _mm512_loadu_ps(xp.dx + at * 16);
      for (int a = 0; a < NR; ++a) {
        __m512i dot;
        if constexpr (TYPE == Q8_0)
          dot = _mm512_dpbusd_epi32(start[a], xq, wq[a]);
        else
          dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq[a], xq);
        acc[a][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d[a], dx), acc[a][r]);
        if constexpr (TYPE != Q8_0) acc[a][r] = _mm512_fmadd_ps(m[a], _mm512_loadu_ps(xp.sx + at * 16), acc[a][r]);
      }
    }
  }
  for (int a = 0; a < NR; ++a)
    for (int r = 0; r < MR; ++r) p.out[(r0 + r) * p.N + n + a] = _mm512_reduce_add_ps(acc[a][r]);
}

constexpr int MR8 = 8;

template <int TYPE, int NR>
inline void rows_tile_q8(const Q8Problem& p, const XPairs& xp, int64_t n) {
  int64_t r0 = 0;
  for (; r0 + MR8 <= p.M; r0 += MR8) tile_q8<TYPE, NR, MR8>(p, xp, n, r0);
  switch (p.M - r0) {
    case 7: tile_q8<TYPE, NR, 7>(p, xp, n, r0); break;
    case 6: tile_q8<TYPE, NR, 6>(p, xp, n, r0); break;
    case 5: tile_q8<TYPE, NR, 5>(p, xp, n, r0); break;
    case 4: tile_q8<TYPE, NR, 4>(p, xp, n, r0); break;
    case 3: tile_q8<TYPE, NR, 3>(p, xp, n, r0); break;
    case 2: tile_q8<TYPE, NR, 2>(p, xp, n, r0); break;
    case 1: tile_q8<TYPE, NR, 1>(p, xp, n, r0); break;
  }
}

template <int TYPE>
void rows_q8(const Q8Problem& p, const XPairs& xp, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M == 1) {  // decode at batch 1: four weight rows at a time
    for (; n + 4 <= n1; n += 4) tile_q8<TYPE, 4, 1>(p, xp, n, 0);
  } else {
    for (; n + 2 <= n1; n += 2) rows_tile_q8<TYPE, 2>(p, xp, n);
  }
  for (; n < n1; ++n) rows_tile_q8<TYPE, 1>(p, xp, n);
}

// x's side laid out for the tiles: rows [r0, r1).
void x_pairs(const Q8Problem& p, bool plus128, int8_t* q, float* dx, float* sx, int64_t r0, int64_t r1) {
  const int64_t nb = p.K / QK, pairs = (nb + 1) / 2;
  const __m512i bias = _mm512_set1_epi8(char(0x80));
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t j = 0; j < pairs; ++j) {
      const int64_t b = 2 * j, at = r * pairs + j, xb = r * nb + b;
      const bool two = b + 1 < nb;
      __m512i v = _mm512_maskz_loadu_epi8(two ? ~__mmask64(0) : __mmask64(0xFFFFFFFF), p.qx + xb * QK);
      if (plus128) v = _mm512_xor_si512(v, bias);  // the second half's zeros meet zero weights
      _mm512_storeu_si512(q + at * 64, v);
      const float d1 = two ? p.dx[xb + 1] : 0.f, s1 = two ? p.sx[xb + 1] : 0.f;
      _mm512_storeu_ps(dx + at * 16, _mm512_insertf32x8(_mm512_set1_ps(p.dx[xb]), _mm256_set1_ps(d1), 1));
      _mm512_storeu_ps(sx + at * 16, _mm512_maskz_mov_ps(0x0101, _mm512_insertf32x8(_mm512_set1_ps(p.sx[xb]), _mm256_set1_ps(s1), 1)));
    }
}


// The pieces `panel_tile` (codes widened per tile, in registers) and `wide_tile` (widened once
// per call into a buffer) share, so that both compute the same way.

// Vector j (0..3) of block b of panel c of a pair, its codes as bytes: lo the values 4j .. 4j + 3
// of the 16 rows, hi 16 + 4j .. (Q5's fifth bits, Q6_K's fifth and sixth added in).
template <int TYPE>
inline void pair_codes(const uint8_t* w, int64_t panel_bytes, int c, int64_t b, int j, __m512i& lo, __m512i& hi) {
  const __m512i mask = _mm512_set1_epi8(0x0F), sixteen = _mm512_set1_epi8(16), thirty_two = _mm512_set1_epi8(32);
  const uint8_t* blk = w + c * panel_bytes + panel_codes_at<TYPE>(b);
  const __m512i raw = _mm512_loadu_si512(blk + 64 * j);
  lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
  if constexpr (TYPE == Q6_K) {  // groups 2t (low nibbles) and 2t + 1 (high), codes 0..63
    uint64_t m4[4];
    std::memcpy(m4, blk + 256 + 32 * j, 32);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(m4[0]), lo, sixteen);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(m4[1]), lo, thirty_two);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(m4[2]), hi, sixteen);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(m4[3]), hi, thirty_two);
  } else if constexpr (FIVE_BIT<TYPE>) {  // codes 0..31: + 16 where the fifth bit is set
    uint64_t l, h;
    std::memcpy(&l, blk + 256 + 16 * j, 8);
    std::memcpy(&h, blk + 256 + 16 * j + 8, 8);
    lo = _mm512_mask_add_epi8(lo, _cvtu64_mask64(l), lo, sixteen);
    hi = _mm512_mask_add_epi8(hi, _cvtu64_mask64(h), hi, sixteen);
  }
}

// Block b's scales for the 16 rows of panel c: d and m (value = d * q + m; Q4_0 / Q5_0: m = -bias
// d; Q8_0: m unused), or for Q6_K its two groups' d * sc in d (low nibbles) and m (high nibbles).
template <int TYPE>
inline void pair_scales(const uint8_t* w, int64_t panel_bytes, int c, int64_t b, __m512& d, __m512& m) {
  m = _mm512_setzero_ps();
  if constexpr (TYPE == Q6_K) {
    const uint8_t* sup = w + c * panel_bytes + (b >> 3) * Q6K_PANEL_SUPER;
    const int64_t t = b & 7;
    auto bytes16 = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup + 3328)));
    d = _mm512_mul_ps(dd, bytes16(sup + 3072 + 32 * t));
    m = _mm512_mul_ps(dd, bytes16(sup + 3072 + 32 * t + 16));
  } else if constexpr (K4<TYPE>) {  // d * sc_t and -(dmin * mn_t), 16 rows
    const uint8_t* sup = w + c * panel_bytes + (b >> 3) * K4_SUPER<TYPE> + K4_SCALES<TYPE>;
    const int64_t t = b & 7;
    auto bytes16 = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    const __m512 dd = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup + 256)));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sup + 288)));
    d = _mm512_mul_ps(dd, bytes16(sup + 16 * t));
    m = _mm512_xor_ps(_mm512_set1_ps(-0.f), _mm512_mul_ps(dmin, bytes16(sup + 128 + 16 * t)));
  } else {
    const uint8_t* blk = w + c * panel_bytes + b * PANEL_BLOCK<TYPE> + PANEL_CODES<TYPE>;
    d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk)));
    if constexpr (PANEL_M<TYPE>)  // (Q4_0's and Q5_0's offsets are taken off in integers: start_sums)
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 32)));
  }
}

// acc += w's unsigned bytes . the 4 signed bytes at x, broadcast to every lane by the vpdpbusd
// itself (EVEX embedded broadcast: GCC 12 does not fold a set1 into it). One-panel tiles (NR = 1)
// use it: each broadcast there serves a single vpdpbusd, so the separate vpbroadcastd is one
// instruction per vpdpbusd saved. Same bits; the time it saves is small against this VM's noise:
// in-process A/Bs at 8-32 rows (2-core Zen 4, SmolLM2 Q4_K_M's and Q6_K's layers, and
// benchmarks/ab/cpu_kernel_ab.py's Q5_0 step) gave 0.88-1.02x, most runs 0.94-0.99x. Pair tiles
// keep one broadcast in a register for both panels: embedded there (a load per vpdpbusd) they
// took 1.02-1.07x.
using i32_alias = int32_t __attribute__((may_alias));
inline __m512i dpbusd_x(__m512i acc, __m512i w, const int8_t* x) {
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*reinterpret_cast<const i32_alias*>(x)));
  return acc;
}

// The 4 signed bytes at x broadcast to every lane (a pair tile's register broadcast).
inline __m512i bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// acc += w . the 4 bytes at x for a tile of NR panels: embedded for one panel, else from xv, the
// register broadcast of those bytes (`bcast4`; unused, and so not made, where NR = 1).
template <int NR>
inline __m512i dot_x(__m512i acc, __m512i w, const int8_t* x, __m512i xv) {
  if constexpr (NR == 1)
    return dpbusd_x(acc, w, x);
  else
    return _mm512_dpbusd_epi32(acc, w, xv);
}

// One vector j (0..3) of a block's codes for MR rows and NR panels: lo times x's values 4j ..,
// hi times 16 + 4j .. into the int32 sums (Q6_K: lo into dl, hi into dh, two scale groups).
template <int TYPE, int MR, int NR>
inline void tile_step(const __m512i* lo, const __m512i* hi, const int8_t* xb, int64_t K, int j, __m512i (*dl)[NR],
                      __m512i (*dh)[NR]) {
  for (int r = 0; r < MR; ++r) {
    const int8_t* xl = xb + r * K + 4 * j;
    const int8_t* xh = xl + 16;
    const __m512i xlv = bcast4(xl), xhv = bcast4(xh);
    for (int c = 0; c < NR; ++c) {
      dl[r][c] = dot_x<NR>(dl[r][c], lo[c], xl, xlv);
      if constexpr (TYPE == Q6_K)
        dh[r][c] = dot_x<NR>(dh[r][c], hi[c], xh, xhv);
      else
        dl[r][c] = dot_x<NR>(dl[r][c], hi[c], xh, xhv);
    }
  }
}

// A block's integer sums for MR rows start from minus what the codes' bias adds to q_w . q_x
// (`panel_product`'s bias sums c, per row and block, Q6_K per group of 16): Q8_0 (codes + 128)
// -128 sum(q_x), Q4_0 / Q5_0 (value = d * (q - 8 | 16)) -8 | -16 sum(q_x), Q6_K (q - 32) -32
// sum(q_x) per group; zero for the types with an m. The sums are then exactly q_w . q_x less the
// bias term, in integers, before any rounding: one multiply-add per output and block fewer for
// Q4_0 / Q5_0 than their m * sx (prefill matmuls of Q4_K_M's Q5_0 layers 0.90-0.96x the time,
// 2-core Zen 4), and no subtraction per output for Q8_0 / Q6_K (the same bits as before).
template <int TYPE, int MR, int NR>
inline void start_sums(__m512i (*dl)[NR], __m512i (*dh)[NR], const int32_t* c, int64_t nb, int64_t b) {
  for (int r = 0; r < MR; ++r) {
    __m512i l = _mm512_setzero_si512(), h = _mm512_setzero_si512();
    if constexpr (TYPE == Q6_K) {
      l = _mm512_set1_epi32(c[r * 2 * nb + 2 * b]), h = _mm512_set1_epi32(c[r * 2 * nb + 2 * b + 1]);
    } else if constexpr (TYPE == Q8_0 || PANEL_BIAS<TYPE> != 0.f) {
      l = _mm512_set1_epi32(c[r * nb + b]);
    }
    for (int j = 0; j < NR; ++j) dl[r][j] = l, dh[r][j] = h;
  }
}

// A block's sums (from `start_sums`) into the accumulators, times its scales (`pair_scales`) and
// each row's dx (and m * sx for the types with an m). Q6_K's two groups are joined before dx is
// applied (sum_lo * d + sum_hi * m, then times dx: 5 vector operations per output instead of 6,
// which share the pipes with the tile's vpdpbusd): its matmuls took 0.88-0.96x the time in
// interleaved A/B (2-core Zen 4, SmolLM2's Q6_K down_proj layers, 32 to 2,048 rows).
template <int TYPE, int MR, int NR>
inline void tile_finish(__m512 (*acc)[NR], __m512i (*dl)[NR], __m512i (*dh)[NR], const __m512* d, const __m512* m,
                        const float* dx, const float* sx, int64_t nb, int64_t b) {
  for (int r = 0; r < MR; ++r) {
    const __m512 dxr = _mm512_set1_ps(dx[r * nb + b]);
    if constexpr (TYPE == Q6_K) {
      for (int c = 0; c < NR; ++c) {
        const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(dl[r][c]), d[c]);
        const __m512 t = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dh[r][c]), m[c], lo);
        acc[r][c] = _mm512_fmadd_ps(t, dxr, acc[r][c]);
      }
    } else {
      for (int c = 0; c < NR; ++c) {
        acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dl[r][c]), _mm512_mul_ps(d[c], dxr), acc[r][c]);
        if constexpr (TYPE != Q8_0 && PANEL_BIAS<TYPE> == 0.f)
          acc[r][c] = _mm512_fmadd_ps(m[c], _mm512_set1_ps(sx[r * nb + b]), acc[r][c]);
      }
    }
  }
}

// SwiGLU's silu(g) * u over 16 lanes: layer_ops' silu_mul_row_vec (core/lmstack/csrc/layer_ops.cpp)
// operation for operation, each rounded on its own, so a fused gate_up gives the bits of its two
// halves' products put through silu_mul_ (tests hold them equal). layer_ops builds with
// -ffp-contract=off; here each product is pinned (`rounded`) so that GCC, which contracts a
// multiply and an add into one fused multiply-add by default, keeps them two roundings.
inline __m512 rounded(__m512 v) {
  asm("" : "+v"(v));
  return v;
}

inline __m512 silu_mul16(__m512 g, __m512 u) {
  const __m512 one = _mm512_set1_ps(1.0f), magic = _mm512_set1_ps(12582912.0f);
  auto mul = [](__m512 a, float b) { return rounded(_mm512_mul_ps(a, _mm512_set1_ps(b))); };
  const __m512 x = _mm512_min_ps(_mm512_max_ps(_mm512_xor_ps(g, _mm512_set1_ps(-0.0f)), _mm512_set1_ps(-87.0f)),
                                 _mm512_set1_ps(88.0f));
  const __m512 k = _mm512_sub_ps(_mm512_add_ps(mul(x, 1.44269504088896341f), magic), magic);
  __m512 r = _mm512_sub_ps(x, mul(k, 0.693145751953125f));
  r = _mm512_sub_ps(r, mul(k, 1.428606765330187e-06f));
  __m512 e = _mm512_set1_ps(1.0f / 720);
  for (const float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f})
    e = _mm512_add_ps(rounded(_mm512_mul_ps(e, r)), _mm512_set1_ps(c));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(k), _mm512_set1_epi32(127)), 23);
  const __m512 den = _mm512_add_ps(one, rounded(_mm512_mul_ps(e, _mm512_castsi512_ps(bits))));
  return _mm512_mul_ps(_mm512_div_ps(g, den), u);
}

template <int MR, int NR, int MODE = PLAIN>
inline void store_tile(__m512 (*acc)[NR], float* out, int64_t ldo, int valid_last) {
  for (int r = 0; r < MR; ++r) {
    if constexpr (MODE == GLU) {
      static_assert(NR == 2, "a SwiGLU tile holds a gate and an up panel");
      _mm512_storeu_ps(out + r * ldo, silu_mul16(acc[r][0], acc[r][1]));
    } else if constexpr (MODE == UP) {
      _mm512_storeu_ps(out + r * ldo, silu_mul16(_mm512_loadu_ps(out + r * ldo), acc[r][0]));
    } else {
      for (int c = 0; c < NR; ++c) {
        const __mmask16 keep = c == NR - 1 ? __mmask16((1u << valid_last) - 1) : __mmask16(0xFFFF);
        float* at = out + r * ldo + c * PANEL;
        if constexpr (MODE == ADD)  // one rounding, as torch's add_ of the product
          _mm512_mask_storeu_ps(at, keep, _mm512_add_ps(acc[r][c], _mm512_maskz_loadu_ps(keep, at)));
        else
          _mm512_mask_storeu_ps(at, keep, acc[r][c]);
      }
    }
  }
}

// MR activation rows x NR panels (16 outputs each, panel c at w + c * panel_bytes) over every block.
template <int TYPE, int MR, int NR, int MODE = PLAIN>
inline void panel_tile(const uint8_t* w, int64_t panel_bytes, const int8_t* qx, int64_t K, const float* dx,
                       const float* sx, const int32_t* sums, float* out, int64_t ldo, int valid_last) {
  constexpr int64_t PB = PANEL_BLOCK<TYPE>;
  const int64_t nb = K / QK;
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    // Each panel is its own stream of PB-byte blocks: every line of a block PREFETCH_BYTES ahead
    // of it (a hint: no fault past the end). Without it a decode row read the panels at ~37 GB/s
    // on a Zen 5, where the block kernel's software prefetch streams its rows at ~50. Q8_0's
    // blocks, the most bytes per product, are prefetched into L2 only (T1): in-process A/B on a
    // 2-core Zen 4, every layer of a file in turn, 9 rounds: the Q6_K file's (mostly Q8_0)
    // matmuls 0.86-0.91x the time at 1 row, 0.80-0.89x at 8, 0.98-1.00x at 32, the Q8_0 LM head
    // 0.80-0.94x; T1 for the other kinds too moved them 0.85-1.33x (K-quants slower), so not.
    for (int c = 0; c < NR; ++c) {
      const char* next = reinterpret_cast<const char*>(w + c * panel_bytes + panel_codes_at<TYPE>(b)) + PREFETCH_BYTES;
      for (int64_t o = 0; o < PB; o += 64) _mm_prefetch(next + o, TYPE == Q8_0 ? _MM_HINT_T1 : _MM_HINT_T0);
    }
    const int8_t* xb = qx + b * QK;
    __m512i dl[MR][NR], dh[MR][NR];
    start_sums<TYPE, MR, NR>(dl, dh, sums, nb, b);
    if constexpr (TYPE == Q8_0) {
      for (int t = 0; t < 8; ++t) {
        __m512i wv[NR];
        for (int c = 0; c < NR; ++c) wv[c] = _mm512_loadu_si512(w + c * panel_bytes + b * PB + 64 * t);
        for (int r = 0; r < MR; ++r) {
          const int8_t* x = xb + r * K + 4 * t;
          const __m512i xv = bcast4(x);
          for (int c = 0; c < NR; ++c) dl[r][c] = dot_x<NR>(dl[r][c], wv[c], x, xv);
        }
      }
    } else {
      for (int j = 0; j < 4; ++j) {
        __m512i lo[NR], hi[NR];
        for (int c = 0; c < NR; ++c) pair_codes<TYPE>(w, panel_bytes, c, b, j, lo[c], hi[c]);
        tile_step<TYPE, MR, NR>(lo, hi, xb, K, j, dl, dh);
      }
    }
    __m512 d[NR], m[NR];
    for (int c = 0; c < NR; ++c) pair_scales<TYPE>(w, panel_bytes, c, b, d[c], m[c]);
    tile_finish<TYPE, MR, NR>(acc, dl, dh, d, m, dx, sx, nb, b);
  }
  store_tile<MR, NR, MODE>(acc, out, ldo, valid_last);
}

// Rows [r0, r1) of NR panels in tiles of MR rows and one of the rest.
template <int TYPE, int NR, int MR = 4, int MODE = PLAIN>
inline void panel_rows(const uint8_t* w, int64_t panel_bytes, const Q8Problem& p, const int32_t* sums, int64_t r0,
                       int64_t r1, int64_t col, int valid_last) {
  const int64_t nb = p.K / QK;
  for_row_tiles<MR>(r0, r1, [&](auto mr, int64_t r) {
    panel_tile<TYPE, decltype(mr)::value, NR, MODE>(w, panel_bytes, p.qx + r * p.K, p.K, p.dx + r * nb,
                                                    p.sx + r * nb,
                                                    sums ? sums + r * nb * (TYPE == Q6_K ? 2 : 1) : nullptr,
                                                    p.out + r * p.ldo + col, p.ldo, valid_last);
  });
}

// --- batches: a panel pair's codes widened to bytes once, then every row tile over them ----------
//
// `panel_tile` widens a block's 5- or 6-bit codes to bytes (and makes its scales) for each tile of
// 4 rows, so at 64 rows a block's codes are widened 16 times: about as many vector instructions
// as the tile's vpdpbusd. From WIDE_MIN_ROWS rows a thread of a `WIDE` kind first widens its panel
// pair over the whole K into a buffer of Q8_0-like vectors (per block and panel 8 x 64 bytes:
// vector t holds the values 4t .. 4t + 3 of the 16 rows, codes 0..31 / 0..63 as bytes) and each
// block's scales into fp32 (the values `panel_tile` makes, by the same operations), and then runs
// its row tiles over the buffer (K = 1536: 48 KB, in L2). Integer sums are exact and each output
// takes the same fp32 operations in the same order as in `panel_tile`: the same bits for a row
// whatever the batch. From 64 rows, Q6_K's from 32: at 32 Q5_1 took 1.07x the per-tile time,
// Q6_K 0.89x (above; again 0.95x for SmolLM2's Q6_K down_proj layers, 2-core Zen 4).
template <int TYPE>
constexpr int64_t WIDE_MIN_ROWS = TYPE == Q6_K ? 32 : 64;

template <int TYPE, int NR>
void widen_pair(const uint8_t* w, int64_t panel_bytes, int64_t nb, uint8_t* codes, float* dv, float* mv) {
  for (int64_t b = 0; b < nb; ++b)
    for (int c = 0; c < NR; ++c) {
      uint8_t* dst = codes + (b * NR + c) * 512;
      for (int j = 0; j < 4; ++j) {
        __m512i lo, hi;
        pair_codes<TYPE>(w, panel_bytes, c, b, j, lo, hi);
        _mm512_storeu_si512(dst + 64 * j, lo);
        _mm512_storeu_si512(dst + 64 * (4 + j), hi);
      }
      __m512 d, m;
      pair_scales<TYPE>(w, panel_bytes, c, b, d, m);
      _mm512_storeu_ps(dv + (b * NR + c) * PANEL, d);
      _mm512_storeu_ps(mv + (b * NR + c) * PANEL, m);
    }
}

// MR rows x NR panels over every block of a pair widened by `widen_pair`.
template <int TYPE, int MR, int NR, int MODE = PLAIN>
inline void wide_tile(const uint8_t* codes, const float* dv, const float* mv, const int8_t* qx, int64_t K,
                      const float* dx, const float* sx, const int32_t* sums, float* out, int64_t ldo,
                      int valid_last) {
  const int64_t nb = K / QK;
  __m512 acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* wb = codes + b * NR * 512;
    __m512i dl[MR][NR], dh[MR][NR];
    start_sums<TYPE, MR, NR>(dl, dh, sums, nb, b);
    for (int j = 0; j < 4; ++j) {
      __m512i lo[NR], hi[NR];
      for (int c = 0; c < NR; ++c) {
        lo[c] = _mm512_loadu_si512(wb + c * 512 + 64 * j);
        hi[c] = _mm512_loadu_si512(wb + c * 512 + 64 * (4 + j));
      }
      tile_step<TYPE, MR, NR>(lo, hi, qx + b * QK, K, j, dl, dh);
    }
    __m512 d[NR], m[NR];
    for (int c = 0; c < NR; ++c) {
      d[c] = _mm512_loadu_ps(dv + (b * NR + c) * PANEL);
      m[c] = _mm512_loadu_ps(mv + (b * NR + c) * PANEL);
    }
    tile_finish<TYPE, MR, NR>(acc, dl, dh, d, m, dx, sx, nb, b);
  }
  store_tile<MR, NR, MODE>(acc, out, ldo, valid_last);
}

template <int TYPE, int NR, int MODE = PLAIN>
void wide_pair(const uint8_t* w, int64_t panel_bytes, const Q8Problem& p, const int32_t* sums, int64_t col,
               int valid_last) {
  const int64_t nb = p.K / QK;
  thread_local std::vector<uint8_t> codes;
  thread_local std::vector<float> scales;
  codes.resize(size_t(nb * NR * 512));
  scales.resize(size_t(2 * nb * NR * PANEL));
  float* dv = scales.data();
  float* mv = dv + nb * NR * PANEL;
  widen_pair<TYPE, NR>(w, panel_bytes, nb, codes.data(), dv, mv);
  for_row_tiles(0, p.M, [&](auto mr, int64_t r) {
    wide_tile<TYPE, decltype(mr)::value, NR, MODE>(codes.data(), dv, mv, p.qx + r * p.K, p.K, p.dx + r * nb,
                                                  p.sx + r * nb,
                                                  sums ? sums + r * nb * (TYPE == Q6_K ? 2 : 1) : nullptr,
                                                  p.out + r * p.ldo + col, p.ldo, valid_last);
  });
}

// Batches under 64 rows (under 32 for Q6_K, with its second set of sums) run one panel at a time
// (NR = 1) in tiles of TALL rows and one of the rest: a block's codes are widened once per 8 rows
// instead of once per 4, and each thread reads one panel's stream at a time. From 64 rows the
// pair tiles win (x's broadcasts per vpdpbusd are twice as many with NR = 1). A row's operations
// are those of any tile: the same bits. In-process A/B on 2-core Zen 4, the 30 layers' matmuls,
// one-panel / pair tiles: Q4_1 0.82 (1 row), 0.84-0.91 (2-4), 0.74-0.82 (5-7), 0.83 / 0.91 /
// 1.00 (8 / 16 / 32); Q4_K_M's file (Q5_0, Q8_0, Q4_K, Q6_K) 0.76, 0.73-0.79, 0.67-0.70, 0.78 /
// 0.84 / 0.91; Q6_K's 0.82 (1), 0.81 (4), 0.91 / 0.98 (8 / 16), 1.02 at 32.
constexpr int TALL = 8;
template <int TYPE>
constexpr int64_t TALL_MAX_ROWS = TYPE == Q6_K ? 31 : 63;

// Panel pairs [t0, t1) of the output (the last pair may be one panel), every activation row, in
// chunks of rows so that a chunk of x stays in cache while the thread's panels pass over it
// (the `WIDE` kinds from WIDE_MIN_ROWS rows: each pair widened once, `wide_pair`; small batches:
// one panel at a time in tiles of TALL rows). EPI GLU: the packed rows are a gate_up layer's gate
// then up halves, p.N the width of one (a multiple of PANEL); pair t is gate panel t and up panel
// t, and the tiles write silu(gate) * up to output columns 16t.. (p.N of them in all): the same
// products as the plain call, so the bits of its output put through layer_ops' silu_mul_. EPI
// ADD: the products added to out's values (the plain call's output then torch's add_, bit for bit).
template <int TYPE, int EPI = PLAIN>
void panels_q8(const Q8Problem& p, const uint8_t* packed, const int32_t* sums, int64_t t0, int64_t t1) {
  const int64_t panels = (p.N + PANEL - 1) / PANEL, panel_bytes = p.K / QK * panel_block_bytes(TYPE);
  constexpr bool SWIGLU = EPI == GLU;
  // f(NR, the pair's first panel, the bytes from it to its second, its first output column, the
  // valid outputs of its last panel).
  auto each_pair = [&](auto&& f) {
    for (int64_t t = t0; t < t1; ++t) {
      if constexpr (SWIGLU) {
        f(std::integral_constant<int, 2>(), packed + t * panel_bytes, panels * panel_bytes, t * PANEL, PANEL);
      } else {
        const int64_t first = 2 * t;
        const uint8_t* w = packed + first * panel_bytes;
        const int valid_last = int(std::min<int64_t>(PANEL, p.N - (first + (first + 1 < panels ? 1 : 0)) * PANEL));
        if (first + 1 < panels)
          f(std::integral_constant<int, 2>(), w, panel_bytes, first * PANEL, valid_last);
        else
          f(std::integral_constant<int, 1>(), w, panel_bytes, first * PANEL, valid_last);
      }
    }
  };
  if (WIDE<TYPE> && p.M >= WIDE_MIN_ROWS<TYPE>) {
    each_pair([&](auto nr, const uint8_t* w, int64_t stride, int64_t col, int valid_last) {
      wide_pair<TYPE, decltype(nr)::value, EPI>(w, stride, p, sums, col, valid_last);
    });
    return;
  }
  if (p.M <= TALL_MAX_ROWS<TYPE>) {
    each_pair([&](auto nr, const uint8_t* w, int64_t stride, int64_t col, int valid_last) {
      if constexpr (SWIGLU) {  // the gate's outputs into out, then silu of them times the up's
        panel_rows<TYPE, 1, TALL>(w, stride, p, sums, 0, p.M, col, PANEL);
        panel_rows<TYPE, 1, TALL, UP>(w + stride, stride, p, sums, 0, p.M, col, PANEL);
      } else {
        constexpr int NR = decltype(nr)::value;
        for (int c = 0; c < NR; ++c)
          panel_rows<TYPE, 1, TALL, EPI>(w + c * stride, stride, p, sums, 0, p.M, col + c * PANEL,
                                         c == NR - 1 ? valid_last : PANEL);
      }
    });
    return;
  }
  constexpr int64_t ROW_CHUNK = 64;
  for (int64_t rc = 0; rc < p.M; rc += ROW_CHUNK) {
    const int64_t rc1 = std::min(p.M, rc + ROW_CHUNK);
    each_pair([&](auto nr, const uint8_t* w, int64_t stride, int64_t col, int valid_last) {
      panel_rows<TYPE, decltype(nr)::value, 4, EPI>(w, stride, p, sums, rc, rc1, col, valid_last);
    });
  }
}

// --- fp32 activations with AVX-512 ---------------------------------------------------------------
//
// A block's 32 values as two 16-lane vectors (Q4: the low nibbles are values 0-15, the high ones
// 16-31), times d; per output two accumulators of x * (d * q) and a scalar offset m * sum(x_block)
// (std::fma: the same rounding whatever the compiler contracts). Every output is computed by the
// same operations in the same order whatever the tile it falls in and however many activation
// rows the call has: a row multiplied alone (decode) gives the bits it gets among others (the
// rows of a speculative verification, a batch), so what a step computes for a sequence does not
// depend on what else the step runs. The tile shares each widened block among up to 4 rows.

template <int TYPE>
inline void widen16(const uint8_t* codes, __m512& v0, __m512& v1) {
  if constexpr (TYPE == Q8_0) {
    const __m128i* s = reinterpret_cast<const __m128i*>(codes);
    v0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(s)));
    v1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(s + 1)));
  } else {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(0x0F);
    v0 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(raw, mask)));
    v1 = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(raw, 4), mask)));
  }
}

// NR weight rows from n x MR activation rows from r0. The offsets m * sum(x_block) of the MR rows
// are the lanes of one vector (`xsum_by_block` holds each block's sums of every row side by side):
// one fused multiply-add per block whatever MR, each lane rounded as a scalar std::fma would be.
template <int TYPE, int NR, int MR>
inline void tile_f32(const Problem& p, int64_t n, int64_t r0) {
  const int64_t nb = p.K / QK;
  const __mmask16 lanes = __mmask16((1u << MR) - 1);
  __m512 acc[NR][MR][2], off[NR];
  for (int a = 0; a < NR; ++a) {
    off[a] = _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) acc[a][r][0] = acc[a][r][1] = _mm512_setzero_ps();
  }
  const uint8_t* w0 = p.w + n * p.row_bytes;
  avx2::Ahead ahead(p.w, p.row_bytes, p.N, n);
  for (int64_t b = 0; b < nb; ++b) {
    ahead.to(w0 + NR * head_at<TYPE>(p.L, b + 1));
    __m512 sums = _mm512_setzero_ps();
    if constexpr (TYPE != Q8_0) sums = _mm512_maskz_loadu_ps(lanes, p.xsum_by_block + b * p.M + r0);
    for (int a = 0; a < NR; ++a) {
      const uint8_t* row = w0 + a * p.row_bytes;
      __m512 v0, v1;
      widen16<TYPE>(row + codes_at<TYPE>(p.L, b), v0, v1);
      float d, m;
      avx2::dm<TYPE>(row + head_at<TYPE>(p.L, b), d, m);
      const __m512 dv = _mm512_set1_ps(d);
      v0 = _mm512_mul_ps(v0, dv);
      v1 = _mm512_mul_ps(v1, dv);
      for (int r = 0; r < MR; ++r) {
        const float* xb = p.x + (r0 + r) * p.ldx + b * QK;
        acc[a][r][0] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(xb), acc[a][r][0]);
        acc[a][r][1] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(xb + 16), acc[a][r][1]);
      }
      if constexpr (TYPE != Q8_0) off[a] = _mm512_fmadd_ps(_mm512_set1_ps(m), sums, off[a]);
    }
  }
  for (int a = 0; a < NR; ++a) {
    alignas(64) float offs[16];
    _mm512_store_ps(offs, off[a]);
    for (int r = 0; r < MR; ++r)
      p.out[(r0 + r) * p.N + n + a] = _mm512_reduce_add_ps(_mm512_add_ps(acc[a][r][0], acc[a][r][1])) + offs[r];
  }
}

// Weight row n for every activation row, in tiles of 8 rows and one of the rest: each widened
// block serves a whole tile. (Two weight rows per tile of one or two activation rows, for more
// independent accumulators, measured slower on a 2-core Zen 5: 5.1 vs 4.3 ms for a model's
// layers at two rows.)
template <int TYPE>
inline void rows_tile_f32(const Problem& p, int64_t n) {
  int64_t r = 0;
  for (; r + 8 <= p.M; r += 8) tile_f32<TYPE, 1, 8>(p, n, r);
  switch (p.M - r) {
    case 7: tile_f32<TYPE, 1, 7>(p, n, r); break;
    case 6: tile_f32<TYPE, 1, 6>(p, n, r); break;
    case 5: tile_f32<TYPE, 1, 5>(p, n, r); break;
    case 4: tile_f32<TYPE, 1, 4>(p, n, r); break;
    case 3: tile_f32<TYPE, 1, 3>(p, n, r); break;
    case 2: tile_f32<TYPE, 1, 2>(p, n, r); break;
    case 1: tile_f32<TYPE, 1, 1>(p, n, r); break;
    default: break;
  }
}

template <int TYPE>
void rows_f32(const Problem& p, int64_t n0, int64_t n1) {
  int64_t n = n0;
  if (p.M == 1)  // decode at batch 1: four weight rows at a time, eight independent chains
    for (; n + 4 <= n1; n += 4) tile_f32<TYPE, 4, 1>(p, n, 0);
  for (; n < n1; ++n) rows_tile_f32<TYPE>(p, n);
}
}  // namespace avx512
#pragma GCC pop_options

void check_weight(const torch::Tensor& w, int64_t type, int64_t k) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous CPU uint8 tensor [N, bytes per row]");
  TORCH_CHECK(k > 0 && k % QK == 0, "K must be a positive multiple of ", QK, ", got ", k);
  TORCH_CHECK(w.size(1) == row_bytes(type, k), "w rows hold ", w.size(1), " bytes; K = ", k, " needs ",
              row_bytes(type, k));
}

// The product's operands checked, and its uninitialised output [M, N].
torch::Tensor checked_output(const torch::Tensor& x, const torch::Tensor& w, int64_t type) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2,
              "x must be a CPU float32 tensor [M, K]");
  TORCH_CHECK(x.stride(1) == 1, "x rows must be contiguous");
  check_weight(w, type, x.size(1));
  return torch::empty({x.size(0), w.size(0)}, x.options());
}

torch::Tensor gguf_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t isa) {
  auto out = checked_output(x, w, type);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (isa < 0) isa = best_isa();
  if (M == 0 || N == 0) return out;
  const float* xp = x.data_ptr<float>();
  // Each block's sum of x, once per call, for the offset term m * sum(x_block) of the AVX-512,
  // one-row and scalar paths (AVX2's several-row path folds m into the widened weights instead),
  // laid out [M, K / QK], or [K / QK, M] for the AVX-512 tiles.
  const bool by_block = isa >= ISA_AVX512;
  std::vector<float> xsum;
  if (M == 1 || isa != ISA_AVX2) {
    const int64_t nb = K / QK;
    xsum.resize(M * nb);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        float s = 0.f;
        for (int j = 0; j < QK; ++j) s += xp[r * x.stride(0) + b * QK + j];
        xsum[by_block ? b * M + r : r * nb + b] = s;
      }
  }
  Problem p{xp,
            x.stride(0),
            by_block ? nullptr : xsum.data(),
            by_block ? xsum.data() : nullptr,
            w.data_ptr<uint8_t>(),
            w.size(1),
            layout_of(type),
            out.data_ptr<float>(),
            M,
            N,
            K};
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (isa >= ISA_AVX512) {
      with_kind(p.L, [&](auto t) { avx512::rows_f32<decltype(t)::value>(p, n0, n1); });
    } else if (isa >= ISA_AVX2) {
      with_kind(p.L, [&](auto t) { avx2::rows<decltype(t)::value>(p, n0, n1); });
    } else {
      rows_scalar(p, n0, n1);
    }
  });
  return out;
}

// The plain-C++ twins of the int8-activation path (same rounding: nearbyintf under the default
// round-to-nearest-even mode, as the vector conversion).
void quantize_block_scalar(const float* x, int8_t* q, float& dx, float& sx) {
  float amax = 0.f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.f;
  const float id = d != 0.f ? 1.f / d : 0.f;
  int sum = 0;
  for (int j = 0; j < QK; ++j) {
    const int v = int(std::nearbyintf(x[j] * id));
    q[j] = int8_t(v);
    sum += v;
  }
  dx = d;
  sx = d * float(sum);
}

void rows_q8_scalar(const Q8Problem& p, int64_t n0, int64_t n1) {
  const int64_t nb = p.K / QK;
  const bool q8 = p.L.kind == Q8_0;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t r = 0; r < p.M; ++r) {
      float acc = 0.f;
      const uint8_t* row = p.w + n * p.row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        float d, m;
        block_dm(p.L, row, b, d, m);
        const int8_t* xq = p.qx + (r * nb + b) * QK;
        int dot = 0;
        if (q8) {
          const int8_t* wq = reinterpret_cast<const int8_t*>(row + p.L.codes_at(b));
          for (int j = 0; j < QK; ++j) dot += int(wq[j]) * int(xq[j]);
        } else {
          const uint8_t* wq = row + p.L.codes_at(b);
          for (int j = 0; j < QK / 2; ++j) dot += int(wq[j] & 0x0F) * int(xq[j]) + int(wq[j] >> 4) * int(xq[j + QK / 2]);
        }
        acc += d * p.dx[r * nb + b] * float(dot) + (q8 ? 0.f : m * p.sx[r * nb + b]);
      }
      p.out[r * p.N + n] = acc;
    }
}

// x [M, K] fp32 -> (q int8 [M, K], dx [M, K / 32], sx [M, K / 32]): what gguf_matmul_q8 multiplies by.
std::vector<torch::Tensor> quantize_q8(const torch::Tensor& x, int64_t isa) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU float32 tensor [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  TORCH_CHECK(K > 0 && K % QK == 0, "K must be a positive multiple of ", QK, ", got ", K);
  if (isa < 0) isa = best_isa();
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto dx = torch::empty({M, nb}, x.options()), sx = torch::empty({M, nb}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  float *dp = dx.data_ptr<float>(), *sp = sx.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* src = xp + r * x.stride(0) + b * QK;
        int8_t* dst = qp + (r * nb + b) * QK;
        if (isa >= ISA_AVX2)
          avx2::quantize_block(src, dst, dp[r * nb + b], sp[r * nb + b]);
        else
          quantize_block_scalar(src, dst, dp[r * nb + b], sp[r * nb + b]);
      }
  });
  return {q, dx, sx};
}

torch::Tensor gguf_matmul_q8(const torch::Tensor& x, const torch::Tensor& w, int64_t type, int64_t isa) {
  auto out = checked_output(x, w, type);
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  if (isa < 0) isa = best_isa();
  if (M == 0 || N == 0) return out;
  const auto qx = quantize_q8(x, isa);
  Q8Problem p{qx[0].data_ptr<int8_t>(), qx[1].data_ptr<float>(), qx[2].data_ptr<float>(), w.data_ptr<uint8_t>(),
              w.size(1), layout_of(type), out.data_ptr<float>(), M, N, K, N};
  // AVX-512: x's side of the tiles, laid out once (small: 48 + 128 bytes per 64 values of x).
  avx512::XPairs xp{nullptr, nullptr, nullptr, (K / QK + 1) / 2};
  torch::Tensor xq2, xs2;
  if (isa >= ISA_AVX512) {
    xq2 = torch::empty({M, xp.pairs * 64}, x.options().dtype(torch::kInt8));
    xs2 = torch::empty({2, M, xp.pairs * 16}, x.options());
    int8_t* q2 = xq2.data_ptr<int8_t>();
    float *dx2 = xs2.data_ptr<float>(), *sx2 = dx2 + M * xp.pairs * 16;
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) { avx512::x_pairs(p, type == Q8_0, q2, dx2, sx2, r0, r1); });
    xp = {q2, dx2, sx2, xp.pairs};
  }
  const int64_t grain = std::max<int64_t>(4, 16384 / std::max<int64_t>(1, K * M));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (isa >= ISA_AVX512) {
      with_kind(p.L, [&](auto t) { avx512::rows_q8<decltype(t)::value>(p, xp, n0, n1); });
    } else if (isa >= ISA_AVX2) {
      with_kind(p.L, [&](auto t) { avx2::rows_q8<decltype(t)::value>(p, n0, n1); });
    } else {
      rows_q8_scalar(p, n0, n1);
    }
  });
  return out;
}

// Q5_0 / Q5_1 rows (kept packed by kquants.cpp; the panels are this file's): fp16 d, (Q5_1) fp16 m,
// 4 bytes of fifth bits (bit j: value j), 16 bytes of low nibbles as Q4's.
inline bool five_bit(int64_t type) { return type == Q5_0 || type == Q5_1; }
inline int64_t five_bit_block_bytes(int64_t type) { return type == Q5_0 ? 22 : 24; }

// Q4_K: the 8 six-bit scales and mins of a super-block from its 12 packed bytes, and back.
inline void unpack_scales_k4(const uint8_t* q, uint8_t sc[8], uint8_t mn[8]) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = q[j] & 63;
    mn[j] = q[j + 4] & 63;
    sc[j + 4] = (q[j + 8] & 15) | ((q[j] >> 6) << 4);
    mn[j + 4] = (q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4);
  }
}
inline void pack_scales_k4(const uint8_t sc[8], const uint8_t mn[8], uint8_t* q) {
  for (int j = 0; j < 4; ++j) {
    q[j] = uint8_t(sc[j] | ((sc[j + 4] >> 4) << 6));
    q[j + 4] = uint8_t(mn[j] | ((mn[j + 4] >> 4) << 6));
    q[j + 8] = uint8_t((sc[j + 4] & 15) | ((mn[j + 4] & 15) << 4));
  }
}

// Super-block sb of a Q4_K row (144 bytes: fp16 d, dmin, 12 bytes of scales, 128 of codes: value
// 64h + l (l < 32) in the low nibble of byte 32h + l, value 64h + 32 + l in its high one) into
// row c of a panel super-block (layout above), or back (to_panel false).
// Q5_K (176 bytes): the same with 32 bytes of fifth bits (value j: byte j % 32, bit j / 32) before
// the codes, which go to Q5_0's masks after each block's panel codes (`five`).
void k4_row_panel(uint8_t* blk, uint8_t* sup, int c, bool to_panel, bool five) {
  const int64_t codes = five ? 320 : 256, at = 8 * codes;  // the scales' offset in the super-block
  const int qs = five ? 48 : 16;
  uint8_t sc[8], mn[8];
  if (to_panel) {
    std::memcpy(sup + at + 256 + 2 * c, blk, 2);
    std::memcpy(sup + at + 288 + 2 * c, blk + 2, 2);
    unpack_scales_k4(blk + 4, sc, mn);
    for (int t = 0; t < 8; ++t) sup[at + 16 * t + c] = sc[t], sup[at + 128 + 16 * t + c] = mn[t];
  } else {
    std::memcpy(blk, sup + at + 256 + 2 * c, 2);
    std::memcpy(blk + 2, sup + at + 288 + 2 * c, 2);
    for (int t = 0; t < 8; ++t) sc[t] = sup[at + 16 * t + c], mn[t] = sup[at + 128 + 16 * t + c];
    pack_scales_k4(sc, mn, blk + 4);
  }
  // Block t's value v (0..31) sits in Q4's panel byte 64 (v % 16 / 4) + 4c + v % 4, nibble v / 16;
  // its fifth bit in mask 2 (v % 16 / 4) + v / 16 at bit 4c + v % 4.
  for (int t = 0; t < 8; ++t)
    for (int v = 0; v < 32; ++v) {
      const int j = 32 * t + v;  // value in the super-block
      uint8_t& file = blk[qs + 32 * (j / 64) + j % 32];
      const int file_shift = 4 * ((j / 32) % 2);
      uint8_t* panel_block = sup + codes * t;
      uint8_t& panel = panel_block[64 * (v % 16 / 4) + 4 * c + v % 4];
      const int panel_shift = 4 * (v / 16), pos = 4 * c + v % 4;
      uint8_t& mask = panel_block[256 + 16 * (v % 16 / 4) + 8 * (v / 16) + pos / 8];
      uint8_t& high = blk[16 + j % 32];
      if (to_panel) {
        panel = uint8_t(panel | (((file >> file_shift) & 15) << panel_shift));
        if (five && ((high >> (j / 32)) & 1)) mask |= uint8_t(1u << (pos % 8));
      } else {
        file = uint8_t((file & ~(15 << file_shift)) | (((panel >> panel_shift) & 15) << file_shift));
        if (five && ((mask >> (pos % 8)) & 1)) high |= uint8_t(1u << (j / 32));
      }
    }
}

// Super-block sb of a Q6_K row (210 bytes: ql[128] the low 4 bits, value 128h + r (r < 128) in
// byte 64h + r % 64, nibble r / 64; qh[64] the high 2 bits, value 128h + r in byte 32h + r % 32 at
// bit 2 (r / 32); 16 int8 scales; fp16 d) into row c of a panel super-block (layout above), or back.
void q6_k_row_panel(uint8_t* blk, uint8_t* sup, int c, bool to_panel) {
  if (to_panel) {
    std::memcpy(sup + 3328 + 2 * c, blk + 208, 2);
    for (int g = 0; g < 16; ++g) sup[3072 + 16 * g + c] = blk[192 + g];
  } else {
    std::memcpy(blk + 208, sup + 3328 + 2 * c, 2);
    for (int g = 0; g < 16; ++g) blk[192 + g] = sup[3072 + 16 * g + c];
  }
  for (int t = 0; t < 8; ++t)
    for (int v = 0; v < 32; ++v) {
      const int j = 32 * t + v, h = j / 128, rr = j % 128;
      uint8_t& low = blk[64 * h + rr % 64];
      const int low_shift = 4 * (rr / 64);
      uint8_t& high = blk[128 + 32 * h + rr % 32];
      const int high_shift = 2 * (rr / 32);
      // Panel: codes byte 64 (v % 16 / 4) + 4c + v % 4, nibble v / 16; bits 4 and 5 in the masks
      // of vector j' = v % 16 / 4 (32 bytes from 256: low-nibble bit 4, bit 5, high-nibble ...).
      uint8_t* blk_t = sup + 384 * t;
      uint8_t& code = blk_t[64 * (v % 16 / 4) + 4 * c + v % 4];
      const int code_shift = 4 * (v / 16), pos = 4 * c + v % 4;
      uint8_t* mask = blk_t + 256 + 32 * (v % 16 / 4) + 16 * (v / 16);
      if (to_panel) {
        const int q = ((low >> low_shift) & 15) | (((high >> high_shift) & 3) << 4);
        code = uint8_t(code | ((q & 15) << code_shift));
        for (int bit = 0; bit < 2; ++bit)
          if ((q >> (4 + bit)) & 1) mask[8 * bit + pos / 8] |= uint8_t(1u << (pos % 8));
      } else {
        int q = (code >> code_shift) & 15;
        for (int bit = 0; bit < 2; ++bit) q |= ((mask[8 * bit + pos / 8] >> (pos % 8)) & 1) << (4 + bit);
        low = uint8_t(low | ((q & 15) << low_shift));
        high = uint8_t(high | ((q >> 4) << high_shift));
      }
    }
}

// The panel kind of a type id (Q4_1G's panels are Q4_1's), or a one-line error.
int64_t panel_kind(int64_t type) {
  if (five_bit(type) || type == Q4_K || type == Q5_K || type == Q6_K) return type;
  const Layout L = layout_of(type);
  return L.kind == Q4_1G ? Q4_1 : L.kind;
}

void check_panel_weight(const torch::Tensor& w, int64_t type, int64_t k) {
  if (!five_bit(type) && type != Q4_K && type != Q5_K && type != Q6_K) return check_weight(w, type, k);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(),
              "w must be a contiguous CPU uint8 tensor [N, bytes per row]");
  const int64_t values = type == Q4_K || type == Q5_K || type == Q6_K ? 256 : QK;
  TORCH_CHECK(k > 0 && k % values == 0, "K must be a positive multiple of ", values, ", got ", k);
  const int64_t want = type == Q4_K   ? k / 256 * 144
                       : type == Q5_K ? k / 256 * 176
                       : type == Q6_K ? k / 256 * 210
                                      : k / QK * five_bit_block_bytes(type);
  TORCH_CHECK(w.size(1) == want, "w rows hold ", w.size(1), " bytes; K = ", k, " needs ", want);
}

// W's GGUF blocks [N, bytes] -> panels [ceil(N / 16), K / 32 * panel block bytes] (layout above).
torch::Tensor gguf_pack_panels(const torch::Tensor& w, int64_t type, int64_t k) {
  check_panel_weight(w, type, k);
  const bool five = five_bit(type);
  const bool k_quant = type == Q4_K || type == Q5_K || type == Q6_K;
  const Layout L = five || k_quant ? Layout{type, 0, 0, 0, 0} : layout_of(type);
  const int64_t bb = five ? five_bit_block_bytes(type) : 0, head = type == Q5_1 ? 4 : 2;
  const int64_t N = w.size(0), nb = k / QK;
  const int64_t panels = (N + PANEL - 1) / PANEL, pbb = panel_block_bytes(type);
  const int64_t codes = panel_code_bytes(type);
  auto out = torch::zeros({panels, nb * pbb}, w.options());
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    float q[QK];
    if (k_quant) {
      const int64_t file_super = type == Q4_K ? 144 : type == Q5_K ? 176 : 210;
      for (int64_t pn = p0; pn < p1; ++pn)
        for (int64_t sb = 0; sb < nb / 8; ++sb)
          for (int c = 0; c < PANEL && pn * PANEL + c < N; ++c) {
            uint8_t* blk = const_cast<uint8_t*>(src) + (pn * PANEL + c) * w.size(1) + sb * file_super;
            uint8_t* sup = dst + pn * nb * pbb + sb * 8 * pbb;
            if (type == Q6_K)
              q6_k_row_panel(blk, sup, c, true);
            else
              k4_row_panel(blk, sup, c, true, type == Q5_K);
          }
      return;
    }
    for (int64_t pn = p0; pn < p1; ++pn)
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* pb = dst + (pn * nb + b) * pbb;
        uint8_t* heads = pb + codes;
        for (int c = 0; c < PANEL; ++c) {
          const int64_t n = pn * PANEL + c;
          if (n >= N) break;  // zero rows: codes 0, d = m = 0
          const uint8_t* row = src + n * w.size(1);
          if (five) {
            const uint8_t* blk = row + b * bb;
            std::memcpy(heads + 2 * c, blk, 2);  // d's fp16 bits
            if (type == Q5_1) std::memcpy(heads + 2 * PANEL + 2 * c, blk + 2, 2);
            uint32_t qh;
            std::memcpy(&qh, blk + head, 4);
            // Block byte 4j + i holds values 4j + i and 16 + 4j + i, as a Q4 panel byte.
            for (int j = 0; j < 4; ++j)
              for (int i = 0; i < 4; ++i) {
                pb[64 * j + 4 * c + i] = blk[head + 4 + 4 * j + i];
                for (int h = 0; h < 2; ++h)
                  if ((qh >> (16 * h + 4 * j + i)) & 1) pb[256 + 16 * j + 8 * h + (4 * c + i) / 8] |= uint8_t(1u << ((4 * c + i) % 8));
              }
            continue;
          }
          block_q(L, row, b, q);  // as stored: 0..15, or -128..127
          std::memcpy(heads + 2 * c, row + L.head_at(b), 2);  // d's fp16 bits
          if (L.kind != Q8_0 && L.kind != Q4_0) std::memcpy(heads + 2 * PANEL + 2 * c, row + L.head_at(b) + 2, 2);
          for (int i = 0; i < 4; ++i) {
            if (type == Q8_0) {
              for (int t = 0; t < 8; ++t) pb[64 * t + 4 * c + i] = uint8_t(int(q[4 * t + i]) + 128);
            } else {
              for (int j = 0; j < 4; ++j)
                pb[64 * j + 4 * c + i] = uint8_t(int(q[4 * j + i]) | (int(q[16 + 4 * j + i]) << 4));
            }
          }
        }
      }
  });
  return out;
}

// Rows `rows` of W back from its panels, as GGML blocks [len(rows), K / 32 * block bytes]: Q4_0,
// Q5_0, Q5_1, Q8_0, or Q4_1 for Q4_1 and Q4_1G panels (which hold a d and an m per block). d and m were fp16
// values, so the blocks are the ones packed (Q4_1G's as the Q4_1 blocks of its groups). What a
// layer that keeps only its panels reads for its rare other uses: rows of the embedding, codes.
torch::Tensor gguf_panel_blocks(const torch::Tensor& packed, int64_t type, int64_t k, const torch::Tensor& rows) {
  TORCH_CHECK(k > 0 && k % QK == 0, "K must be a positive multiple of ", QK, ", got ", k);
  const int64_t kind = panel_kind(type);
  TORCH_CHECK((kind != Q4_K && kind != Q5_K && kind != Q6_K) || k % 256 == 0, "K must be a multiple of 256 for the K-quants, got ", k);
  const int64_t nb = k / QK, pbb = panel_block_bytes(type), codes = panel_code_bytes(type);
  TORCH_CHECK(best_isa() >= ISA_AVX2, "gguf_panel_blocks needs F16C (AVX2 CPUs have it)");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(1) == nb * pbb,
              "packed must be gguf_pack_panels' output for K = ", k);
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1, "rows must be a 1-D int64 tensor");
  const auto ids = rows.contiguous();
  const int64_t R = ids.size(0), n_max = packed.size(0) * PANEL;
  // Bytes of an output row: blocks (32 values) or, for the K-quants, super-blocks (256).
  const int64_t super_bytes = kind == Q4_K ? 144 : kind == Q5_K ? 176 : kind == Q6_K ? 210 : 0;
  const int64_t bb = super_bytes ? 0 : five_bit(kind) ? five_bit_block_bytes(kind) : block_bytes(kind);
  const int64_t out_row = super_bytes ? nb / 8 * super_bytes : nb * bb;
  auto out = torch::empty({R, out_row}, packed.options());
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(id[i] >= 0 && id[i] < n_max, "row ", id[i], " is not in the panels");
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t pn = id[r] / PANEL, c = id[r] % PANEL;
      if (super_bytes) {
        for (int64_t sb = 0; sb < nb / 8; ++sb) {
          uint8_t* blk = dst + r * out_row + sb * super_bytes;
          std::memset(blk, 0, super_bytes);
          uint8_t* sup = const_cast<uint8_t*>(src) + pn * nb * pbb;
          if (kind == Q6_K)
            q6_k_row_panel(blk, sup + sb * 8 * pbb, int(c), false);
          else
            k4_row_panel(blk, sup + sb * 8 * pbb, int(c), false, kind == Q5_K);
        }
        continue;
      }
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* pb = src + (pn * nb + b) * pbb;
        const uint8_t* heads = pb + codes;
        uint8_t* blk = dst + r * out_row + b * bb;
        std::memcpy(blk, heads + 2 * c, 2);
        if (kind == Q8_0) {
          for (int t = 0; t < 8; ++t)
            for (int i = 0; i < 4; ++i) blk[2 + 4 * t + i] = uint8_t(int(pb[64 * t + 4 * c + i]) - 128);
          continue;
        }
        uint8_t* q = blk + 2;
        if (kind == Q4_1 || kind == Q5_1) {
          std::memcpy(blk + 2, heads + 2 * PANEL + 2 * c, 2);
          q = blk + 4;
        }
        if (five_bit(kind)) {  // the fifth bits back: value 16h + 4j + i from mask 2j + h, bit 4c + i
          uint32_t qh = 0;
          for (int j = 0; j < 4; ++j)
            for (int i = 0; i < 4; ++i)
              for (int h = 0; h < 2; ++h)
                qh |= uint32_t((pb[256 + 16 * j + 8 * h + (4 * c + i) / 8] >> ((4 * c + i) % 8)) & 1)
                      << (16 * h + 4 * j + i);
          std::memcpy(q, &qh, 4);
          q += 4;
        }
        // Panel byte 64j + 4c + i holds values 4j + i (low) and 16 + 4j + i (high): exactly
        // block byte 4j + i's two nibbles.
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) q[4 * j + i] = pb[64 * j + 4 * c + i];
      }
    }
  });
  return out;
}

// One weight of a panel product (`panel_product`): its panels, their kind, the problem that
// writes its columns of the shared output, and its work units' place among the call's.
struct PanelSegment {
  const uint8_t* w;
  int64_t kind;
  Q8Problem p;
  int64_t first, units;  // units [first, first + units) of the call: AVX-512 panel pairs, AVX2 halves
  const int32_t* sums = nullptr;  // the bias sums of its kind, where its kernel takes them
  int epilogue = PLAIN;           // GLU: a gate_up layer's silu(gate) * up; ADD: out += (AVX-512)
};

// f(std::integral_constant<int, kind>) for a panel kind (`panel_kind`), as `with_kind` for layouts.
template <class F>
inline void with_panel_kind(int64_t kind, F&& f) {
  switch (kind) {
    case Q4_0: f(std::integral_constant<int, Q4_0>()); break;
    case Q4_1: f(std::integral_constant<int, Q4_1>()); break;
    case Q5_0: f(std::integral_constant<int, Q5_0>()); break;
    case Q5_1: f(std::integral_constant<int, Q5_1>()); break;
    case Q4_K: f(std::integral_constant<int, Q4_K>()); break;
    case Q5_K: f(std::integral_constant<int, Q5_K>()); break;
    case Q6_K: f(std::integral_constant<int, Q6_K>()); break;
    default: f(std::integral_constant<int, Q8_0>()); break;
  }
}

// Units [u0, u1) of one segment (numbered within it) by its kind's kernel, with the bias sums of its
// kind (`s.sums`, made by `panel_product` once per kind: they depend only on x).
void panel_units(const PanelSegment& s, int64_t isa, int64_t u0, int64_t u1) {
  with_panel_kind(s.kind, [&](auto t) {
    constexpr int TYPE = decltype(t)::value;
    if (isa < ISA_AVX512)
      avx2::panels_q8<TYPE>(s.p, s.w, s.sums, u0, u1);
    else if (s.epilogue == GLU)
      avx512::panels_q8<TYPE, GLU>(s.p, s.w, s.sums, u0, u1);
    else if (s.epilogue == ADD)
      avx512::panels_q8<TYPE, ADD>(s.p, s.w, s.sums, u0, u1);
    else
      avx512::panels_q8<TYPE>(s.p, s.w, s.sums, u0, u1);
  });
}

// x [M, K] @ the rows of each packed weight in turn -> fp32 [M, sum(rows)]: x rounded to int8 once
// (as gguf_matmul_q8 does), then one parallel region over every weight's work units, each unit
// writing its weight's columns of the one output. Every output is the same arithmetic whatever
// the other weights, so one weight alone is gguf_matmul_panels. `name` and `segment_names` word the
// errors (the segments' index where there are several). `epilogue` GLU: one weight, a gate_up
// layer's two halves, and the output is silu(gate) * up [M, rows / 2] (gguf_matmul_panels_swiglu);
// ADD: one weight, its products added into `into` [M, rows] (gguf_matmul_panels_add_).
torch::Tensor panel_product(const torch::Tensor& x, const std::vector<torch::Tensor>& packed,
                            const std::vector<int64_t>& types, const std::vector<int64_t>& rows, int64_t isa,
                            const char* name, bool segment_names, int epilogue = PLAIN,
                            const torch::Tensor* into = nullptr) {
  const bool swiglu = epilogue == GLU;
  if (isa < 0) isa = best_isa();
  TORCH_CHECK(isa >= ISA_AVX2 && isa <= best_isa(), name, " needs AVX2 (or AVX-512 VNNI) on this CPU");
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "x must be a CPU float32 tensor [M, K] with contiguous rows");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  TORCH_CHECK(K > 0 && K % QK == 0, "K must be a positive multiple of ", QK, ", got ", K);
  TORCH_CHECK(!packed.empty() && types.size() == packed.size() && rows.size() == packed.size(), name,
              " takes one type and one row count per packed weight (at least one), got ", packed.size(),
              " packed, ", types.size(), " types, ", rows.size(), " row counts");
  std::vector<PanelSegment> segments;
  int64_t N = 0, units = 0;
  for (size_t i = 0; i < packed.size(); ++i) {
    const std::string at = segment_names ? "segment " + std::to_string(i) + ": " : "";
    const int64_t type = types[i], n = rows[i];
    TORCH_CHECK(n >= 0, at, "row count ", n, " is negative");
    int64_t kind = -1;
    try {
      kind = panel_kind(type);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, at, e.what_without_backtrace());
    }
    const int64_t panels = (n + PANEL - 1) / PANEL;
    TORCH_CHECK((kind != Q4_K && kind != Q5_K && kind != Q6_K) || K % 256 == 0, at,
                "K must be a multiple of 256 for the K-quants, got ", K);
    const torch::Tensor& w = packed[i];
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kUInt8 && w.is_contiguous() && w.dim() == 2 &&
                    w.size(0) == panels && w.size(1) == nb * panel_block_bytes(type),
                at, "packed must be gguf_pack_panels' output for N = ", n, ", K = ", K);
    if (epilogue != PLAIN) TORCH_CHECK(isa >= ISA_AVX512, name, " needs AVX-512 VNNI on this CPU");
    if (swiglu) {
      TORCH_CHECK(packed.size() == 1 && n % (2 * PANEL) == 0, name, " takes one gate_up weight of two halves of a ",
                  "multiple of ", PANEL, " rows each, got ", packed.size(), " weight(s) of ", n, " rows");
    }
    const int64_t width = swiglu ? n / 2 : n;  // output columns
    const int64_t mine = swiglu ? width / PANEL : isa >= ISA_AVX512 ? (panels + 1) / 2 : 2 * panels;
    // (The panel kernels read no Layout: the panels hold a d, and an m where the kind has one.)
    segments.push_back({w.data_ptr<uint8_t>(), kind,
                        Q8Problem{nullptr, nullptr, nullptr, nullptr, 0, Layout{kind, 0, 0, 0, 0}, nullptr, M, width, K, 0},
                        units, mine, nullptr, epilogue});
    N += width;
    units += mine;
  }
  torch::Tensor out;
  if (epilogue == ADD) {
    TORCH_CHECK(into != nullptr && packed.size() == 1, name, " takes one weight and the output to add into");
    TORCH_CHECK(into->device().is_cpu() && into->scalar_type() == torch::kFloat32 && into->is_contiguous() &&
                    into->dim() == 2 && into->size(0) == M && into->size(1) == N,
                "out must be a contiguous CPU float32 tensor [", M, ", ", N, "]");
    out = *into;
  } else {
    out = torch::empty({M, N}, x.options());
  }
  if (M == 0 || N == 0) return out;
  const auto qx = quantize_q8(x, ISA_AVX2);
  const int8_t* q = qx[0].data_ptr<int8_t>();
  int64_t col = 0;
  for (auto& s : segments) {
    s.p.qx = q, s.p.dx = qx[1].data_ptr<float>(), s.p.sx = qx[2].data_ptr<float>();
    s.p.out = out.data_ptr<float>() + col, s.p.ldo = N;
    col += s.p.N;
  }
  // Per row and 32 values of x (16 for Q6_K's groups), sum(q_x) times the bias of a kind's codes:
  // what the bias adds to q_w . q_x. AVX2's Q6_K takes it off its sums; AVX-512 starts its sums
  // from its negation (`start_sums`), for Q8_0 (codes + 128), Q4_0 and Q5_0 (q - 8, q - 16) too.
  auto bias_sums = [&](int64_t group, int32_t times) {
    std::vector<int32_t> sums(M * (K / group));
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t i = r0 * (K / group); i < r1 * (K / group); ++i) {
        int32_t sum = 0;
        for (int64_t j = 0; j < group; ++j) sum += q[i * group + j];
        sums[i] = times * sum;
      }
    });
    return sums;
  };
  const bool v512 = isa >= ISA_AVX512;
  const int64_t kinds[4] = {Q6_K, Q8_0, Q5_0, Q4_0};
  const int32_t bias[4] = {32, 128, 16, 8};
  std::vector<int32_t> sums[4];  // per kind above, made once for every segment of the kind
  for (auto& s : segments) {
    const int i = int(std::find(kinds, kinds + 4, s.kind) - kinds);
    if (i == 4 || (!v512 && s.kind != Q6_K)) continue;
    if (sums[i].empty()) sums[i] = bias_sums(s.kind == Q6_K ? 16 : QK, v512 ? -bias[i] : bias[i]);
    s.sums = sums[i].data();
  }
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    for (const auto& s : segments) {
      const int64_t lo = std::max(u0, s.first), hi = std::min(u1, s.first + s.units);
      if (lo < hi) panel_units(s, isa, lo - s.first, hi - s.first);
    }
  });
  return out;
}

// x [M, K] @ W^T from panels (gguf_pack_panels of W [N, K]): x rounded to int8 per 32-block as
// gguf_matmul_q8 does. AVX-512 VNNI or AVX2 (the caller keeps the blocks for other CPUs).
torch::Tensor gguf_matmul_panels(const torch::Tensor& x, const torch::Tensor& packed, int64_t type, int64_t n,
                                 int64_t isa) {
  return panel_product(x, {packed}, {type}, {n}, isa, "gguf_matmul_panels", false);
}

// A fused layer's segments of different types, each its own panels: x @ [W_0; W_1; ...]^T in one
// call, bit for bit the columns of gguf_matmul_panels per segment joined.
torch::Tensor gguf_matmul_panel_segments(const torch::Tensor& x, const std::vector<torch::Tensor>& packed,
                                         const std::vector<int64_t>& types, const std::vector<int64_t>& rows,
                                         int64_t isa) {
  return panel_product(x, packed, types, rows, isa, "gguf_matmul_panel_segments", true);
}

// A SwiGLU MLP's gate_up layer from its panels (gate_proj's n / 2 rows, then up_proj's; n / 2 a
// multiple of 16): silu(x @ G^T) * (x @ U^T) -> fp32 [M, n / 2], the gate and up outputs of a row
// combined as the tiles store them, never written whole. The bits of gguf_matmul_panels put
// through layer_ops' silu_mul_. AVX-512 VNNI only.
torch::Tensor gguf_matmul_panels_swiglu(const torch::Tensor& x, const torch::Tensor& packed, int64_t type, int64_t n,
                                        int64_t isa) {
  return panel_product(x, {packed}, {type}, {n}, isa, "gguf_matmul_panels_swiglu", false, GLU);
}

// out += x @ W^T from W's panels, in place (a residual stream: the down projection's output added
// as the tiles store it, no product tensor written and read back): gguf_matmul_panels then
// torch's add_, bit for bit. AVX-512 VNNI only.
torch::Tensor gguf_matmul_panels_add_(const torch::Tensor& x, const torch::Tensor& packed, int64_t type, int64_t n,
                                      torch::Tensor out, int64_t isa) {
  return panel_product(x, {packed}, {type}, {n}, isa, "gguf_matmul_panels_add_", false, ADD, &out);
}

torch::Tensor gguf_dequantize(const torch::Tensor& w, int64_t type, int64_t k, std::optional<torch::Tensor> into) {
  check_weight(w, type, k);
  const Layout L = layout_of(type);
  const int64_t N = w.size(0), nb = k / QK;
  torch::Tensor out;
  if (into) {  // a reused buffer: a fresh allocation per call costs page faults on every call
    out = *into;
    TORCH_CHECK((out.scalar_type() == torch::kFloat32 || out.scalar_type() == torch::kBFloat16) &&
                    out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == k,
                "into must be a contiguous float32 or bfloat16 tensor [", N, ", ", k, "]");
  } else {
    out = torch::empty({N, k}, torch::kFloat32);
  }
  const uint8_t* src = w.data_ptr<uint8_t>();
  const bool bf16 = out.scalar_type() == torch::kBFloat16;
  float* dst = bf16 ? nullptr : out.data_ptr<float>();
  uint16_t* dst16 = bf16 ? reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()) : nullptr;
  if (best_isa() >= ISA_AVX2) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      with_kind(L, [&](auto t) {
        if (bf16)
          avx2::dequantize_rows<decltype(t)::value>(src, w.size(1), L, k, dst16, n0, n1);
        else
          avx2::dequantize_rows<decltype(t)::value>(src, w.size(1), L, k, dst, n0, n1);
      });
    });
    return out;
  }
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    float q[QK];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* row = src + n * w.size(1);
        float d, m;
        block_dm(L, row, b, d, m);
        block_q(L, row, b, q);
        for (int j = 0; j < QK; ++j) {
          const float value = std::fma(d, q[j], m);  // the vector path's single rounding
          if (bf16)
            dst16[n * k + b * QK + j] = float_to_bf16(value);
          else
            dst[n * k + b * QK + j] = value;
        }
      }
  });
  return out;
}

}  // namespace gguf_matmul

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmstack-gguf CPU kernels";
  m.def("gguf_matmul", &gguf_matmul::gguf_matmul, "x fp32 [M, K] @ W^T, W [N, K] in GGUF blocks (uint8 rows)",
        py::arg("x"), py::arg("w"), py::arg("type"), py::arg("isa") = -1);
  m.def("gguf_matmul_q8", &gguf_matmul::gguf_matmul_q8,
        "x fp32 [M, K] @ W^T with x rounded to int8 per 32-block first (integer dot products)", py::arg("x"),
        py::arg("w"), py::arg("type"), py::arg("isa") = -1);
  m.def("quantize_q8", &gguf_matmul::quantize_q8, "x fp32 [M, K] -> (int8 q, scale dx, dx * sum(q)) per 32-block",
        py::arg("x"), py::arg("isa") = -1);
  m.def("gguf_pack_panels", &gguf_matmul::gguf_pack_panels, "GGUF block rows [N, bytes] (Q4_0, Q4_1, Q4_1G, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) -> 16-row panels (AVX-512 VNNI or AVX2)",
        py::arg("w"), py::arg("type"), py::arg("k"));
  m.def("gguf_matmul_panels", &gguf_matmul::gguf_matmul_panels,
        "x fp32 [M, K] @ W^T from gguf_pack_panels(W), x rounded to int8 per 32-block", py::arg("x"), py::arg("packed"),
        py::arg("type"), py::arg("n"), py::arg("isa") = -1);
  m.def("gguf_matmul_panels_swiglu", &gguf_matmul::gguf_matmul_panels_swiglu,
        "silu(x @ G^T) * (x @ U^T) from gguf_pack_panels([G; U]) (n rows, G and U n / 2 each, a multiple of 16), "
        "x rounded to int8 per 32-block; AVX-512 VNNI",
        py::arg("x"), py::arg("packed"), py::arg("type"), py::arg("n"), py::arg("isa") = -1);
  m.def("gguf_matmul_panels_add_", &gguf_matmul::gguf_matmul_panels_add_,
        "out += x @ W^T in place from gguf_pack_panels(W), x rounded to int8 per 32-block; returns out; AVX-512 VNNI",
        py::arg("x"), py::arg("packed"), py::arg("type"), py::arg("n"), py::arg("out"), py::arg("isa") = -1);
  m.def("gguf_matmul_panel_segments", &gguf_matmul::gguf_matmul_panel_segments,
        "x fp32 [M, K] @ [W_0; W_1; ...]^T from each W_i's panels (types[i], rows[i] rows), x rounded to int8 once: "
        "gguf_matmul_panels per segment, joined, in one call",
        py::arg("x"), py::arg("packed"), py::arg("types"), py::arg("rows"), py::arg("isa") = -1);
  m.def("gguf_panel_blocks", &gguf_matmul::gguf_panel_blocks,
        "rows of W back from gguf_pack_panels(W) as GGML blocks (Q4_1 for Q4_1G)", py::arg("packed"), py::arg("type"),
        py::arg("k"), py::arg("rows"));
  m.def("gguf_dequantize", &gguf_matmul::gguf_dequantize, "GGUF block rows -> float32 [N, K]", py::arg("w"),
        py::arg("type"), py::arg("k"), py::arg("into") = py::none());
  m.def("block_bytes", &gguf_matmul::block_bytes, "bytes per 32-value block of a GGML type");
  m.def("row_bytes", &gguf_matmul::row_bytes, "bytes per weight row of K values in a type's layout (Q4_1G included)",
        py::arg("type"), py::arg("k"));
  m.def("best_isa", &gguf_matmul::best_isa, "2: AVX-512 (F, BW, DQ, VL, VNNI), 1: AVX2+FMA+F16C, 0: scalar");
  // The K-quants and Q5_0 / Q5_1 kept packed (kquants.cpp).
  m.def("kq_types", &kquants::kq_types, "GGML type ids kq_* packs: Q5_0, Q5_1, Q2_K-Q6_K");
  m.def("kq_row_bytes", &kquants::kq_row_bytes, "bytes per weight row of K values", py::arg("type"), py::arg("k"));
  m.def("kq_dequantize", &kquants::kq_dequantize, "packed rows [N, bytes] -> float32 [N, K] (or into fp32 / bf16)",
        py::arg("w"), py::arg("type"), py::arg("k"), py::arg("into") = py::none(), py::arg("isa") = -1);
  m.def("kq_panel_dequantize", &kquants::kq_panel_dequantize,
        "rows [r0, r1) of a Q4_K / Q5_K / Q6_K layer kept as panels -> into (fp32 / bf16), kq_dequantize's values", py::arg("packed"),
        py::arg("type"), py::arg("k"), py::arg("r0"), py::arg("r1"), py::arg("into"));
  m.def("kq_matmul_q8", &kquants::kq_matmul_q8,
        "x fp32 [M, K] @ W^T, W packed, x rounded to int8 per 32-block (integer dot products)", py::arg("x"),
        py::arg("w"), py::arg("type"), py::arg("isa") = -1);
}
