// Attention on CPU reading the paged KV cache in place: decode (one query per sequence) and a sequence's
// new tokens (a prefill tail over a cached prefix, a chunk).
//
// The torch reference gathers every sequence's blocks into a padded tensor and hands it to SDPA: the
// cache is read, written and read again. Here a walk goes over one KV head's rows of a range of a
// sequence's blocks directly, so K and V come from memory once, and every K/V row fetched serves all the
// query rows that share it — the query heads of a GQA group, and for a prefill every new token's. With
// AVX-512 and head_dim 64 or 128 a walk keeps its query rows and their accumulators in registers and sums
// 16 tokens' dot products in one shuffle tree; microbenchmark (decode, B=16, contexts 200-450, 30 layers):
// 17.8 -> 10.8 ms per step-equivalent.
//
// Layouts (float32, bfloat16 or float8_e4m3fn cache, float32 math):
//   q            [B, H, D] (decode) or [n, H, D] (one sequence's new tokens)   out: the same (q's dtype)
//   k/v cache    [num_blocks, block_size, KVH, D]
//   block_tables [B, W] int64, context_lens [B] int64 (tokens in cache, including this step's)
// A sliding-window layer (window > 0) lets the query at position p see keys p - window < k <= p only; the
// walks start at the block holding the first key any of their rows sees (no block before it is read).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec_math.h"
#include "work_queue.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kLanes = 16;  // one AVX-512 register of floats; independent partial sums vectorize
                                // without -ffast-math (which would also assume no inf/NaN anywhere)

// One float8_e4m3fn cache element, widened in branch-free integer arithmetic the compiler vectorizes
// (a table lookup would not: 6x slower per step here). Normal values move their fields into a float32's;
// subnormals (exponent 0) are m x 2^-9 exactly. Bit-exact with c10's conversion for every byte but
// NaN, which no writer stores. Its scale is applied outside the walk: folded into the query (K) and
// the output (V).
struct Fp8 {
  uint8_t bits;
  explicit operator float() const {
    const uint32_t b = bits, e = (b >> 3) & 0xFu, m = b & 0x7u, sign = (b & 0x80u) << 24;
    const uint32_t normal_bits = sign | ((e + 120u) << 23) | (m << 20);
    float normal;
    std::memcpy(&normal, &normal_bits, sizeof normal);
    const uint32_t sub_bits = sign | 0x3B000000u;  // ±2^-9
    float unit;
    std::memcpy(&unit, &sub_bits, sizeof unit);
    return e ? normal : unit * static_cast<float>(m);
  }
};

template <typename T>
inline float dot(const float* q, const T* k, int64_t d) {
  float part[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= d; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] += q[i + j] * static_cast<float>(k[i + j]);
  float s = 0.f;
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  for (int64_t j = 0; j < kLanes; ++j) s += part[j];
  return s;
}

// exp(x) for x <= 0 (softmax after subtracting the max): Cody-Waite reduction x = n*ln2 + r and a
// degree-6 polynomial for e^r, |rel. error| < 2e-7. Branch-free so the loop over a row vectorizes;
// glibc's vector expf is only declared under -ffast-math.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x underflows float anyway
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.98756915e-4f;
  p = p * r + 1.39819994e-3f;
  p = p * r + 8.33345205e-3f;
  p = p * r + 4.16657981e-2f;
  p = p * r + 1.66666672e-1f;
  p = p * r + 5.00000000e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] += a * static_cast<float>(v[i]);
}

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
// An FP8 row's dot product and axpy 8 values at a time (x86-64-v3): each byte's fields moved into a
// float16's (whose subnormals cover e4m3's), widened by F16C and scaled by 2^8 for the exponent biases'
// difference (15 - 7) — exact, like Fp8's conversion, at a fraction of its cost per value.
inline __m256 fp8x8(const Fp8* p) {
  return _mm256_mul_ps(fp8_over256_x8(reinterpret_cast<const uint8_t*>(p)), _mm256_set1_ps(256.f));
}

