// The attention kernel body, written once over a small vector vocabulary and compiled three
// times by cpu_paged.cpp: inside `#pragma GCC target("avx512f")`, `target("avx2,fma")` and with
// no target (the scalar fallback). The including file defines exactly one of
// CPU_PAGED_AVX512 / CPU_PAGED_AVX2 (or neither) and wraps the include in its own namespace,
// so the three copies never meet. No torch header is used here: the pragma would otherwise
// recompile torch's inline code for a target the CPU may lack.
//
// What one call computes, for one (sequence, KV head, query rows, key range) work item:
// the rows are the query heads of that KV head (decode: G rows, one token; prefill: a tile of
// tokens x G heads), the keys are read through the block table straight from the paged cache
// (no gather of the context into a contiguous copy), and the softmax is online: running max
// `m`, running sum `l` and an unnormalised accumulator per row, all fp32.

// A hint to bring the cache line at p into L1 (LEVEL 1: prefetcht0) or L2 (2: prefetcht1),
// written as an asm statement: GCC 12 at -O3 left no prefetch instruction at all in this file's
// objects for __builtin_prefetch or _mm_prefetch (seen with objdump; the gguf kernels' survive),
// where an asm volatile must stay.
template <int LEVEL>
static inline void cache_hint(const char* p) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (LEVEL == 1)
    asm volatile("prefetcht0 %0" : : "m"(*p));
  else
    asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, LEVEL == 1 ? 3 : 2);
#endif
}

// ---------------------------------------------------------------------------------------------
// Vector vocabulary: W floats per register.
// ---------------------------------------------------------------------------------------------

