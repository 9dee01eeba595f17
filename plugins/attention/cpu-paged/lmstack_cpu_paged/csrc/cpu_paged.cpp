// cpu-paged: paged attention on the CPU for lmstack (decode and varlen causal prefill).
//
// The KV cache is [num_blocks, block_size, num_kv_heads, head_dim] per layer; every kernel reads
// K/V rows through the block table where they lie (fp32 rows are used in place, bf16 / fp8 rows
// are widened to fp32 one 32-key tile at a time), so no step copies a sequence's context into
// a contiguous tensor the way the torch reference's gather does.
//
// Work is cut into items of (sequence, KV head, query rows, key range) and spread over OpenMP
// threads. The rows of an item are all the query heads of its KV head, so each K/V row is read
// once per GQA group. Keys are attended in parts cut at fixed positions (every `min_part` keys,
// whatever the batch), merged in key order, so that each query row's result is the same bits
// whichever rows share its call (batch invariance: a speculative verification row equals the
// decode row at its position); a decode item's parts run on different threads when the batch
// alone would leave threads idle. Where the head dim is 1, 2, 4, 8 or 16 whole registers, items
// take a faster path (attend_fast: keys scored W at a time through a shuffle tree, V read once
// for up to four query rows); any other head dim takes the general one.
//
// The inner loops exist three times (attention_impl.h): AVX-512, AVX2+FMA and plain C++, picked
// at run time from what the CPU reports (or forced by the caller, for tests).

#include <torch/extension.h>