inline float dot(const float* q, const Fp8* k, int64_t d) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= d; i += 16) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), fp8x8(k + i), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), fp8x8(k + i + 8), a1);
  }
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(_mm256_add_ps(a0, a1)), _mm256_extractf128_ps(_mm256_add_ps(a0, a1), 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  float s = _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  for (; i < d; ++i) s += q[i] * static_cast<float>(k[i]);
  return s;
}

inline void axpy(float a, const Fp8* v, float* acc, int64_t d) {
  const __m256 va = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(va, fp8x8(v + i), _mm256_loadu_ps(acc + i)));
  for (; i < d; ++i) acc[i] += a * static_cast<float>(v[i]);
}
#endif

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {  // bf16 -> f32 is a 16-bit shift
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const Fp8* p) {  // e4m3 -> f32 as fp8x8 does it, 16 at a time: exact
  return _mm512_mul_ps(fp8_over256_x16(reinterpret_cast<const uint8_t*>(p)), _mm512_set1_ps(256.f));
}

#endif

#if defined(__AVX512F__)
// Lane t of the result = the sum of the 16 lanes of v[t]: a transpose-and-add tree, 45 instructions
// for 16 dot products where one horizontal sum each costs about 8.
inline __m512 reduce16(const __m512* v) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: that lane's sums of v[4i..4i+3]
    const __m512d a = _mm512_castps_pd(x[2 * i]), b = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Add the four 128-bit lanes: lanes (0, 2) + (1, 3), then the two halves.
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}
#endif

// The partial softmax of a row's scores over a range: entries [lo, visible) (the keys the row may see)
// become e^(s - m) with m their max, the rest 0; returns their sum (0 and m = -inf when none).
inline float softmax_partial(float* s, int64_t len, int64_t lo, int64_t visible, float& m) {
  m = -INFINITY;
  float sum = 0.f;
  lo = std::max<int64_t>(lo, 0);
  if (lo >= visible) {
    std::fill(s, s + len, 0.f);
    return 0.f;
  }
  std::fill(s, s + lo, 0.f);
  s += lo;
  len -= lo;
  visible -= lo;
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 vm = _mm512_set1_ps(-INFINITY);
  for (; t + 16 <= visible; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(s + t));
  m = _mm512_reduce_max_ps(vm);
#endif
  for (; t < visible; ++t) m = std::max(m, s[t]);
  t = 0;
#if defined(__AVX512F__)
  {
    __m512 vs = _mm512_setzero_ps();
    const __m512 vmax = _mm512_set1_ps(m);
    for (; t + 16 <= visible; t += 16) {
      const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), vmax));
      _mm512_storeu_ps(s + t, e);
      vs = _mm512_add_ps(vs, e);
    }
    sum = _mm512_reduce_add_ps(vs);
  }
#endif
  for (; t < visible; ++t) {
    s[t] = exp_nonpositive(s[t] - m);
    sum += s[t];
  }
  std::fill(s + std::max<int64_t>(visible, 0), s + len, 0.f);
  return sum;
}

// Visit the rows of one KV head of a sequence, block by block: fn(t, pointer to its D values). The same
// head's rows kAheadBlocks blocks on are prefetched at each block, and the first kAheadBlocks at the start,
// so they stream in while earlier ones are used.
// From token `from` on (a multiple of block_size), up to ctx.
constexpr int64_t kAheadBlocks = 4;  // one block ahead (the walk's first form) left it waiting on memory

template <typename T>
inline void prefetch_block_rows(const T* cache, const int64_t* table, int64_t blk, int64_t block_size, int64_t row, int64_t head_off, int64_t bytes) {
  const char* at = reinterpret_cast<const char*>(cache + table[blk] * block_size * row + head_off);
  for (int64_t r = 0; r < block_size; ++r)
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(at + r * row * static_cast<int64_t>(sizeof(T)) + c);
}

