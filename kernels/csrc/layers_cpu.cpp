// Per-layer elementwise work on CPU, float32 or bfloat16: RoPE on the fused QKV projection output (optionally
// storing the step's K and V into the paged cache in the same pass) and RMSNorm. Each replaces a chain
// of small torch ops (8 for RoPE, 2 index_copy_ for the cache write, ~7 for RMSNorm) that a decode
// step runs 30 times per layer kind.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

void check_rope_args(const torch::Tensor& qkv, const torch::Tensor& positions, const torch::Tensor& cos,
                     const torch::Tensor& sin, int64_t heads, int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && (qkv.scalar_type() == torch::kFloat || qkv.scalar_type() == torch::kBFloat16),
              "qkv: float32 or bfloat16 rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == torch::kFloat, "cos/sin");
  TORCH_CHECK(cos.size(1) * 2 == head_dim && qkv.size(1) >= heads * head_dim, "shapes");
  TORCH_CHECK(qkv.scalar_type() != torch::kBFloat16 || head_dim <= 512, "bfloat16 rows: head_dim <= 512");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.size(0) == qkv.size(0), "positions");
}

// Rotate heads [0, heads) of row t (half-split pairs (i, i + D/2)).
inline void rotate_row(float* x, int64_t heads, int64_t head_dim, const float* ct, const float* st) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* x1 = x + h * head_dim;
    float* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * ct[i] - b * st[i];
      x2[i] = b * ct[i] + a * st[i];
    }
  }
}

// x rounded to bfloat16 (to nearest even), as a float: what torch's bfloat16 ops do to each result.
inline float bf16_round(float x) { return static_cast<float>(c10::BFloat16(x)); }

// bfloat16 rows as the torch formula computes them in bfloat16 (kernels/rope.py apply_rope, with cos and sin
// cast to bfloat16): each product and each sum rounded to bfloat16 — exactly its result, in one pass
// where the reference runs ~8 ops over the whole QKV output (3.5 % of a bfloat16 step at 16 sequences, #65).
inline void rotate_row(c10::BFloat16* x, int64_t heads, int64_t head_dim, const float* ct, const float* st) {
  const int64_t half = head_dim / 2;
  float c[256], s[256];  // head_dim <= 512 (check_rope_args)
  for (int64_t i = 0; i < half; ++i) {
    c[i] = bf16_round(ct[i]);
    s[i] = bf16_round(st[i]);
  }
  for (int64_t h = 0; h < heads; ++h) {
    c10::BFloat16* x1 = x + h * head_dim;
    c10::BFloat16* x2 = x1 + half;
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = c10::BFloat16(bf16_round(a * c[i]) - bf16_round(b * s[i]));
      x2[i] = c10::BFloat16(bf16_round(b * c[i]) + bf16_round(a * s[i]));
    }
  }
}

template <typename T, typename Fn>
void rope_rows(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t heads,
               int64_t head_dim, Fn after_row) {
  positions = positions.contiguous();
  T* base = qkv.data_ptr<T>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* c = cos.data_ptr<float>();
  const float* sn = sin.data_ptr<float>();
  const int64_t half = head_dim / 2, stride = qkv.stride(0), max_pos = cos.size(0);
  for (int64_t t = 0; t < qkv.size(0); ++t) TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "position out of range");
  at::parallel_for(0, qkv.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      rotate_row(base + t * stride, heads, head_dim, c + pos[t] * half, sn + pos[t] * half);
      after_row(t, base + t * stride);
    }
  });
}

}  // namespace

// RoPE applied in place to the first `rot_heads` heads of each row of qkv [T, >= rot_heads * D]: the
// query heads and the key heads, which come first.
void rotary_inplace(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t rot_heads,
                    int64_t head_dim) {
  check_rope_args(qkv, positions, cos, sin, rot_heads, head_dim);
  if (qkv.scalar_type() == torch::kBFloat16)
    rope_rows<c10::BFloat16>(qkv, positions, cos, sin, rot_heads, head_dim, [](int64_t, c10::BFloat16*) {});
  else
    rope_rows<float>(qkv, positions, cos, sin, rot_heads, head_dim, [](int64_t, float*) {});
}