#include "isa_cap.h"

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace cpu_paged {

enum KvKind { KV_F32 = 0, KV_BF16 = 1, KV_E4M3 = 2, KV_E5M2 = 3 };
constexpr bool is_fp8(int kind) { return kind == KV_E4M3 || kind == KV_E5M2; }
enum Isa { ISA_SCALAR = 0, ISA_AVX2 = 1, ISA_AVX512 = 2 };

constexpr int KEY_TILE = 32;  // keys scored together: one max / rescale per row per tile

// Per-thread buffers of the kernels, sized for the largest work item.
struct Scratch {
  std::vector<float> kbuf, vbuf, scores;  // a tile of widened K and V rows; rows x tile scores
  std::vector<int64_t> offs;  // byte offsets of a decode item's K / V rows
  std::vector<uint16_t> qsplit;  // an item's query rows as bf16 hi and lo parts (bf16 K with AVX512_BF16)
  void reserve(int rows, int d) {
    kbuf.resize(size_t(KEY_TILE) * d);
    vbuf.resize(size_t(KEY_TILE) * d);
    scores.resize(size_t(rows) * KEY_TILE);
    qsplit.resize(size_t(rows) * d * 2);
  }
};

namespace scalar {
#include "attention_impl.h"
}  // namespace scalar

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
#define CPU_PAGED_AVX2
#include "attention_impl.h"
#undef CPU_PAGED_AVX2
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma,f16c")
namespace avx512 {
#define CPU_PAGED_AVX512
#include "attention_impl.h"
#undef CPU_PAGED_AVX512
}  // namespace avx512
#pragma GCC pop_options

// AVX-512 with AVX512_BF16 (Zen 4, Cooper Lake, Sapphire Rapids and later): the same kernel but
// for bf16 K rows, scored by vdpbf16ps without widening (`score_rows_dot`). Used for bf16 caches
// where the CPU has it, unless LMSTACK_CPU_PAGED_BF16_DOT=0 (read per call: the tests run both).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
namespace avx512bf16 {
#define CPU_PAGED_AVX512
#define CPU_PAGED_BF16DOT
#include "attention_impl.h"
#undef CPU_PAGED_BF16DOT
#undef CPU_PAGED_AVX512
}  // namespace avx512bf16
#pragma GCC pop_options

bool bf16_dot() {
  __builtin_cpu_init();
  const char* off = std::getenv("LMSTACK_CPU_PAGED_BF16_DOT");
  return __builtin_cpu_supports("avx512bf16") && !(off && std::string(off) == "0");
}

int64_t best_isa() {  // what the CPU has, within LMSTACK_MAX_ISA (isa_cap.h)
  __builtin_cpu_init();
  int64_t found = ISA_SCALAR;
  if (__builtin_cpu_supports("avx512f"))
    found = ISA_AVX512;
  else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    found = ISA_AVX2;
  return std::min(found, lmstack::isa_cap());
}

namespace {

// Every fp8 code's value, per format: the scalar path widens by one table lookup (the vector
// paths convert by way of fp16, attention_impl.h).
struct Fp8Tables {
  float e4m3[256], e5m2[256];
  Fp8Tables() {
    for (int i = 0; i < 256; ++i) {
      e4m3[i] = float(c10::Float8_e4m3fn(uint8_t(i), c10::Float8_e4m3fn::from_bits()));
      e5m2[i] = float(c10::Float8_e5m2(uint8_t(i), c10::Float8_e5m2::from_bits()));
    }
  }
};
const Fp8Tables& fp8_tables() {
  static const Fp8Tables tables;
  return tables;
}

using AttendFn = void (*)(const float*, const int*, int, int, int, int, int, int, float, const int*, int, const char*,
                          const char*, int64_t, int64_t, int64_t, int, const float*, float*, float*, float*,
                          Scratch&);

// Query rows per prefill item: rows = tokens x G stay within this, so the fp32 query tile and
// its accumulator (2 x 64 x head_dim floats) sit in L1/L2 while the keys stream past.
constexpr int PREFILL_ROWS = 64;

struct Item {
  int seq, head;            // the first KV head (of `heads`: 1, or all of a decode sequence's)
  int tok0, ntok;           // query tokens [tok0, tok0 + ntok) of the batch
  int pos0;                 // position of token tok0 in its sequence
  int k_begin, k_end;       // keys attended
  int slot;                 // -1: write the output; else the partial-state slot to fill
  int heads = 1;
};

// One query row's result from the softmax states (running max m, sum l, unnormalised acc[d]) of
// its key parts, in key order, part j at m[j * ms], l[j * ms], acc[j * as]: every part rescaled to
// the largest max and added (a part of which the row sees no key has m = -inf and adds nothing).
// Writes the unnormalised sum to out and returns the normaliser. A single part comes out as it
// went in, bit for bit (its weight is exp(0) = 1), so an item cut into parts and one that was not
// give the same result wherever the row sees keys of one part only.
float merge_parts(const float* m, const float* l, const float* acc, int parts, int64_t ms, int64_t as, int d,
                  float* out) {
  float mx = -INFINITY;
  for (int j = 0; j < parts; ++j) mx = std::max(mx, m[j * ms]);
  float total = 0.0f;
  std::fill(out, out + d, 0.0f);
  for (int j = 0; j < parts; ++j) {
    if (m[j * ms] == -INFINITY) continue;
    const float w = std::exp(m[j * ms] - mx);
    total += w * l[j * ms];
    const float* a = acc + j * as;
    for (int i = 0; i < d; ++i) out[i] += w * a[i];
  }
  return total;
}

}  // namespace

// q [T, Hq, D] (fp32 or bf16; each token's heads contiguous, tokens at any stride: the fused
// projection's q is a view of its output, read where it lies rather than copied; other layouts
// are copied first); caches [NB, BS, Hkv, D] (fp32, bf16, fp8 e4m3 / e5m2);
// block_tables [B, max_blocks] int32; query_start [B + 1] int32; context_lens [B] int32 (cached
// tokens before each sequence's first query token). window <= 0: none. softcap <= 0: none, else
// scores (after `scale`) become softcap * tanh(score / softcap). Scales: fp32 [Hkv] for a
// scaled fp8 cache, else undefined. Returns [T, Hq, D] in q's dtype.
torch::Tensor paged_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                              torch::Tensor block_tables, torch::Tensor query_start,
                              torch::Tensor context_lens, double scale, int64_t window,
                              std::optional<torch::Tensor> k_scale, std::optional<torch::Tensor> v_scale,
                              int64_t isa, int64_t min_part, double softcap) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "cpu-paged: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "cpu-paged: bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cpu-paged: the caches must be contiguous");
  if (q.stride(2) != 1 || q.stride(1) != q.size(2) || q.stride(0) < q.size(1) * q.size(2)) q = q.contiguous();
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "cpu-paged: queries must be float32 or bfloat16, got ", q.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && query_start.scalar_type() == at::kInt &&
                  context_lens.scalar_type() == at::kInt,
              "cpu-paged: metadata must be int32");
  const int T = q.size(0), Hq = q.size(1), D = q.size(2);
  const int BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && Hq % Hkv == 0, "cpu-paged: head dims / GQA ratio do not match");
  const int G = Hq / Hkv;
  const int B = context_lens.size(0);

  int kind, esize;
  const float* lut = nullptr;
  switch (k_cache.scalar_type()) {
    case at::kFloat: kind = KV_F32, esize = 4; break;
    case at::kBFloat16: kind = KV_BF16, esize = 2; break;
    case at::kFloat8_e4m3fn: kind = KV_E4M3, esize = 1, lut = fp8_tables().e4m3; break;
    case at::kFloat8_e5m2: kind = KV_E5M2, esize = 1, lut = fp8_tables().e5m2; break;
    default: TORCH_CHECK(false, "cpu-paged: unsupported KV cache dtype ", k_cache.scalar_type());
  }
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "cpu-paged: K and V caches differ in dtype");
  std::vector<float> ks(Hkv, 1.0f), vs(Hkv, 1.0f);
  if (k_scale.has_value() && k_scale->defined()) {
    TORCH_CHECK(v_scale.has_value() && v_scale->defined(), "cpu-paged: k_scale without v_scale");
    auto kf = k_scale->to(at::kFloat).contiguous(), vf = v_scale->to(at::kFloat).contiguous();
    TORCH_CHECK(kf.numel() == Hkv && vf.numel() == Hkv, "cpu-paged: one scale per KV head expected");
    std::copy(kf.data_ptr<float>(), kf.data_ptr<float>() + Hkv, ks.begin());
    std::copy(vf.data_ptr<float>(), vf.data_ptr<float>() + Hkv, vs.begin());
  }

  auto out = torch::empty({T, Hq, D}, q.options());
  if (T == 0 || B == 0) return out;

  auto tables = block_tables.contiguous();
  const int max_blocks = tables.size(1);
  const int* tab = tables.data_ptr<int>();
  const int* qs = query_start.contiguous().data_ptr<int>();
  const int* ctx = context_lens.contiguous().data_ptr<int>();
  const int win = window > 0 ? int(window) : 0;
  const float cap = softcap > 0 ? float(softcap) : 0.0f;
  // The cap applies to score = q.k x scale; queries carry scale x k_scale, so with a scaled
  // cache the kernels' scores are already the true ones.

  // --- work items ------------------------------------------------------------------------
  // Keys are attended in parts cut at fixed positions (multiples of `part`, whatever the batch):
  // each part's softmax state is kept apart and the parts are merged in key order at the end
  // (one part: its state is the result, bit for bit), and every tile starts on a multiple of
  // KEY_TILE. A query row's result then depends only on its position and the cache, never on
  // the rows beside it: a decode row, the same position inside a prefill chunk or a speculative
  // verification, and a row whose parts ran on other threads all get the same bits (greedy
  // speculative decoding reproduces plain decoding's logits; the matmuls must do their share).
  const int part = int((std::max<int64_t>(min_part, 1) + KEY_TILE - 1) / KEY_TILE * KEY_TILE);
  auto part_end = [&](int k) { return (k / part + 1) * part; };
  std::vector<Item> items;
  int num_decode = 0;
  const int prefill_tok = std::max(1, PREFILL_ROWS / G);
  for (int b = 0; b < B; ++b) {
    const int ql = qs[b + 1] - qs[b], c = ctx[b];
    TORCH_CHECK((c + ql + BS - 1) / BS <= max_blocks, "cpu-paged: block table too short for sequence ", b);
    for (int t0 = 0; t0 < ql; t0 += prefill_tok) {
      const int n = std::min(prefill_tok, ql - t0);
      const int first = c + t0;  // position of the item's first query token
      // The window's first key rounded down to a tile boundary (the tile masks what lies before).
      const int k_begin = win ? std::max(0, first - win + 1) / KEY_TILE * KEY_TILE : 0;
      for (int h = 0; h < Hkv; ++h) items.push_back({b, h, qs[b] + t0, n, first, k_begin, first + n, -1});
    }
    if (ql == 1) ++num_decode;
  }

  // When there are too few items to keep every thread busy (batch 1 with a handful of KV heads
  // on many cores), a decode item's parts become items of their own, their states kept in slots
  // (`slot_m`, `slot_l`, `slot_acc`) and merged after the run; otherwise an item's parts run one
  // after the other on its thread. The same arithmetic either way.
  const int threads = omp_get_max_threads();
  int num_slots = 0;
  struct Run {  // a decode item cut into `parts` items, slots [slot, slot + parts)
    int tok, head, slot, parts;
  };
  std::vector<Run> runs;
  if (num_decode && int64_t(items.size()) < 4 * threads) {
    std::vector<Item> split;
    for (const Item& it : items) {
      if (it.ntok != 1 || part_end(it.k_begin) >= it.k_end) {
        split.push_back(it);
        continue;
      }
      runs.push_back({it.tok0, it.head, num_slots, 0});
      for (int k0 = it.k_begin; k0 < it.k_end; k0 = part_end(k0)) {
        Item s = it;
        s.k_begin = k0, s.k_end = std::min(it.k_end, part_end(k0)), s.slot = num_slots++;
        split.push_back(s);
        ++runs.back().parts;
      }
    }
    items.swap(split);
  }
  // The fast path where the head dim is 1, 2, 4, 8 or 16 whole registers.
  if (isa < 0) isa = best_isa();
  AttendFn fast = isa == ISA_AVX512 ? avx512::pick_fast(kind, D) : isa == ISA_AVX2 ? avx2::pick_fast(kind, D) : nullptr;
  if (isa == ISA_AVX512 && kind == KV_BF16 && D % 32 == 0 && fast && bf16_dot()) fast = avx512bf16::pick_fast(kind, D);
  // There, unsplit decode sequences are one item over all their KV heads (contiguous reads),
  // while that still leaves 4 items per thread.
  if (fast && num_slots == 0 && Hkv > 1 && int64_t(items.size()) - int64_t(num_decode) * (Hkv - 1) >= 4 * threads) {
    std::vector<Item> merged;
    for (const Item& it : items)
      if (it.ntok != 1)
        merged.push_back(it);
      else if (it.head == 0)
        merged.push_back(it), merged.back().heads = Hkv;
    items.swap(merged);
  }
  // The slots' states: per slot, G rows of m, l and acc[D].
  std::vector<float> slot_m(size_t(num_slots) * G), slot_l(size_t(num_slots) * G), slot_acc(size_t(num_slots) * G * D);

  // --- run -------------------------------------------------------------------------------
  AttendFn attend = nullptr;