template <typename T, typename Fn>
inline void for_each_row(const T* cache, const int64_t* table, int64_t ctx, int64_t block_size, int64_t row, int64_t head_off,
                         int64_t D, Fn fn, int64_t from = 0) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  const int64_t first = from / block_size, blocks = (ctx + block_size - 1) / block_size;
  for (int64_t b = first + 1; b < std::min(blocks, first + kAheadBlocks); ++b) prefetch_block_rows(cache, table, b, block_size, row, head_off, bytes);
  for (int64_t t0 = from, blk = first; t0 < ctx; t0 += block_size, ++blk) {
    const T* base = cache + table[blk] * block_size * row + head_off;
    if (blk + kAheadBlocks < blocks) prefetch_block_rows(cache, table, blk + kAheadBlocks, block_size, row, head_off, bytes);
    const int64_t n = std::min(block_size, ctx - t0);
    for (int64_t r = 0; r < n; ++r) fn(t0 + r, base + r * row);
  }
}

// A prefill's n new tokens (their K/V in the cache already, at positions ctx - n .. ctx - 1, each attending
// causally) run as n decode queries would stream a long context's K/V from memory n times; instead a work
// item is one KV head and a range of at most kChunkKeys keys (held in L2 while used), and every query row
// of that head — each new token's heads of the group — goes over the range in register tiles. Each item
// leaves a softmax partial per row (its max, sum and unnormalized output), merged per row at the end (the
// ranges split a long context over the threads). Decode walks its own ranges (decode_impl).
constexpr int64_t kChunkKeys = 512;

#if defined(__AVX512F__)
// G query rows (scaled, in registers) over keys [from, to) of one KV head: scores into `scores` [G][to - from],
// then each row's partial: m[g], l[g] and acc[g] = sum of e^(s - m) V. Row g sees keys first[g] <= k < limit[g].
template <int C, int G, typename T>
void attend_range_avx512(const float* qf, const int64_t* first, const int64_t* limit, const T* k_cache, const T* v_cache, const int64_t* table, int64_t from,
                         int64_t to, int64_t block_size, int64_t row, int64_t head_off, float* scores, float* m, float* l, float* acc) {
  constexpr int64_t D = C * 16;
  const int64_t len = to - from;
  int64_t seen = 0;  // keys any of the rows sees
  for (int g = 0; g < G; ++g) seen = std::max(seen, std::min(limit[g], to) - from);
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(qf + g * D + c * 16);
  __m512 part[G][16];
  for_each_row(k_cache, table, from + seen, block_size, row, head_off, D, [&](int64_t t, const T* k) {
    const int64_t i = t - from;
    __m512 kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load16(k + c * 16);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[g][c], kv[c], a);
      part[g][i % 16] = a;
    }
    if (i % 16 == 15)
      for (int g = 0; g < G; ++g) _mm512_storeu_ps(scores + g * len + i - 15, reduce16(part[g]));
  }, from);
  if (const int64_t tail = seen % 16) {
    for (int g = 0; g < G; ++g) {
      for (int64_t i = tail; i < 16; ++i) part[g][i] = _mm512_setzero_ps();
      _mm512_mask_storeu_ps(scores + g * len + seen - tail, static_cast<__mmask16>((1u << tail) - 1), reduce16(part[g]));
    }
  }
  for (int g = 0; g < G; ++g) l[g] = softmax_partial(scores + g * len, seen, first[g] - from, std::min(limit[g], to) - from, m[g]);
  __m512 av[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) av[g][c] = _mm512_setzero_ps();
  for_each_row(v_cache, table, from + seen, block_size, row, head_off, D, [&](int64_t t, const T* v) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(v + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 pt = _mm512_set1_ps(scores[g * len + t - from]);
      for (int c = 0; c < C; ++c) av[g][c] = _mm512_fmadd_ps(pt, vv[c], av[g][c]);
    }
  }, from);
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + c * 16, av[g][c]);
}
#endif