#if defined(CPU_PAGED_AVX512)
constexpr int W = 16;
using vf = __m512;
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf x) { _mm512_storeu_ps(p, x); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vsum(vf x) { return _mm512_reduce_add_ps(x); }
static inline float vhmax(vf x) { return _mm512_reduce_max_ps(x); }
// bf16 -> fp32 is a 16-bit left shift of the bit pattern.
static inline vf vload_bf16(const uint16_t* p) {
  __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// fp8 -> fp32 by way of fp16 (why that is exact: the comment after these definitions); a table
// gather per register took twice as long as bf16 rows do (Zen 4), though the rows are half the bytes.
template <int Kind>
static inline vf vload_fp8(const uint8_t* p) {
  __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  if constexpr (Kind == KV_E5M2) return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
  const __m256i low7 = _mm256_and_si256(b, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                              _mm256_slli_epi16(low7, 7));
  h = _mm256_or_si256(h, _mm256_and_si256(_mm256_cmpeq_epi16(low7, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7c00)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.0f));
}
#elif defined(CPU_PAGED_AVX2)
constexpr int W = 8;
using vf = __m256;
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf x) { _mm256_storeu_ps(p, x); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vsum(vf x) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vhmax(vf x) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline vf vload_bf16(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
template <int Kind>
static inline vf vload_fp8(const uint8_t* p) {
  __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  if constexpr (Kind == KV_E5M2) return _mm256_cvtph_ps(_mm_slli_epi16(b, 8));
  const __m128i low7 = _mm_and_si128(b, _mm_set1_epi16(0x7f));
  __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(low7, 7));
  h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(low7, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7c00)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
#endif
// An fp8 code is the high part of an fp16 one. e5m2 is fp16's high byte. e4m3's seven exponent
// and mantissa bits, shifted into fp16's place, read as the code's value times 2^-8 (subnormals
// too: fp16 widens its own exactly), so the widened value is scaled by 256, exactly; e4m3's NaN
// codes (0x7f, 0xff) get fp16's all-ones exponent first, so they stay NaN.

static inline float bf16_to_float(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

static inline uint16_t float_to_bf16(float f) {  // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return uint16_t((bits >> 16) | 0x40);  // NaN stays NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

// ---------------------------------------------------------------------------------------------
// exp over a row of scores. Scalar expf costs as much as a 64-wide dot product, and decode
// takes one per (row, key), so the vector paths use their own: 2^n x e^r with n = round(x /
// ln 2), |r| <= ln2 / 2 and a degree-6 Taylor polynomial (relative error ~1e-7, an fp32 ulp).
// Anything below -87 (masked keys are -inf) is exactly 0.
// ---------------------------------------------------------------------------------------------

#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
static inline vf vexp(vf x) {
  const vf lo = vset1(-87.0f);
  const vf hi = vset1(88.0f);
#if defined(CPU_PAGED_AVX512)
  __mmask16 live = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), hi);
  vf n = _mm512_roundscale_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
#else
  vf live = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
  vf n = _mm256_round_ps(vmul(x, vset1(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  // r = x - n ln2, ln2 split in two so that n ln2 is exact enough.
  vf r = vfma(n, vset1(-0.693145751953125f), x);
  r = vfma(n, vset1(-1.428606765330187e-06f), r);
  vf p = vset1(1.0f / 720);
  p = vfma(p, r, vset1(1.0f / 120));
  p = vfma(p, r, vset1(1.0f / 24));
  p = vfma(p, r, vset1(1.0f / 6));
  p = vfma(p, r, vset1(0.5f));
  p = vfma(p, r, vset1(1.0f));
  p = vfma(p, r, vset1(1.0f));
#if defined(CPU_PAGED_AVX512)
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(live, p, _mm512_castsi512_ps(e));
#else
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(live, vmul(p, _mm256_castsi256_ps(e)));
#endif
}
#endif

// p[j] = exp(s[j] - m) for j < n; returns the sum.
static inline float exp_row(float* s, int n, float m) {
  int j = 0;
  float total = 0.0f;
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
  vf acc = vzero();
  const vf mv = vset1(m);
  for (; j + W <= n; j += W) {
    vf p = vexp(vadd(vload(s + j), vmul(mv, vset1(-1.0f))));
    vstore(s + j, p);
    acc = vadd(acc, p);
  }
  // The last keys as one more vector whose missing lanes are masked keys (exp gives 0): the sum
  // then comes out the same whether a row's tile ends here or runs on over keys it may not see
  // (a decode row, and the same position inside a prefill tile: batch invariance).
  if (j < n) {
#if defined(CPU_PAGED_AVX512)
    const __mmask16 live = __mmask16((1u << (n - j)) - 1);
    const vf x = _mm512_mask_loadu_ps(vset1(-INFINITY), live, s + j);
    const vf p = vexp(vadd(x, vmul(mv, vset1(-1.0f))));
    _mm512_mask_storeu_ps(s + j, live, p);
#else
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - j), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    const vf x = _mm256_blendv_ps(vset1(-INFINITY), _mm256_maskload_ps(s + j, live), _mm256_castsi256_ps(live));
    const vf p = vexp(vadd(x, vmul(mv, vset1(-1.0f))));
    _mm256_maskstore_ps(s + j, live, p);
#endif
    acc = vadd(acc, p);
    j = n;
  }
  total = vsum(acc);
#endif
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    total += s[j];
  }
  return total;
}

// ---------------------------------------------------------------------------------------------
// Row primitives (D floats).
// ---------------------------------------------------------------------------------------------

static inline float row_max(const float* s, int n) {
  float m = -INFINITY;
  int j = 0;
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
  if (n >= W) {
    vf acc = vload(s);
    for (j = W; j + W <= n; j += W) acc = vmax(acc, vload(s + j));
    m = vhmax(acc);
  }
#endif
  for (; j < n; ++j) m = std::max(m, s[j]);
  return m;
}

static inline void row_scale(float* x, float a, int d) {
  int i = 0;
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
  const vf av = vset1(a);
  for (; i + W <= d; i += W) vstore(x + i, vmul(vload(x + i), av));
#endif
  for (; i < d; ++i) x[i] *= a;
}

// Four dot products against one key, the key loaded once per chunk: decode's G query heads and
// prefill's rows share each key row, which is what makes GQA cheap here.
static inline void dot4(const float* q0, const float* q1, const float* q2, const float* q3,
                        const float* k, int d, float* out) {
  int i = 0;
  float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
  // Each row summed exactly as dot1 sums it (two chains, then one), so a row's score does not
  // depend on whether it came in a group of four.
  vf a0 = vzero(), a1 = vzero(), a2 = vzero(), a3 = vzero();
  vf b0 = vzero(), b1 = vzero(), b2 = vzero(), b3 = vzero();
  for (; i + 2 * W <= d; i += 2 * W) {
    const vf kv = vload(k + i), kw = vload(k + i + W);
    a0 = vfma(vload(q0 + i), kv, a0), b0 = vfma(vload(q0 + i + W), kw, b0);
    a1 = vfma(vload(q1 + i), kv, a1), b1 = vfma(vload(q1 + i + W), kw, b1);
    a2 = vfma(vload(q2 + i), kv, a2), b2 = vfma(vload(q2 + i + W), kw, b2);
    a3 = vfma(vload(q3 + i), kv, a3), b3 = vfma(vload(q3 + i + W), kw, b3);
  }
  for (; i + W <= d; i += W) {
    const vf kv = vload(k + i);
    a0 = vfma(vload(q0 + i), kv, a0);
    a1 = vfma(vload(q1 + i), kv, a1);
    a2 = vfma(vload(q2 + i), kv, a2);
    a3 = vfma(vload(q3 + i), kv, a3);
  }
  s0 = vsum(vadd(a0, b0)), s1 = vsum(vadd(a1, b1)), s2 = vsum(vadd(a2, b2)), s3 = vsum(vadd(a3, b3));
#endif
  for (; i < d; ++i) {
    s0 += q0[i] * k[i];
    s1 += q1[i] * k[i];
    s2 += q2[i] * k[i];
    s3 += q3[i] * k[i];
  }
  out[0] = s0, out[1] = s1, out[2] = s2, out[3] = s3;
}

static inline float dot1(const float* q, const float* k, int d) {
  int i = 0;
  float s = 0;
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
  vf a0 = vzero(), a1 = vzero();  // two chains: the FMA latency is longer than its issue rate
  for (; i + 2 * W <= d; i += 2 * W) {
    a0 = vfma(vload(q + i), vload(k + i), a0);
    a1 = vfma(vload(q + i + W), vload(k + i + W), a1);
  }
  for (; i + W <= d; i += W) a0 = vfma(vload(q + i), vload(k + i), a0);
  s = vsum(vadd(a0, a1));
#endif
  for (; i < d; ++i) s += q[i] * k[i];
  return s;
}

// acc[0:d] += sum_j p[j] * v[j][0:d] over n keys: the accumulator stays in registers across
// the keys (4 registers of it at a time), each V element is loaded once per row.
static inline void pv_row(float* acc, const float* p, const float* const* v, int n, int d) {
  int i = 0;
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
  for (; i + 4 * W <= d; i += 4 * W) {
    vf a0 = vload(acc + i), a1 = vload(acc + i + W), a2 = vload(acc + i + 2 * W), a3 = vload(acc + i + 3 * W);
    for (int j = 0; j < n; ++j) {
      const vf pj = vset1(p[j]);
      const float* vj = v[j] + i;
      a0 = vfma(pj, vload(vj), a0);
      a1 = vfma(pj, vload(vj + W), a1);
      a2 = vfma(pj, vload(vj + 2 * W), a2);
      a3 = vfma(pj, vload(vj + 3 * W), a3);
    }
    vstore(acc + i, a0), vstore(acc + i + W, a1), vstore(acc + i + 2 * W, a2), vstore(acc + i + 3 * W, a3);
  }
  for (; i + W <= d; i += W) {
    vf a0 = vload(acc + i);
    for (int j = 0; j < n; ++j) a0 = vfma(vset1(p[j]), vload(v[j] + i), a0);
    vstore(acc + i, a0);
  }
#endif
  for (; i < d; ++i) {
    float a = acc[i];
    for (int j = 0; j < n; ++j) a += p[j] * v[j][i];
    acc[i] = a;
  }
}

// One cache row (D values of kind Kind) into fp32. fp32 caches are never converted: the caller
// points at the cache itself.
template <int Kind>
static inline void load_row(const void* src, float* dst, int d, const float* lut) {
  int i = 0;
  if constexpr (Kind == KV_BF16) {
    const uint16_t* s = static_cast<const uint16_t*>(src);
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
    for (; i + W <= d; i += W) vstore(dst + i, vload_bf16(s + i));
#endif
    for (; i < d; ++i) dst[i] = bf16_to_float(s[i]);
  } else if constexpr (is_fp8(Kind)) {
    const uint8_t* s = static_cast<const uint8_t*>(src);
#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
    for (; i + W <= d; i += W) vstore(dst + i, vload_fp8<Kind>(s + i));
#endif
    for (; i < d; ++i) dst[i] = lut[s[i]];
  } else {
    std::memcpy(dst, src, sizeof(float) * d);
  }
}

// ---------------------------------------------------------------------------------------------
// Online softmax over one tile, shared by both paths.
// ---------------------------------------------------------------------------------------------

// The positions of an item's rows span [lo, hi].
struct PosRange {
  int lo, hi;
  PosRange(const int* pos, int rows) : lo(pos[0]), hi(pos[0]) {
    for (int r = 1; r < rows; ++r) lo = std::min(lo, pos[r]), hi = std::max(hi, pos[r]);
  }
  // Whether some (row, key) pair of keys [t0, t0 + n) is out of bounds: the causal edge of a
  // prefill tile or the sliding window's start (else no row needs masking).
  bool masks(int t0, int n, int window) const { return t0 + n - 1 > lo || (window > 0 && t0 <= hi - window); }
};

// One row's scores sr[0:n] of keys [t0, t0 + n), soft-capped when softcap > 0 (Gemma 2: the
// scaled score s becomes softcap * tanh(s / softcap)), masked for a query at position p when `masked`,
// folded into the row's running max m, sum l and accumulator acc[0:d] (rescaled when the max
// moves); sr becomes the tile's unnormalised probabilities. False, when no key of the tile is
// visible to the row (m, l and acc unchanged).
static inline bool softmax_tile_row(float* sr, int n, bool masked, int t0, int p, int window, float softcap,
                                    float& m, float& l, float* acc, int d) {
  if (softcap > 0) {  // std::tanh per score: only soft-capping models pay for it
    const float inv = 1.0f / softcap;
    for (int j = 0; j < n; ++j) sr[j] = softcap * std::tanh(sr[j] * inv);
  }
  if (masked)
    for (int j = 0; j < n; ++j) {
      const int t = t0 + j;
      if (t > p || (window > 0 && t <= p - window)) sr[j] = -INFINITY;
    }
  const float tile_max = row_max(sr, n);
  if (tile_max == -INFINITY) return false;
  const float m_new = std::max(m, tile_max);
  if (m_new > m) {  // the running max moved: rescale what was accumulated under it
    const float alpha = std::exp(m - m_new);  // exp(-inf) = 0 on the first tile
    l *= alpha;
    row_scale(acc, alpha, d);
    m = m_new;
  }
  l += exp_row(sr, n, m_new);
  return true;
}

// ---------------------------------------------------------------------------------------------
// The work item.
// ---------------------------------------------------------------------------------------------

// Attend `rows` query rows (fp32, already multiplied by the softmax scale x k_scale, row r at
// q + r * d, at position pos[r]) to keys [k_begin, k_end) of one KV head (`group`: see
// attend_fast), updating the online
// softmax state m / l / acc (acc row r at acc + r * d). Key t of the sequence lives at
// cache[table[t / bs]][t % bs][head]; `stride_tok` is the distance between two tokens of a block
// (Hkv x D elements) and `stride_blk` between two blocks.
template <int Kind>
static void attend(const float* q, const int* pos, int rows, int group, int d, int k_begin, int k_end,
                   int window, float softcap, const int* table, int bs, const char* kc, const char* vc,
                   int64_t stride_tok, int64_t stride_blk, int64_t head_off, int esize,
                   const float* lut, float* m, float* l, float* acc, Scratch& sc) {
  (void)group;  // the general path's items are one KV head's
  const PosRange span(pos, rows);
  const float* kp[KEY_TILE];
  const float* vp[KEY_TILE];
  // Byte offsets of the keys of this tile and of the next, walked block by block (no division
  // per key). The next tile's rows are prefetched into L2 while this one is computed, its K rows
  // before the scores and its V rows before the V pass (as attend_fast does; why: there): its
  // blocks are scattered over the cache, so the hardware prefetcher, which follows one stride,
  // would stall at every block boundary.
  int64_t off[2][KEY_TILE];
  int cur_blk = k_begin / bs, cur_in = k_begin % bs;
  auto offsets = [&](int64_t* dst, int n) {
    for (int j = 0; j < n; ++j) {
      dst[j] = (int64_t(table[cur_blk]) * stride_blk + int64_t(cur_in) * stride_tok + head_off) * esize;
      if (++cur_in == bs) cur_in = 0, ++cur_blk;
    }
  };
  const int row_bytes = d * esize;
  auto prefetch = [&](const char* cache, const int64_t* o, int n) {
    for (int j = 0; j < n; ++j)
      for (int b = 0; b < row_bytes; b += 64) cache_hint<2>(cache + o[j] + b);
  };
  offsets(off[0], std::min(KEY_TILE, k_end - k_begin));
  prefetch(kc, off[0], std::min(KEY_TILE, k_end - k_begin));
  prefetch(vc, off[0], std::min(KEY_TILE, k_end - k_begin));
  for (int t0 = k_begin, which = 0; t0 < k_end; t0 += KEY_TILE, which ^= 1) {
    const int n = std::min(KEY_TILE, k_end - t0);
    const int n_next = std::min(KEY_TILE, k_end - t0 - n);
    if (n_next > 0) {
      offsets(off[which ^ 1], n_next);
      prefetch(kc, off[which ^ 1], n_next);
    }
    // Key and value rows of this tile, in place (fp32) or converted into the scratch tile.
    for (int j = 0; j < n; ++j) {
      const int64_t o = off[which][j];
      if constexpr (Kind == KV_F32) {
        kp[j] = reinterpret_cast<const float*>(kc + o);
        vp[j] = reinterpret_cast<const float*>(vc + o);
      } else {
        float* kd = sc.kbuf.data() + size_t(j) * d;
        float* vd = sc.vbuf.data() + size_t(j) * d;
        load_row<Kind>(kc + o, kd, d, lut);
        load_row<Kind>(vc + o, vd, d, lut);
        kp[j] = kd;
        vp[j] = vd;
      }
    }
    // Scores. Rows come in fours against each key (the key row loaded once for all four).
    float* s = sc.scores.data();
    int r = 0;
    float tmp[4];
    for (; r + 4 <= rows; r += 4) {
      const float* q0 = q + size_t(r) * d;
      for (int j = 0; j < n; ++j) {
        dot4(q0, q0 + d, q0 + 2 * d, q0 + 3 * d, kp[j], d, tmp);
        for (int u = 0; u < 4; ++u) s[size_t(r + u) * KEY_TILE + j] = tmp[u];
      }
    }
    for (; r < rows; ++r)
      for (int j = 0; j < n; ++j) s[size_t(r) * KEY_TILE + j] = dot1(q + size_t(r) * d, kp[j], d);
    if (n_next > 0) prefetch(vc, off[which ^ 1], n_next);
    const bool masked = span.masks(t0, n, window);
    for (r = 0; r < rows; ++r) {
      float* sr = s + size_t(r) * KEY_TILE;
      if (!softmax_tile_row(sr, n, masked, t0, pos[r], window, softcap, m[r], l[r], acc + size_t(r) * d, d)) continue;
      pv_row(acc + size_t(r) * d, sr, vp, n, d);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// The same work item where the head dim is NV whole registers (NV = 1, 2, 4, 8, 16). The general path
// above spends most of its time in one horizontal sum per (row, key); here W keys' partial
// products are summed together by a shuffle tree (15 adds for 16 keys), each query row stays in
// registers while it is scored, each V row is widened once for up to four rows whose
// accumulators stay in registers, and bf16 / fp8 rows are widened as they are loaded rather
// than through the scratch tile. A tile masks only where some row may not see one of its keys
// (the causal edge of a prefill tile, a window's start), as above.
// ---------------------------------------------------------------------------------------------

#if defined(CPU_PAGED_AVX512) || defined(CPU_PAGED_AVX2)
#if defined(CPU_PAGED_AVX512)
constexpr int NREG = 32;
#else
constexpr int NREG = 16;
#endif

// Register c of a cache row, widened to fp32.
template <int Kind>
static inline vf load_vec(const char* row, int c, const float* lut) {
  if constexpr (Kind == KV_F32) {
    return vload(reinterpret_cast<const float*>(row) + c * W);
  } else if constexpr (Kind == KV_BF16) {
    return vload_bf16(reinterpret_cast<const uint16_t*>(row) + c * W);
  } else {
    return vload_fp8<Kind>(reinterpret_cast<const uint8_t*>(row) + c * W);
  }
}

// W vectors in, one out: lane j of the result is the sum of the lanes of p[key_slot(j)]. Each
// level adds pairs of half-vectors of two inputs, so the tree's lanes come out in the order
// key_slot undoes.
static inline int key_slot(int j) {
  static constexpr int within[4] = {0, 2, 1, 3};
#if defined(CPU_PAGED_AVX512)
  static constexpr int across[4] = {0, 8, 4, 12};
#else
  static constexpr int across[2] = {0, 4};
#endif
  return within[j % 4] + across[j / 4];
}

static inline vf lane_sums(const vf* p) {
#if defined(CPU_PAGED_AVX512)
  vf s[8], t[4], u[2];
  for (int i = 0; i < 8; ++i)
    s[i] = vadd(_mm512_shuffle_f32x4(p[i], p[i + 8], 0x44), _mm512_shuffle_f32x4(p[i], p[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)
    t[i] = vadd(_mm512_shuffle_f32x4(s[i], s[i + 4], 0x88), _mm512_shuffle_f32x4(s[i], s[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)
    u[i] = vadd(_mm512_shuffle_ps(t[i], t[i + 2], 0x44), _mm512_shuffle_ps(t[i], t[i + 2], 0xEE));
  return vadd(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
#else
  vf s[4], u[2];
  for (int i = 0; i < 4; ++i)
    s[i] = vadd(_mm256_permute2f128_ps(p[i], p[i + 4], 0x20), _mm256_permute2f128_ps(p[i], p[i + 4], 0x31));
  for (int i = 0; i < 2; ++i)
    u[i] = vadd(_mm256_shuffle_ps(s[i], s[i + 2], 0x44), _mm256_shuffle_ps(s[i], s[i + 2], 0xEE));
  return vadd(_mm256_shuffle_ps(u[0], u[1], 0x88), _mm256_shuffle_ps(u[0], u[1], 0xDD));
#endif
}

// Vector columns per pass over a tile's V rows: all NV of a row where four rows' accumulators, the
// V vectors and a broadcast fit in the registers, else the widest power of two that does (AVX2
// with a 64-wide head: 2 of 8), so that each V vector is widened once for up to four rows instead
// of once per row.
constexpr int pv_cols(int nv) {
  int c = nv;
  while (c > 1 && 4 * c + c + 1 > NREG) c /= 2;
  return c;
}

// acc rows [g0, g0 + R), vector columns [c0, c0 + CV) of their NV, += p rows x the tile's V rows:
// R x CV accumulators held in registers, each V vector loaded (widened) once for all R rows. Every
// accumulator lane takes the same multiply-adds in the same key order whatever R and CV are.
template <int Kind, int NV, int CV, int R>
static inline void pv_rows(float* acc, const float* s, const char* vc, const int64_t* off, int n, int g0, int c0,
                           const float* lut) {
  vf a[R][CV];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CV; ++c) a[r][c] = vload(acc + size_t(g0 + r) * NV * W + (c0 + c) * W);
  for (int j = 0; j < n; ++j) {
    vf v[CV];
    for (int c = 0; c < CV; ++c) v[c] = load_vec<Kind>(vc + off[j], c0 + c, lut);
    for (int r = 0; r < R; ++r) {
      const vf p = vset1(s[size_t(g0 + r) * KEY_TILE + j]);
      for (int c = 0; c < CV; ++c) a[r][c] = vfma(p, v[c], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CV; ++c) vstore(acc + size_t(g0 + r) * NV * W + (c0 + c) * W, a[r][c]);
}

// acc rows [h0, h1) (one KV head's query rows) += their p rows x the tile's V rows of that head.
// Per pass over the V rows: CV vector columns of up to RC accumulator rows. fp32 V rows are used
// as they lie (loads folded into the multiply-adds): whole rows where the accumulators fit in half
// the registers (at most 4 rows), measured faster than column passes; bf16 / fp8 rows cost a
// widening per vector, so column passes share each widened vector among up to 4 rows.
template <int Kind, int NV>
static inline void pv_head(float* acc, const float* s, const char* vh, const int64_t* o, int n, int h0, int h1,
                           const float* lut) {
  constexpr int CV = Kind == KV_F32 && NREG / 2 / NV > 0 ? NV : pv_cols(NV);
  constexpr int RC = CV < NV ? 4 : NREG / 2 / NV >= 4 ? 4 : NREG / 2 / NV;
  for (int c0 = 0; c0 < NV; c0 += CV) {
    int g0 = h0;
    for (; g0 + RC <= h1; g0 += RC) pv_rows<Kind, NV, CV, RC>(acc, s, vh, o, n, g0, c0, lut);
    switch (h1 - g0) {  // the rest in one pass too (RC <= 4)
      case 3: pv_rows<Kind, NV, CV, 3>(acc, s, vh, o, n, g0, c0, lut); break;
      case 2: pv_rows<Kind, NV, CV, 2>(acc, s, vh, o, n, g0, c0, lut); break;
      case 1: pv_rows<Kind, NV, CV, 1>(acc, s, vh, o, n, g0, c0, lut); break;
      default: break;
    }
  }
}

// One query row's scores sg[0:n] against the tile's n keys (key j's row at row(j)), W keys at a
// time summed by the shuffle tree: dot(k) is key row k's W partial products with the row.
template <typename RowFn, typename DotFn>
static inline void score_keys(int n, RowFn row, DotFn dot, float* sg) {
  for (int j0 = 0; j0 < n; j0 += W) {
    vf p[W];
#pragma GCC unroll 16
    for (int j = 0; j < W; ++j) p[key_slot(j)] = j0 + j < n ? dot(row(j0 + j)) : vzero();
    vstore(sg + j0, lane_sums(p));
  }
}

// Scores of rows [g0, g1) against the tile's n keys (Kind); each query row stays in registers
// while it is scored.
template <int Kind, int NV, typename RowFn>
static inline void score_rows(const float* q, int g0, int g1, int n, RowFn row, float* s, const float* lut) {
  for (int g = g0; g < g1; ++g) {
    vf qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = vload(q + size_t(g) * NV * W + c * W);
    auto dot = [&](const char* k) {
      vf a = vzero();
#pragma GCC unroll 8
      for (int c = 0; c < NV; ++c) a = vfma(qv[c], load_vec<Kind>(k, c, lut), a);
      return a;
    };
    score_keys(n, row, dot, s + size_t(g) * KEY_TILE);
  }
}

#if defined(CPU_PAGED_BF16DOT)
// bf16 K rows scored without widening them (AVX512_BF16): each query row split once into bf16
// hi + lo parts (hi = q rounded to bf16, lo = the rest rounded to bf16: q to ~2^-17 of itself),
// and vdpbf16ps multiplies a K row's bf16 pairs by both, exactly, adding in fp32. Half the
// instructions of widening the tile's K rows and fp32 multiply-adds (2-core Zen 4: a 32-key
// tile's scores for 3 rows 290 -> 150 ns in L1); scores differ from the fp32 path's by ~1e-6 of
// their size. The rows of an item are split the same way whatever the item: batch invariance.
template <int NV>
static inline void split_rows(const float* q, int rows, uint16_t* qs) {
  for (int g = 0; g < rows; ++g)
    for (int c = 0; c < NV / 2; ++c) {
      const float* src = q + size_t(g) * NV * W + 32 * c;
      const vf a = vload(src), b = vload(src + W);
      const __m512i hi = (__m512i)_mm512_cvtne2ps_pbh(b, a);
      const vf ha = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(hi)), 16));
      const vf hb = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(hi, 1)), 16));
      const __m512i lo = (__m512i)_mm512_cvtne2ps_pbh(_mm512_sub_ps(b, hb), _mm512_sub_ps(a, ha));
      _mm512_storeu_si512(qs + (size_t(g) * NV + 2 * c) * 32, hi);
      _mm512_storeu_si512(qs + (size_t(g) * NV + 2 * c + 1) * 32, lo);
    }
}

// score_rows for bf16 K rows and query rows split by split_rows.
template <int NV, typename RowFn>
static inline void score_rows_dot(const uint16_t* qs, int g0, int g1, int n, RowFn row, float* s) {
  for (int g = g0; g < g1; ++g) {
    __m512bh qh[NV / 2], ql[NV / 2];
    for (int c = 0; c < NV / 2; ++c) {
      qh[c] = (__m512bh)_mm512_loadu_si512(qs + (size_t(g) * NV + 2 * c) * 32);
      ql[c] = (__m512bh)_mm512_loadu_si512(qs + (size_t(g) * NV + 2 * c + 1) * 32);
    }
    auto dot = [&](const char* k) {
      vf a = vzero();
#pragma GCC unroll 8
      for (int c = 0; c < NV / 2; ++c) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(k + 64 * c);
        a = _mm512_dpbf16_ps(a, qh[c], kv);
        a = _mm512_dpbf16_ps(a, ql[c], kv);
      }
      return a;
    };
    score_keys(n, row, dot, s + size_t(g) * KEY_TILE);
  }
}
#endif

template <int Kind, int NV>
static void attend_fast(const float* q, const int* pos, int rows, int group, int d, int k_begin, int k_end,
                        int window, float softcap, const int* table, int bs, const char* kc, const char* vc,
                        int64_t stride_tok, int64_t stride_blk, int64_t head_off, int esize,
                        const float* lut, float* m, float* l, float* acc, Scratch& sc) {
  (void)d;
  // Rows [h * group, (h + 1) * group) read KV head h of the item (a decode item may cover all of
  // a sequence's KV heads: its rows then read every token's K / V rows whole, one contiguous run
  // per block, which the CPU's prefetchers follow far better than one head's 1-in-Hkv rows).
  const int64_t head_bytes = int64_t(NV) * W * esize;
  const int heads = (rows + group - 1) / group;
  const PosRange span(pos, rows);
  const int nkeys = k_end - k_begin;
  if (sc.offs.size() < size_t(nkeys)) sc.offs.resize(size_t(nkeys) * 2);
  int64_t* offs = sc.offs.data();
  {
    int blk = k_begin / bs, in = k_begin % bs;
    for (int j = 0; j < nkeys; ++j) {
      offs[j] = (int64_t(table[blk]) * stride_blk + int64_t(in) * stride_tok + head_off) * esize;
      if (++in == bs) in = 0, ++blk;
    }
  }
  const int64_t row_bytes = heads * head_bytes;
  // The next tile's rows are prefetched into L2 (cache_hint<2>) while this one is computed, a KV
  // head's K rows as its scoring starts and its V rows as its V pass does: small batches spread
  // over the tile's work. One burst of the whole next tile into L1 instead took 1.04-1.07x the
  // time of no prefetch at all. 2-core Zen 4, one decode step's attention (32 streams, bf16, 30
  // layers, a cache larger than L3), against none: 0.71-0.73x the time, blocks scattered or
  // not; 1.13x where every block is in L2 already (the prefetch instructions' own cost).
  auto prefetch_head = [&](const char* cache, int j0, int j1, int64_t at) {
    for (int j = j0; j < std::min(j1, nkeys); ++j)
      for (int64_t b = 0; b < head_bytes; b += 64) cache_hint<2>(cache + offs[j] + at + b);
  };
  for (int64_t at = 0; at < row_bytes; at += head_bytes) {  // the first tile
    prefetch_head(kc, 0, KEY_TILE, at);
    prefetch_head(vc, 0, KEY_TILE, at);
  }
#if defined(CPU_PAGED_BF16DOT)
  constexpr bool DOT = Kind == KV_BF16 && NV % 2 == 0;
  if constexpr (DOT) split_rows<NV>(q, rows, sc.qsplit.data());
#else
  constexpr bool DOT = false;
#endif
  const bool touch_first = 2 * KEY_TILE * row_bytes <= 32 * 1024;
  float* s = sc.scores.data();
  for (int t0 = k_begin; t0 < k_end; t0 += KEY_TILE) {
    const int n = std::min(KEY_TILE, k_end - t0);
    const int next = t0 - k_begin + KEY_TILE;  // the next tile's first key
    const int64_t* o = offs + (t0 - k_begin);
    // The tile's rows requested once in address order before the arithmetic, where both fit in
    // L1 with room to spare (bf16, fp8): one request per cache line, ascending within each block,
    // which the hardware prefetchers follow; the arithmetic then reads L1. Decode over bf16 K/V
    // streaming from memory took ~25 % less time so (Zen 5); fp32 tiles (48 KB) would evict
    // themselves, and measured no gain. The requests are prefetches into L1, not loads: a load
    // of a missing line holds the loop's retirement until the line is in, a prefetch does not;
    // one decode step's attention (2-core Zen 4, 32 streams, bf16, both builds alternating in
    // one process, 4 runs) 0.91-1.02x the time over a cache larger than L3 (0.96 on average),
    // 0.92-0.97x with every row in cache, the AVX2 code likewise.
    if (touch_first) {
      for (int j = 0; j < n; ++j)
        for (int64_t b = 0; b < row_bytes; b += 64) cache_hint<1>(kc + o[j] + b);
      for (int j = 0; j < n; ++j)
        for (int64_t b = 0; b < row_bytes; b += 64) cache_hint<1>(vc + o[j] + b);
    }
    for (int h0 = 0; h0 < rows; h0 += group) {  // each KV head's rows
      const int64_t at = (h0 / group) * head_bytes;  // the head's place in a row
      const char* kh = kc + at;
      const int h1 = std::min(rows, h0 + group);
      prefetch_head(kc, next, next + KEY_TILE, at);
      if constexpr (Kind == KV_F32) {
        score_rows<KV_F32, NV>(q, h0, h1, n, [&](int j) { return kh + o[j]; }, s, lut);
      } else if constexpr (DOT) {
#if defined(CPU_PAGED_BF16DOT)
        score_rows_dot<NV>(sc.qsplit.data(), h0, h1, n, [&](int j) { return kh + o[j]; }, s);
#endif
      } else if (h1 - h0 == 1) {
        score_rows<Kind, NV>(q, h0, h1, n, [&](int j) { return kh + o[j]; }, s, lut);
      } else {
        // The head's K rows widened to fp32 once (exactly: bf16 / fp8 values are fp32 values),
        // then read from L1 by each of its query rows, rather than widened once per row.
        float* kb = sc.kbuf.data();
        for (int j = 0; j < n; ++j)
          for (int c = 0; c < NV; ++c) vstore(kb + (size_t(j) * NV + c) * W, load_vec<Kind>(kh + o[j], c, lut));
        const char* kbytes = reinterpret_cast<const char*>(kb);
        score_rows<KV_F32, NV>(q, h0, h1, n, [&](int j) { return kbytes + size_t(j) * NV * W * sizeof(float); }, s, lut);
      }
    }
    const bool masked = span.masks(t0, n, window);
    for (int g = 0; g < rows; ++g) {
      float* sr = s + size_t(g) * KEY_TILE;
      if (!softmax_tile_row(sr, n, masked, t0, pos[g], window, softcap, m[g], l[g], acc + size_t(g) * NV * W, NV * W))
        std::fill(sr, sr + n, 0.0f);  // nothing visible: the V pass below adds nothing for this row
    }
    for (int h0 = 0; h0 < rows; h0 += group) {  // each KV head's rows
      const int64_t at = (h0 / group) * head_bytes;
      const char* vh = vc + at;
      const int h1 = std::min(rows, h0 + group);
      prefetch_head(vc, next, next + KEY_TILE, at);
      // More rows than one pass holds (prefill, verification): fp8 V rows (a few integer ops and
      // a conversion per register) widened to fp32 once, as K above, instead of once per 4 rows,
      // then the fp32 passes; bf16 rows too where a row fills the registers (AVX2, d = 128), as
      // fp32 rows then go in column passes as well. A bf16 row of 8 registers widens for less than the store and
      // reloads cost (measured: 5-16 % slower so at d = 64 on AVX2).
      if constexpr (is_fp8(Kind) || (Kind == KV_BF16 && NREG / 2 / NV == 0)) {
        if (h1 - h0 > 4) {
          float* vb = sc.vbuf.data();
          int64_t lin[KEY_TILE];
          for (int j = 0; j < n; ++j) {
            for (int c = 0; c < NV; ++c) vstore(vb + (size_t(j) * NV + c) * W, load_vec<Kind>(vh + o[j], c, lut));
            lin[j] = int64_t(j) * NV * W * int64_t(sizeof(float));
          }
          pv_head<KV_F32, NV>(acc, s, reinterpret_cast<const char*>(vb), lin, n, h0, h1, lut);
          continue;
        }
      }
      pv_head<Kind, NV>(acc, s, vh, o, n, h0, h1, lut);
    }
  }
}

using FastFn = decltype(&attend_fast<KV_F32, 1>);

template <int NV>
static FastFn fast_for(int kind) {
  return kind == KV_F32    ? &attend_fast<KV_F32, NV>
         : kind == KV_BF16 ? &attend_fast<KV_BF16, NV>
         : kind == KV_E4M3 ? &attend_fast<KV_E4M3, NV>
                           : &attend_fast<KV_E5M2, NV>;
}

// The fast path for a cache of `kind` and head dim d, or nullptr where d is not 1, 2, 4, 8 or 16
// whole registers (the general path then serves every item).
static FastFn pick_fast(int kind, int d) {
  if (d % W) return nullptr;
  switch (d / W) {
    case 1: return fast_for<1>(kind);
    case 2: return fast_for<2>(kind);
    case 4: return fast_for<4>(kind);
    case 8: return fast_for<8>(kind);
    case 16: return fast_for<16>(kind);
    default: return nullptr;
  }
}
#endif