// The same for qkv = [q heads | k heads | v heads] rows, then each row's (rotated) K and its V stored
// at its cache slot: k/v cache [num_blocks, block_size, kv_heads, D] float32, bfloat16 or
// float8_e4m3fn (K / k_scale and V / v_scale saturated at ±448; both narrow types rounded to nearest
// even, as torch's conversion), slots [T] int64. bfloat16 rows: a bfloat16 cache only (copied as they are).
void rotary_store_kv(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos, torch::Tensor sin, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                     double k_scale, double v_scale) {
  check_rope_args(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "qkv width");
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK((ct == torch::kFloat || ct == torch::kBFloat16 || ct == at::ScalarType::Float8_e4m3fn) && v_cache.scalar_type() == ct &&
              k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "cache: contiguous float32, bfloat16 or float8_e4m3fn");
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && k_cache.size(3) == head_dim, "cache shape");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.size(0) == qkv.size(0), "slots");
  slots = slots.contiguous();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1), kv = num_kv_heads * head_dim, q = num_heads * head_dim;
  for (int64_t t = 0; t < qkv.size(0); ++t) TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot out of range");
  if (qkv.scalar_type() == torch::kBFloat16) {
    TORCH_CHECK(ct == torch::kBFloat16, "bfloat16 rows: a bfloat16 cache");
    c10::BFloat16* kc = k_cache.data_ptr<c10::BFloat16>();
    c10::BFloat16* vc = v_cache.data_ptr<c10::BFloat16>();
    rope_rows<c10::BFloat16>(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim, [&](int64_t t, c10::BFloat16* row) {
      std::memcpy(kc + slot[t] * kv, row + q, kv * sizeof(c10::BFloat16));
      std::memcpy(vc + slot[t] * kv, row + q + kv, kv * sizeof(c10::BFloat16));
    });
    return;
  }
  if (ct == torch::kFloat) {
    float* kc = k_cache.data_ptr<float>();
    float* vc = v_cache.data_ptr<float>();
    rope_rows<float>(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim, [&](int64_t t, float* row) {
      std::memcpy(kc + slot[t] * kv, row + q, kv * sizeof(float));
      std::memcpy(vc + slot[t] * kv, row + q + kv, kv * sizeof(float));
    });
    return;
  }
  if (ct == at::ScalarType::Float8_e4m3fn) {
    c10::Float8_e4m3fn* kc = k_cache.data_ptr<c10::Float8_e4m3fn>();
    c10::Float8_e4m3fn* vc = v_cache.data_ptr<c10::Float8_e4m3fn>();
    const float ks = static_cast<float>(k_scale), vs = static_cast<float>(v_scale), most = 448.f;
    rope_rows<float>(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim, [&](int64_t t, float* row) {
      for (int64_t i = 0; i < kv; ++i) {
        kc[slot[t] * kv + i] = c10::Float8_e4m3fn(std::clamp(row[q + i] / ks, -most, most));
        vc[slot[t] * kv + i] = c10::Float8_e4m3fn(std::clamp(row[q + kv + i] / vs, -most, most));
      }
    });
    return;
  }
  c10::BFloat16* kc = k_cache.data_ptr<c10::BFloat16>();
  c10::BFloat16* vc = v_cache.data_ptr<c10::BFloat16>();
  rope_rows<float>(qkv, positions, cos, sin, num_heads + num_kv_heads, head_dim, [&](int64_t t, float* row) {
    for (int64_t i = 0; i < kv; ++i) {
      kc[slot[t] * kv + i] = c10::BFloat16(row[q + i]);
      vc[slot[t] * kv + i] = c10::BFloat16(row[q + kv + i]);
    }
  });
}

// weight * (x / sqrt(mean(x^2) + eps)) over the last dim of float32 or bfloat16 rows, the order of
// operations of the transformers formula: computed in float32; for bfloat16 rows (and weight) the
// normalized row is rounded to bfloat16 before the weight multiplies it, as transformers' `weight *
// hidden.to(dtype)` does — the torch reference's ~8 small ops per call were a tenth of a bfloat16 decode
// step at 16 sequences (#65). The sum of squares goes into 16 independent partial sums so it vectorizes.
// A weight in the rows' dtype multiplies the normalised row rounded to that dtype (transformers' Llama RMSNorm); a
// float32 weight beside bfloat16 rows multiplies before the one rounding (its Gemma RMSNorm: 1 + w in float32).
template <typename T, typename W>
void rms_norm_rows(const T* src, const W* w, T* dst, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = src + r * n;
      float part[16] = {};
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int64_t j = 0; j < 16; ++j) part[j] += static_cast<float>(xr[i + j]) * static_cast<float>(xr[i + j]);
      float ss = 0.f;
      for (; i < n; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      for (int64_t j = 0; j < 16; ++j) ss += part[j];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* yr = dst + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const float normed = static_cast<float>(xr[i]) * inv;
        yr[i] = static_cast<T>(static_cast<float>(w[i]) * (std::is_same_v<W, T> ? static_cast<float>(static_cast<T>(normed)) : normed));
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && (weight.scalar_type() == dtype || weight.scalar_type() == torch::kFloat),
              "float32 or bfloat16 rows, the weight in their dtype or float32");
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight must match the last dim");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = torch::empty_like(x);
  const int64_t n = weight.size(0), rows = x.numel() / n;
  if (dtype == torch::kFloat)
    rms_norm_rows(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows, n, static_cast<float>(eps));
  else if (weight.scalar_type() == torch::kFloat)
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), rows, n, static_cast<float>(eps));
  else
    rms_norm_rows(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), rows, n, static_cast<float>(eps));
  return out;
}