// Rows [0, rows) of an item in tiles that fit the registers (4 at head_dim 64, 2 at 128); at any other
// head_dim (or without AVX-512) in tiles of 16 rows, one K/V row at a time for all of them.
template <typename T>
void attend_rows(const float* qf, const int64_t* first, const int64_t* limit, int64_t rows, const T* k_cache, const T* v_cache, const int64_t* table, int64_t from,
                 int64_t to, int64_t block_size, int64_t row, int64_t head_off, int64_t D, float* scores, float* m, float* l, float* acc) {
  const int64_t len = to - from;
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    const int64_t most = D == 64 ? 4 : 2;
    for (int64_t r = 0; r < rows; r += most) {
      const int64_t g = std::min(most, rows - r);
      const float* q = qf + r * D;
      float* s = scores + r * len;
#define KVP_RANGE(CC, GG) attend_range_avx512<CC, GG>(q, first + r, limit + r, k_cache, v_cache, table, from, to, block_size, row, head_off, s, m + r, l + r, acc + r * D)
      if (D == 64) {
        switch (g) {
          case 1: KVP_RANGE(4, 1); break;
          case 2: KVP_RANGE(4, 2); break;
          case 3: KVP_RANGE(4, 3); break;
          default: KVP_RANGE(4, 4); break;
        }
      } else if (g == 1) {
        KVP_RANGE(8, 1);
      } else {
        KVP_RANGE(8, 2);
      }
#undef KVP_RANGE
    }
    return;
  }
#endif
  // Tiles of kTileRows rows: each K/V row fetched (from L2 after the first tile) serves the tile's rows
  // while it is in L1, and their accumulators stay there too.
  constexpr int64_t kTileRows = 16;
  for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
    const int64_t r1 = std::min(rows, r0 + kTileRows);
    int64_t seen = 0;
    for (int64_t r = r0; r < r1; ++r) seen = std::max(seen, std::min(limit[r], to) - from);
    for_each_row(k_cache, table, from + seen, block_size, row, head_off, D, [&](int64_t t, const T* k) {
      for (int64_t r = r0; r < r1; ++r) scores[r * len + t - from] = dot(qf + r * D, k, D);
    }, from);
    for (int64_t r = r0; r < r1; ++r) l[r] = softmax_partial(scores + r * len, seen, first[r] - from, std::min(limit[r], to) - from, m[r]);
    std::fill(acc + r0 * D, acc + r1 * D, 0.f);
    for_each_row(v_cache, table, from + seen, block_size, row, head_off, D, [&](int64_t t, const T* v) {
      for (int64_t r = r0; r < r1; ++r) axpy(scores[r * len + t - from], v, acc + r * D, D);
    }, from);
  }
}

// A query row's output from the softmax partials of the ranges it was walked in (m, l and acc of `parts`
// ranges, `stride` rows apart from `at`): each range's sums rescaled to the largest max, then divided
// by their total. One range is written as it is (acc / l): the same bits as an unsplit walk.
template <typename QT>
void merge_ranges(const float* pm, const float* pl, const float* pacc, int64_t at, int64_t parts, int64_t stride, int64_t D, float v_scale,
                  float* o, QT* dst) {
  if (parts == 1) {
    const float inv = v_scale / pl[at];
    for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<QT>(pacc[at * D + i] * inv);
    return;
  }
  float mx = -INFINITY;
  for (int64_t c = 0; c < parts; ++c)
    if (pl[at + c * stride] != 0.f) mx = std::max(mx, pm[at + c * stride]);  // (a range the row sees none of has no max)
  std::fill(o, o + D, 0.f);
  float sum = 0.f;
  for (int64_t c = 0; c < parts; ++c) {
    const int64_t k = at + c * stride;
    if (pl[k] == 0.f) continue;  // a range the row sees none of
    const float w = exp_nonpositive(pm[k] - mx);
    sum += w * pl[k];
    for (int64_t i = 0; i < D; ++i) o[i] += w * pacc[k * D + i];
  }
  const float inv = v_scale / sum;
  for (int64_t i = 0; i < D; ++i) dst[i] = static_cast<QT>(o[i] * inv);
}