#define CPU_PAGED_PICK(NS) \
  attend = kind == KV_F32    ? &NS::attend<KV_F32>  \
           : kind == KV_BF16 ? &NS::attend<KV_BF16> \
           : kind == KV_E4M3 ? &NS::attend<KV_E4M3> \
                             : &NS::attend<KV_E5M2>;
  if (isa == ISA_AVX512) {
    CPU_PAGED_PICK(avx512)
  } else if (isa == ISA_AVX2) {
    CPU_PAGED_PICK(avx2)
  } else {
    CPU_PAGED_PICK(scalar)
  }
#undef CPU_PAGED_PICK
  if (fast) attend = fast;

  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  const char* qp = static_cast<const char*>(q.data_ptr());
  const int64_t q_tok = q.stride(0);  // elements between two tokens' query rows
  char* op = static_cast<char*>(out.data_ptr());
  const char* kc = static_cast<const char*>(k_cache.data_ptr());
  const char* vc = static_cast<const char*>(v_cache.data_ptr());
  const int64_t stride_tok = int64_t(Hkv) * D, stride_blk = int64_t(BS) * Hkv * D;
  const int max_rows = std::max(prefill_tok, Hkv) * G;

  // Row r of an item is (token r / per_tok, query head head * G + r % per_tok), per_tok = G * heads.
  auto store_row = [&](int tok, int qh, const float* acc, float mult) {
    const int64_t base = (int64_t(tok) * Hq + qh) * D;
    if (q_bf16) {
      uint16_t* o = reinterpret_cast<uint16_t*>(op) + base;
      for (int i = 0; i < D; ++i) o[i] = scalar::float_to_bf16(acc[i] * mult);
    } else {
      float* o = reinterpret_cast<float*>(op) + base;
      for (int i = 0; i < D; ++i) o[i] = acc[i] * mult;
    }
  };
  // One row's parts, merged: part j's state at m[j * ms], l[j * ms], acc[j * as].
  auto merge_row = [&](int tok, int qh, const float* m, const float* l, const float* acc, int parts, int64_t ms,
                       int64_t as, float* sum) {
    const float total = merge_parts(m, l, acc, parts, ms, as, D, sum);
    store_row(tok, qh, sum, total > 0 ? vs[qh / G] / total : 0.0f);
  };

