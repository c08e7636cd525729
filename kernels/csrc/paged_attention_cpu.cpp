// Decode attention on CPU reading the paged KV cache in place.
//
// The torch reference gathers every sequence's blocks into a padded tensor and hands it to SDPA: the
// cache is read, written and read again. Here each work item walks its sequence's block table
// directly, so K and V are each read once, and every K/V row fetched serves all the query heads that
// share it (GQA).
//
// Layouts (float32 or bfloat16 cache, float32 math):
//   q            [B, H, D]          out [B, H, D] (same dtype as q)
//   k/v cache    [num_blocks, block_size, KVH, D]
//   block_tables [B, W] int64, context_lens [B] int64 (tokens in cache, including this step's)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;  // one AVX-512 register of floats; independent partial sums vectorize
                                // without -ffast-math (which would also assume no inf/NaN anywhere)

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

inline void softmax_inplace(float* s, int64_t n) {
  float part[kLanes];
  std::fill(part, part + kLanes, -INFINITY);
  int64_t t = 0;
  for (; t + kLanes <= n; t += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] = std::max(part[j], s[t + j]);
  float m = *std::max_element(part, part + kLanes);
  for (; t < n; ++t) m = std::max(m, s[t]);
  for (t = 0; t < n; ++t) s[t] = exp_nonpositive(s[t] - m);
  std::fill(part, part + kLanes, 0.f);
  for (t = 0; t + kLanes <= n; t += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) part[j] += s[t + j];
  float sum = 0.f;
  for (; t < n; ++t) sum += s[t];
  for (int64_t j = 0; j < kLanes; ++j) sum += part[j];
  const float inv = 1.f / sum;
  for (t = 0; t < n; ++t) s[t] *= inv;
}

template <typename T>
inline void axpy(float a, const T* v, float* acc, int64_t d) {
  for (int64_t i = 0; i < d; ++i) acc[i] += a * static_cast<float>(v[i]);
}

// Token t's row (all KV heads) in a sequence's paged cache. At a block's first token the next block
// is prefetched, so it streams in while this one is used.
template <typename T>
inline const T* token_row(const T* cache, const int64_t* table, int64_t t, int64_t ctx, int64_t block_size, int64_t row) {
  const int64_t off = t % block_size;
  if (off == 0 && t + block_size < ctx) {
    const char* next = reinterpret_cast<const char*>(cache + table[t / block_size + 1] * block_size * row);
    const int64_t bytes = block_size * row * static_cast<int64_t>(sizeof(T));
    for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(next + c);
  }
  return cache + (table[t / block_size] * block_size + off) * row;
}

template <typename T, typename QT>
void decode_impl(const QT* q, const T* k_cache, const T* v_cache, const int64_t* tables, const int64_t* ctx_lens,
                 QT* out, int64_t B, int64_t H, int64_t KVH, int64_t D, int64_t block_size, int64_t W, float scale) {
  const int64_t group = H / KVH;
  const int64_t row = KVH * D;  // elements of one token (all KV heads) in a block
  // A work item is one sequence with all its KV heads, so every cache block is read front to back as
  // one contiguous stream (the prefetcher's best case); with fewer sequences than threads x 2 the
  // KV heads are split across items instead, so a single stream still uses every core.
  const int64_t splits = B >= 2 * at::get_num_threads() ? 1 : KVH;
  const int64_t heads_per_item = KVH / splits;
  at::parallel_for(0, B * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(H * D), acc(H * D), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / splits, kv0 = (item % splits) * heads_per_item, kv1 = kv0 + heads_per_item;
      const int64_t ctx = ctx_lens[b], h0 = kv0 * group, nh = (kv1 - kv0) * group;
      const int64_t* table = tables + b * W;
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t i = 0; i < D; ++i) qf[h * D + i] = static_cast<float>(q[(b * H + h0 + h) * D + i]) * scale;
      scores.resize(nh * ctx);  // every entry is written below
      for (int64_t t = 0; t < ctx; ++t) {
        const T* krow = token_row(k_cache, table, t, ctx, block_size, row);
        for (int64_t h = 0; h < nh; ++h) scores[h * ctx + t] = dot(qf.data() + h * D, krow + (kv0 + h / group) * D, D);
      }
      for (int64_t h = 0; h < nh; ++h) softmax_inplace(scores.data() + h * ctx, ctx);
      std::fill(acc.begin(), acc.begin() + nh * D, 0.f);
      for (int64_t t = 0; t < ctx; ++t) {
        const T* vrow = token_row(v_cache, table, t, ctx, block_size, row);
        for (int64_t h = 0; h < nh; ++h) axpy(scores[h * ctx + t], vrow + (kv0 + h / group) * D, acc.data() + h * D, D);
      }
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t i = 0; i < D; ++i) out[(b * H + h0 + h) * D + i] = static_cast<QT>(acc[h * D + i]);
    }
  });
}

}  // namespace

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(q.size(2) == k_cache.size(3), "head_dim mismatch");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && k_cache.is_contiguous() && v_cache.is_contiguous(), "cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong, "int64 tables");
  TORCH_CHECK(context_lens.size(0) == q.size(0) && block_tables.size(0) == q.size(0), "batch mismatch");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2), BS = k_cache.size(1);
  const int64_t W = block_tables.size(1);
  const float s = static_cast<float>(scale);
#define KVP_DISPATCH(T, QT)                                                                                   \
  decode_impl<T, QT>(q.data_ptr<QT>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), block_tables.data_ptr<int64_t>(), \
                     context_lens.data_ptr<int64_t>(), out.data_ptr<QT>(), B, H, KVH, D, BS, W, s)
  const auto kt = k_cache.scalar_type(), qt = q.scalar_type();
  if (kt == torch::kFloat && qt == torch::kFloat) KVP_DISPATCH(float, float);
  else if (kt == torch::kBFloat16 && qt == torch::kBFloat16) KVP_DISPATCH(at::BFloat16, at::BFloat16);
  else if (kt == torch::kBFloat16 && qt == torch::kFloat) KVP_DISPATCH(at::BFloat16, float);
  else TORCH_CHECK(false, "unsupported dtypes: q ", qt, ", cache ", kt);
#undef KVP_DISPATCH
  return out;
}

// RoPE (half-split pairs (i, i + D/2)) applied in place to the first `rot_heads` heads of each row of
// the fused QKV projection output qkv [T, >= rot_heads * D]: the query heads and the key heads, which
// come first. One pass instead of the ~8 elementwise ops per tensor of the torch formulation.
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin,
                    int64_t rot_heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.scalar_type() == torch::kFloat, "qkv: float32 rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat, "cos/sin");
  TORCH_CHECK(cos.size(1) * 2 == head_dim && qkv.size(1) >= rot_heads * head_dim, "shapes");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.size(0) == qkv.size(0), "positions");
  positions = positions.contiguous();
  float* base = qkv.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t half = head_dim / 2, stride = qkv.stride(0), max_pos = cos.size(0);
  for (int64_t t = 0; t < qkv.size(0); ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* ct = c + pos[t] * half;
      const float* st = sn + pos[t] * half;
      for (int64_t h = 0; h < rot_heads; ++h) {
        float* x1 = base + t * stride + h * head_dim;
        float* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * ct[i] - b * st[i];
          x2[i] = b * ct[i] + a * st[i];
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over a paged KV cache (CPU)");
  m.def("rotary_inplace", &rotary_inplace, "RoPE in place on the query and key heads of a fused QKV output (CPU)");
}