// A decode work item is one (sequence, KV head) with the query heads that share it (each K/V row
// fetched serves the whole group) over one range of kDecodeRangeKeys keys of its context (one block when
// blocks are larger); an item's ranges are merged by the thread that finishes its last. Whole contexts
// as items left threads idle with few sequences (one sequence's three KV heads on two threads: one walks
// two), and one walk streams a single context at a time, waiting on memory between blocks. Ranges follow
// the sequence's own length only, so its output does not depend on what else is in the batch.
constexpr int64_t kDecodeRangeKeys = 128;

template <typename T, typename QT>
void decode_impl(const QT* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* ctx_lens,
                 QT* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t W, float scale, float v_scale,
                 int64_t window) {
  const int64_t group = H / KVH;
  const int64_t row = KVH * D;  // elements of one token (all KV heads) in a block
  const int64_t span = std::max<int64_t>(1, kDecodeRangeKeys / block_size) * block_size;
  // the first key each sequence's query sees (a window's), the block start its walk begins at, its ranges
  std::vector<int64_t> lo(B), start(B), parts(B);
  for (int64_t b = 0; b < B; ++b) {
    lo[b] = window > 0 ? std::max<int64_t>(0, ctx_lens[b] - window) : 0;
    start[b] = lo[b] / block_size * block_size;
    parts[b] = std::max<int64_t>(1, (ctx_lens[b] - start[b] + span - 1) / span);
  }
  // Items differ in cost by context length, so they are claimed longest first: each thread takes the
  // next range when it is done with its last (a static split left one thread with the long contexts, and
  // waits whole shares when a thread is preempted; see work_queue.h).
  const int64_t items = B * KVH;
  std::vector<int64_t> order(items);
  for (int64_t i = 0; i < items; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ctx_lens[a / KVH] > ctx_lens[b / KVH]; });
  // (item, range) units in that order; an item's partials from rows[item] on, `group` rows per range
  std::vector<int64_t> rows(items + 1, 0), unit_item, unit_range;
  for (int64_t i = 0; i < items; ++i) rows[i + 1] = rows[i] + parts[i / KVH] * group;
  for (const int64_t item : order)
    for (int64_t r = 0; r < parts[item / KVH]; ++r) {
      unit_item.push_back(item);
      unit_range.push_back(r);
    }
  const int64_t units = static_cast<int64_t>(unit_item.size());
  std::unique_ptr<float[]> pm(new float[rows[items]]), pl(new float[rows[items]]), pacc(new float[rows[items] * D]);  // each written before read
  std::unique_ptr<std::atomic<int64_t>[]> left(new std::atomic<int64_t>[items]);
  for (int64_t i = 0; i < items; ++i) left[i].store(parts[i / KVH], std::memory_order_relaxed);
  kvpilot::WorkQueue work(units, 1);
  kvpilot::on_threads(units, [&] {
    std::vector<float> qf(group * D), scores(group * span), o(D);
    std::vector<int64_t> first(group), limit(group);
    for (int64_t n, end; work.claim(n, end);) {
      const int64_t item = unit_item[n], r = unit_range[n];
      const int64_t b = item / KVH, g = item % KVH, ctx = ctx_lens[b], h0 = g * group;
      const int64_t from = start[b] + r * span, to = std::min(ctx, from + span), at = rows[item] + r * group;
      if (from < to) {
        for (int64_t j = 0; j < group; ++j)
          for (int64_t i = 0; i < D; ++i) qf[j * D + i] = static_cast<float>(q[(b * H + h0 + j) * D + i]) * scale;
        std::fill(first.begin(), first.end(), lo[b]);
        std::fill(limit.begin(), limit.end(), ctx);
        attend_rows(qf.data(), first.data(), limit.data(), group, k_cache, v_cache, tables + b * W, from, to, block_size, row, g * D, D,
                    scores.data(), pm.get() + at, pl.get() + at, pacc.get() + at * D);
      } else {  // an empty context (its output is NaN, as softmax over no key is)
        std::fill(pm.get() + at, pm.get() + at + group, -INFINITY);
        std::fill(pl.get() + at, pl.get() + at + group, 0.f);
        std::fill(pacc.get() + at * D, pacc.get() + (at + group) * D, 0.f);
      }
      if (left[item].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;  // the last range's thread merges the item
      for (int64_t j = 0; j < group; ++j)
        merge_ranges(pm.get(), pl.get(), pacc.get(), rows[item] + j, parts[b], group, D, v_scale, o.data(), out + (b * H + h0 + j) * D);
    }
  });
}