#pragma omp parallel
  {
    Scratch sc;
    sc.reserve(max_rows, D);
    std::vector<float> qbuf(size_t(max_rows) * D), sum(D);
    std::vector<float> acc, m, l;  // the parts' states of the item at hand: part j's rows at j * rows
    std::vector<int> pos(max_rows);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < items.size(); ++i) {
      const Item& it = items[i];
      // Row r is token tok0 + r / per_tok, query head head * G + r % per_tok.
      const int per_tok = G * it.heads, rows = it.ntok * per_tok;
      for (int r = 0; r < rows; ++r) {
        // Queries in fp32, pre-multiplied by the softmax scale and their head's K scale: a
        // scaled cache's stored keys are then used as they are.
        const float qmul = float(scale) * ks[it.head + r % per_tok / G];
        const int64_t base = int64_t(it.tok0 + r / per_tok) * q_tok + int64_t(it.head * G + r % per_tok) * D;
        float* dst = qbuf.data() + size_t(r) * D;
        if (q_bf16) {
          const uint16_t* src = reinterpret_cast<const uint16_t*>(qp) + base;
          for (int d = 0; d < D; ++d) dst[d] = scalar::bf16_to_float(src[d]) * qmul;
        } else {
          const float* src = reinterpret_cast<const float*>(qp) + base;
          for (int d = 0; d < D; ++d) dst[d] = src[d] * qmul;
        }
        pos[r] = it.pos0 + r / per_tok;
      }
      const int parts = (it.k_end - 1) / part - it.k_begin / part + 1;
      if (m.size() < size_t(parts) * rows) m.resize(size_t(parts) * rows), l.resize(m.size()), acc.resize(m.size() * D);
      float *pm = m.data(), *pl = l.data(), *pacc = acc.data();
      if (it.slot >= 0) {  // one part of a decode item cut across threads (rows = G)
        pm = slot_m.data() + size_t(it.slot) * G, pl = slot_l.data() + size_t(it.slot) * G;
        pacc = slot_acc.data() + size_t(it.slot) * G * D;
      }
      for (int j = 0, k0 = it.k_begin; k0 < it.k_end; ++j, k0 = part_end(k0)) {
        float *jm = pm + size_t(j) * rows, *jl = pl + size_t(j) * rows, *jacc = pacc + size_t(j) * rows * D;
        std::fill(jm, jm + rows, -INFINITY);
        std::fill(jl, jl + rows, 0.0f);
        std::fill(jacc, jacc + size_t(rows) * D, 0.0f);
        attend(qbuf.data(), pos.data(), rows, it.heads > 1 ? G : rows, D, k0, std::min(it.k_end, part_end(k0)), win,
               cap, tab + int64_t(it.seq) * max_blocks, BS, kc, vc, stride_tok, stride_blk, int64_t(it.head) * D, esize,
               lut, jm, jl, jacc, sc);
      }
      if (it.slot >= 0) continue;  // merged after the run
      for (int r = 0; r < rows; ++r) {
        const int tok = it.tok0 + r / per_tok, qh = it.head * G + r % per_tok;
        if (parts == 1)  // l > 0: every query sees at least itself
          store_row(tok, qh, pacc + size_t(r) * D, pl[r] > 0 ? vs[qh / G] / pl[r] : 0.0f);
        else
          merge_row(tok, qh, pm + r, pl + r, pacc + size_t(r) * D, parts, rows, int64_t(rows) * D, sum.data());
      }
    }
  }
  // The decode items cut across threads: each row's parts lie in consecutive slots.