template <typename T, typename QT>
void prefill_impl(const QT* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t ctx, QT* out, int64_t n, int64_t H,
                  int64_t KVH, int64_t D, int64_t block_size, float scale, float v_scale, int64_t window) {
  const int64_t group = H / KVH, rows = n * group, row = KVH * D;
  const int64_t chunk = std::max<int64_t>(1, kChunkKeys / block_size) * block_size;
  const int64_t chunks = (ctx + chunk - 1) / chunk;
  // partials per (KV head, chunk, row): row r of head g is token r / group's query head g * group + r % group
  std::vector<float> pm(KVH * chunks * rows), pl(KVH * chunks * rows), pacc(KVH * chunks * rows * D);
  std::vector<int64_t> first(rows), limit(rows);
  for (int64_t r = 0; r < rows; ++r) {
    limit[r] = ctx - n + r / group + 1;
    first[r] = window > 0 ? std::max<int64_t>(0, limit[r] - window) : 0;
  }
  const int64_t seen_from = first[0] / block_size * block_size;  // the block of the first key any row sees
  const int64_t items = KVH * chunks;
  kvpilot::WorkQueue work(items, 1);
  kvpilot::on_threads(items, [&] {
    std::vector<float> qf(rows * D), scores(rows * chunk);
    for (int64_t item, end; work.claim(item, end);) {
      const int64_t g = item / chunks, c = item % chunks, to = std::min(ctx, c * chunk + chunk), from = std::max(c * chunk, seen_from);
      if (from >= to) continue;  // a range before every row's window: its partials stay empty (l = 0)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < D; ++i) qf[r * D + i] = static_cast<float>(q[((r / group) * H + g * group + r % group) * D + i]) * scale;
      const int64_t at = (g * chunks + c) * rows;
      attend_rows(qf.data(), first.data(), limit.data(), rows, k_cache, v_cache, table, from, to, block_size, row, g * D, D, scores.data(), pm.data() + at,
                  pl.data() + at, pacc.data() + at * D);
    }
  });
  at::parallel_for(0, KVH * rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D);
    for (int64_t gr = begin; gr < end; ++gr) {
      const int64_t g = gr / rows, r = gr % rows;
      merge_ranges(pm.data(), pl.data(), pacc.data(), g * chunks * rows + r, chunks, rows, D, v_scale, o.data(),
                   out + ((r / group) * H + g * group + r % group) * D);
    }
  });
}

// The checks both entry points make of a query and a cache.
void check_attention_inputs(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim mismatch");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(), "cache");
}