#pragma omp parallel for schedule(static)
  for (size_t u = 0; u < runs.size(); ++u) {
    const Run& run = runs[u];
    std::vector<float> sum(D);
    for (int g = 0; g < G; ++g) {
      const size_t at = size_t(run.slot) * G + g;
      merge_row(run.tok, run.head * G + g, slot_m.data() + at, slot_l.data() + at, slot_acc.data() + at * D, run.parts,
                G, int64_t(G) * D, sum.data());
    }
  }
  return out;
}

// fp32 -> fp8 bits, rounded to nearest even, for |x| within the format's range or NaN (the
// caller clamps first): c10's conversion, which torch's `.to()` runs, bit for bit, but without
// its branches, so a row converts ~3x faster. MANT: mantissa bits (3: e4m3fn, 2: e5m2); BIAS:
// exponent bias (7, 15); NaN is 0x7f in both. A value at or above the smallest normal keeps
// fp32's exponent (rebiased) and its mantissa rounded to MANT bits; below it, the value is a
// multiple of the smallest subnormal, RNE(|x| / subnormal), found by adding 2^23.
template <int MANT, int BIAS>
static inline uint8_t fp8_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  const uint32_t sign = (u >> 24) & 0x80u, a = u & 0x7fffffffu;
  constexpr int DROP = 23 - MANT;
  const uint32_t normal = ((a + ((1u << (DROP - 1)) - 1) + ((a >> DROP) & 1u)) >> DROP) - (uint32_t(127 - BIAS) << MANT);
  float ax;
  std::memcpy(&ax, &a, 4);
  constexpr float inv_subnormal = float(1u << (BIAS - 1 + MANT));  // 1 / 2^(1 - BIAS - MANT)
  const float t = ax * inv_subnormal + 8388608.0f;
  uint32_t tb;
  std::memcpy(&tb, &t, 4);
  const uint32_t smallest_normal = uint32_t(127 + 1 - BIAS) << 23;
  const uint32_t bits = a > 0x7f800000u ? 0x7fu : a >= smallest_normal ? normal : tb - 0x4b000000u;
  return uint8_t(sign | bits);
}