// fn(T{}, QT{}) with the cache's element type and the query's, for the pairs the kernels take.
template <typename Fn>
void with_dtypes(const torch::Tensor& q, const torch::Tensor& cache, Fn fn) {
  const auto kt = cache.scalar_type(), qt = q.scalar_type();
  if (kt == torch::kFloat && qt == torch::kFloat) fn(float{}, float{});
  else if (kt == torch::kBFloat16 && qt == torch::kBFloat16) fn(at::BFloat16{}, at::BFloat16{});
  else if (kt == torch::kBFloat16 && qt == torch::kFloat) fn(at::BFloat16{}, float{});
  else if (kt == at::ScalarType::Float8_e4m3fn && qt == torch::kFloat) fn(Fp8{}, float{});
  else TORCH_CHECK(false, "unsupported dtypes: q ", qt, ", cache ", kt);
}

}  // namespace

// One sequence's n new tokens q [n, H, D] (their K/V already in the cache, at positions context_len - n ..
// context_len - 1), each attending causally to its context in the paged cache; block_table [W] int64.
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                                      int64_t context_len, double scale, double k_scale, double v_scale, int64_t window) {
  check_attention_inputs(q, k_cache, v_cache);
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && block_table.dim() == 1, "int64 block table");
  TORCH_CHECK(context_len >= q.size(0) && block_table.size(0) * k_cache.size(1) >= context_len, "context longer than its block table");
  q = q.contiguous();
  block_table = block_table.contiguous();
  auto out = torch::empty_like(q);
  if (q.size(0) == 0) return out;
  const float s = static_cast<float>(scale) * static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  with_dtypes(q, k_cache, [&](auto t, auto qt) {
    using T = decltype(t);
    using QT = decltype(qt);
    prefill_impl<T, QT>(q.data_ptr<QT>(), static_cast<const T*>(k_cache.data_ptr()), static_cast<const T*>(v_cache.data_ptr()),
                        block_table.data_ptr<int64_t>(), context_len, out.data_ptr<QT>(), q.size(0), q.size(1), k_cache.size(2), q.size(2),
                        k_cache.size(1), s, vs, window);
  });
  return out;
}

// k_scale / v_scale: an FP8 cache's per-layer scales (1 for other caches).
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale, double k_scale, double v_scale,
                                     int64_t window) {
  check_attention_inputs(q, k_cache, v_cache);
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(context_lens.size(0) == q.size(0) && block_tables.size(0) == q.size(0), "batch mismatch");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const float s = static_cast<float>(scale) * static_cast<float>(k_scale), vs = static_cast<float>(v_scale);
  with_dtypes(q, k_cache, [&](auto t, auto qt) {
    using T = decltype(t);
    using QT = decltype(qt);
    decode_impl<T, QT>(q.data_ptr<QT>(), static_cast<const T*>(k_cache.data_ptr()), static_cast<const T*>(v_cache.data_ptr()),
                       block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(), out.data_ptr<QT>(), q.size(0), q.size(1),
                       k_cache.size(2), q.size(2), k_cache.size(1), block_tables.size(1), s, vs, window);
  });
  return out;
}

// kernels/csrc/layers_cpu.cpp
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads,
                    int64_t head_dim);
void rotary_store_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                     double k_scale, double v_scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
// kernels/csrc/gguf_linear_cpu.cpp
std::string gguf_linear_isa();
int64_t gguf_amx_min_rows();
torch::Tensor gguf_linear_panel(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m, int64_t kind, int64_t n,
                                c10::optional<torch::Tensor> bias, int64_t epilogue, c10::optional<torch::Tensor> other, std::string isa,
                                c10::optional<torch::Tensor> perm);
// kernels/csrc/bf16_linear_cpu.cpp
bool bf16_linear_supported();
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, int64_t n, c10::optional<torch::Tensor> bias, int64_t epilogue,
                          c10::optional<torch::Tensor> other, const std::string& isa);