template <typename Src>
static inline float widen(Src v) {  // a K / V value: fp32, or bf16 bits
  if constexpr (std::is_same_v<Src, float>)
    return v;
  else
    return scalar::bf16_to_float(v);
}

// One token's K or V row (H heads x D values of Src) into its cache row of type `dst`, where the
// two dtypes differ: fp32 -> bf16 (nearest even), bf16 -> fp32, or into fp8 as
// `lmstack.kv_quant.quantize_kv` computes it: x / scale of its head in fp32, clamped to the
// format's largest value (NaN stays NaN, as torch's clamp), then fp8_bits. Templated on the
// source so that the per-value loops test no dtype.
template <typename Src>
static void convert_row(const Src* s, char* b, at::ScalarType dst, const float* scale, int64_t H, int64_t D) {
  auto to_fp8 = [&](auto bits, float limit) {
    uint8_t* o = reinterpret_cast<uint8_t*>(b);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = h * D; i < (h + 1) * D; ++i) {
        const float x = widen(s[i]) / scale[h];
        o[i] = bits(x < -limit ? -limit : x > limit ? limit : x);
      }
  };
  if (dst == at::kFloat8_e4m3fn) {
    to_fp8([](float x) { return fp8_bits<3, 7>(x); }, 448.0f);  // lambdas, not pointers: inlined
  } else if (dst == at::kFloat8_e5m2) {
    to_fp8([](float x) { return fp8_bits<2, 15>(x); }, 57344.0f);
  } else if (dst == at::kBFloat16) {
    uint16_t* o = reinterpret_cast<uint16_t*>(b);
    for (int64_t i = 0; i < H * D; ++i) o[i] = scalar::float_to_bf16(widen(s[i]));
  } else {
    float* o = reinterpret_cast<float*>(b);
    for (int64_t i = 0; i < H * D; ++i) o[i] = widen(s[i]);
  }
}

// This step's K and V rows into their cache slots: k, v [T, Hkv, D] (each token's Hkv x D
// contiguous, any token stride), fp32 or bf16, into caches [NB, BS, Hkv, D] of fp32, bf16 or
// (with k_scale / v_scale [Hkv]) scaled fp8; slot_mapping [T] int64 (block * BS + offset). One
// call for both tensors: the two `index_copy_`s it replaces cost ~10 us each at decode,
// whatever their size, and a scaled fp8 cache's quantization in torch a few more ops per layer.
// Values are what torch's conversions give: bf16 rounded to nearest even; fp8 as
// `lmstack.kv_quant.quantize_kv` computes it (x / scale in fp32, clamped to the format's
// largest value, rounded to nearest even as c10's conversion does: convert_row), byte for byte.
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
              torch::Tensor slot_mapping, std::optional<torch::Tensor> k_scale,
              std::optional<torch::Tensor> v_scale) {
  TORCH_CHECK(k.device().is_cpu() && v.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "cpu-paged write_kv: CPU tensors only");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "cpu-paged write_kv: k, v [T, Hkv, D] and caches [NB, BS, Hkv, D] expected");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3),
              "cpu-paged write_kv: rows of ", k.size(1), "x", k.size(2), " for a cache of ", k_cache.size(2), "x",
              k_cache.size(3));
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cpu-paged write_kv: caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == k.size(0),
              "cpu-paged write_kv: slot_mapping must be int64 [T]");
  const auto src_t = k.scalar_type(), dst_t = k_cache.scalar_type();
  TORCH_CHECK(v.scalar_type() == src_t && v_cache.scalar_type() == dst_t, "cpu-paged write_kv: K and V dtypes differ");
  const bool fp8 = dst_t == at::kFloat8_e4m3fn || dst_t == at::kFloat8_e5m2;
  TORCH_CHECK((src_t == at::kFloat || src_t == at::kBFloat16) && (dst_t == at::kFloat || dst_t == at::kBFloat16 || fp8),
              "cpu-paged write_kv: float32 / bfloat16 into float32 / bfloat16 / float8 only, got ", src_t, " into ",
              dst_t);
  const bool scaled = k_scale.has_value() && k_scale->defined();
  TORCH_CHECK(scaled == fp8 && scaled == (v_scale.has_value() && v_scale->defined()),
              "cpu-paged write_kv: an fp8 cache takes k_scale and v_scale, other caches neither");
  const int64_t T = k.size(0), H = k.size(1), D = k.size(2), row = H * D, slots = k_cache.size(0) * k_cache.size(1);
  for (const auto& t : {k, v})
    TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), "cpu-paged write_kv: each token's rows must be contiguous");
  const auto slot_c = slot_mapping.contiguous();
  const int64_t* slot = slot_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < slots, "cpu-paged write_kv: slot ", slot[t], " outside the cache's ", slots);
  const int64_t es = k.element_size(), ed = k_cache.element_size();

  // One token's row, source to target dtype; `scale`: the fp8 cache's per-head scales.
  auto convert = [&](const char* a, char* b, const float* scale) {
    if (src_t == dst_t)
      std::memcpy(b, a, row * es);
    else if (src_t == at::kFloat)
      convert_row(reinterpret_cast<const float*>(a), b, dst_t, scale, H, D);
    else
      convert_row(reinterpret_cast<const uint16_t*>(a), b, dst_t, scale, H, D);
  };
  auto copy = [&](const torch::Tensor& src, torch::Tensor& dst, const std::optional<torch::Tensor>& scale) {
    torch::Tensor sc;
    if (fp8) {
      sc = scale->to(at::kFloat).contiguous();
      TORCH_CHECK(sc.numel() == H, "cpu-paged write_kv: one scale per KV head expected");
    }
    const float* scp = fp8 ? sc.data_ptr<float>() : nullptr;
    const char* sp = static_cast<const char*>(src.data_ptr());
    char* dp = static_cast<char*>(dst.data_ptr());
    const int64_t ss = src.stride(0) * es;
    // Conversions cost per value: a prefill chunk's rows are spread over the threads.
#pragma omp parallel for if (T >= 64 && src_t != dst_t)
    for (int64_t t = 0; t < T; ++t) convert(sp + t * ss, dp + slot[t] * row * ed, scp);
  };
  copy(k, k_cache, k_scale);
  copy(v, v_cache, v_scale);
}

}  // namespace cpu_paged

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lmstack cpu-paged attention kernels";
  m.def("paged_attention", &cpu_paged::paged_attention, "paged varlen attention (prefill and decode)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("query_start"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window"), py::arg("k_scale") = py::none(),
        py::arg("v_scale") = py::none(), py::arg("isa") = -1, py::arg("min_part") = 256,
        py::arg("softcap") = 0.0);
  m.def("write_kv", &cpu_paged::write_kv, "k, v [T, Hkv, D] into the caches' slots (fp32 / bf16 / scaled fp8)",
        py::arg("k"), py::arg("v"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slot_mapping"),
        py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none());
  m.def("best_isa", &cpu_paged::best_isa, "2: AVX-512, 1: AVX2+FMA, 0: scalar");
  m.def("bf16_dot", &cpu_paged::bf16_dot,
        "whether AVX-512 calls score bf16 K rows by vdpbf16ps (the CPU has AVX512_BF16, and "
        "LMSTACK_CPU_PAGED_BF16_DOT is not 0)");
}