std::string bf16_linear_isa();
// kernels/csrc/moe_cpu.cpp
torch::Tensor fused_experts_dense(torch::Tensor x, torch::Tensor w13, torch::Tensor w2, torch::Tensor weights, torch::Tensor ids, bool gelu);
torch::Tensor fused_experts_panel(torch::Tensor x, torch::Tensor weights, torch::Tensor ids, torch::Tensor gate_qs, torch::Tensor gate_d,
                                  c10::optional<torch::Tensor> gate_m, int64_t gate_kind, torch::Tensor up_qs, torch::Tensor up_d,
                                  c10::optional<torch::Tensor> up_m, int64_t up_kind, torch::Tensor down_qs, torch::Tensor down_d,
                                  c10::optional<torch::Tensor> down_m, int64_t down_kind, int64_t inner, bool gelu, std::string isa);

// The kernels touch no Python object: they run without the GIL, so the server's asyncio thread (HTTP,
// streaming) can run while the engine thread is inside one instead of waiting for the interpreter's
// 5 ms switch interval to force a turn.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto no_gil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)", py::arg("q"), py::arg("k_cache"),
        py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0,
        py::arg("window") = 0, no_gil);
  m.def("paged_prefill_attention", &paged_prefill_attention, "a sequence's new tokens attending causally over its paged KV cache (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("context_len"), py::arg("scale"),
        py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0, py::arg("window") = 0, no_gil);
#if defined(__AVX512F__)
  m.attr("prefill_attention_head_dims") = std::vector<int64_t>{64, 128};  // register-tiled: faster than copy + SDPA
#else
  m.attr("prefill_attention_head_dims") = std::vector<int64_t>{};  // row by row: slower than copy + SDPA past a few tokens
#endif
  m.def("rotary_inplace", &rotary_inplace, "RoPE in place on the query and key heads of a fused QKV output (CPU)", no_gil);
  m.def("rotary_store_kv", &rotary_store_kv, "RoPE in place on a fused QKV output, then its K and V rows into the paged cache (CPU)",
        py::arg("qkv"), py::arg("positions"), py::arg("cos"), py::arg("sin"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("k_scale") = 1.0, py::arg("v_scale") = 1.0, no_gil);
  m.def("rms_norm", &rms_norm, "RMSNorm of float32 or bfloat16 rows (CPU)", no_gil);
  m.def("gguf_linear_panel", &gguf_linear_panel, "x @ W.T with W in GGUF blocks laid out in panels of 16 output rows (CPU)",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("kind"), py::arg("n"), py::arg("bias"), py::arg("epilogue"),
        py::arg("other"), py::arg("isa") = "auto", py::arg("perm") = py::none(), no_gil);
  m.attr("gguf_amx_min_rows") = gguf_amx_min_rows();  // from this many activation rows on, the amx isa uses its tiles
  m.def("fused_experts_dense", &fused_experts_dense, "a mixture of experts' routed experts over a step's tokens, grouped by expert (CPU)",
        py::arg("x"), py::arg("w13"), py::arg("w2"), py::arg("weights"), py::arg("ids"), py::arg("gelu"), no_gil);
  m.def("fused_experts_panel", &fused_experts_panel, "fused_experts_dense with each expert's projections in GGUF-block panels (CPU)", no_gil);
  m.def("bf16_linear", &bf16_linear, "x @ W.T for bfloat16 rows with W in panels of 32 output columns (CPU, AVX512-BF16; AMX tiles)",
        py::arg("x"), py::arg("w"), py::arg("n"), py::arg("bias"), py::arg("epilogue"), py::arg("other"), py::arg("isa") = "auto", no_gil);
  m.def("bf16_linear_isa", &bf16_linear_isa, "the best path bf16_linear has here (amx, avx512-bf16 or none)");
  m.def("bf16_linear_supported", &bf16_linear_supported, "whether this CPU has the AVX512-BF16 bf16_linear needs");
  m.def("gguf_linear_isa", &gguf_linear_isa, "the instruction set gguf_linear_panel uses here (amx, avx512-vnni, avx512, avx2 or scalar)");
}
