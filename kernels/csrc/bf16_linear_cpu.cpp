// y = x @ W.T for bfloat16 rows and weights on CPUs with AVX512-BF16, for the few rows of a decode step.
//
// oneDNN's packed bfloat16 matmul reaches the dot-product unit's limit from ~64 rows up, but a decode
// step has at most max_num_seqs rows, and at 16 it runs at 100–130 GFLOP/s of the ~165 it reaches there
// (bench/bf16_linear.py; the decode-only steps were a third of a 16-client bf16 run's time). Here a
// weight is laid out once in panels of 32 output columns, each panel's K in bfloat16 pairs
// ([P, K/2, 32, 2]: one 64-byte vector per pair of K and 16 columns), so that a step of 2 columns × R
// rows is R broadcasts of an activation pair and 2R VDPBF16PS into float32 accumulators that stay in
// registers over all of K. The products are exact in float32 (8-bit significands) and summed in float32,
// as oneDNN's are — only the order of the sum differs. The epilogue (bias, SiLU, × other, + other) is
// applied to the float32 sums, rounded to bfloat16 once, as oneDNN's fused post-ops do.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec_math.h"
#include "work_queue.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace {

constexpr int64_t kCols = 32;    // output columns of a panel: two vectors of 16 float32 accumulators
constexpr int64_t kRowTile = 8;  // activation rows per pass over a panel: 16 accumulators, + 2 weight vectors
// A decode step's weights come from memory, not the caches: without prefetching, each pass waited for its
// panel's lines and then computed (a 16-row step's time was the sum of the two). A thread's panels are
// consecutive in memory, so the lines this far ahead of the pair in use are requested as it goes.
constexpr int64_t kAheadBytes = 2048;  // 16 pairs of K ahead (1 KiB: slower; 4 KiB: no faster)

enum Epilogue : int64_t { NONE = 0, SILU = 1, MUL = 2, ADD = 3 };

struct Args {
  const uint16_t* x;  // [M, K] bfloat16 bits, row stride x_stride
  int64_t x_stride;
  const uint16_t* w;  // [P, K/2, 32, 2]
  int64_t K, n;
  const float* bias;  // [n] or null
  int64_t epilogue;
  const uint16_t* other;  // [M, n] bfloat16, row stride other_stride (MUL / ADD)
  int64_t other_stride;
  uint16_t* y;  // [M, n], row stride y_stride
  int64_t y_stride;
};

__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 widen_bf16(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

// 16 accumulated columns of one row: bias, the epilogue, rounded to bfloat16 (to nearest even) and stored.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) inline void store16(const Args& a, int64_t row, int64_t col, __m512 v) {
  const int64_t left = a.n - col;
  if (left <= 0) return;
  const __mmask16 mask = left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1);
  if (a.bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, a.bias + col));
  switch (a.epilogue) {
    case SILU: v = silu16(v); break;
    case MUL: v = _mm512_mul_ps(v, widen_bf16(a.other + row * a.other_stride + col, mask)); break;
    case ADD: v = _mm512_add_ps(v, widen_bf16(a.other + row * a.other_stride + col, mask)); break;
    default: break;
  }
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  _mm256_mask_storeu_epi16(a.y + row * a.y_stride + col, mask, h);
}

// Rows [row0, row0 + R) of panel p over all of K.
template <int R>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void panel_rows(const Args& a, int64_t p, int64_t row0) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const uint16_t* w = a.w + p * a.K * kCols;
  const uint16_t* x = a.x + row0 * a.x_stride;
  for (int64_t k = 0; k < a.K; k += 2, w += 2 * kCols) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + kAheadBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w) + kAheadBytes + 64, _MM_HINT_T0);
    const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
    const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + 32));
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * a.x_stride + k, sizeof pair);
      const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  }
  for (int r = 0; r < R; ++r) {
    store16(a, row0 + r, p * kCols, acc[r][0]);
    store16(a, row0 + r, p * kCols + 16, acc[r][1]);
  }
}

void panel(const Args& a, int64_t p, int64_t row0, int64_t rows) {
  switch (rows) {
    case 1: return panel_rows<1>(a, p, row0);
    case 2: return panel_rows<2>(a, p, row0);
    case 3: return panel_rows<3>(a, p, row0);
    case 4: return panel_rows<4>(a, p, row0);
    case 5: return panel_rows<5>(a, p, row0);
    case 6: return panel_rows<6>(a, p, row0);
    case 7: return panel_rows<7>(a, p, row0);
    default: return panel_rows<8>(a, p, row0);
  }
}

}  // namespace

bool bf16_linear_supported() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

// x [M, K] bfloat16 (rows contiguous) times W laid out as [P, K/2, 32, 2] bfloat16 (bf16_panels in
// kernels/linear.py) -> [M, n] bfloat16; bias float32 [n]; epilogue 0 none, 1 silu, 2 × other, 3 + other
// (other: bfloat16 [M, n]).
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, int64_t n, c10::optional<torch::Tensor> bias, int64_t epilogue,
                          c10::optional<torch::Tensor> other) {
  TORCH_CHECK(bf16_linear_supported(), "bf16_linear needs AVX512-BF16 (with BW and VL)");
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu() && (!bias || bias->device().is_cpu()) && (!other || other->device().is_cpu()),
              "bf16_linear: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "x: bfloat16 rows [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(w.dim() == 4 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous() && w.size(1) * 2 == K && w.size(2) == kCols && w.size(3) == 2,
              "w: bfloat16 [P, K/2, 32, 2] panels");
  const int64_t P = w.size(0);
  TORCH_CHECK(n > (P - 1) * kCols && n <= P * kCols, "n must be within the last panel");
  if (bias) TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat && bias->numel() == n, "bias: float32 [n]");
  const bool binary = epilogue == MUL || epilogue == ADD;
  if (binary) {
    TORCH_CHECK(other && other->scalar_type() == torch::kBFloat16 && other->dim() == 2 && other->size(0) == M && other->size(1) == n &&
                other->stride(1) == 1, "other: bfloat16 [M, n]");
  } else {
    TORCH_CHECK(epilogue == NONE || epilogue == SILU, "epilogue: 0 none, 1 silu, 2 mul, 3 add");
  }
  auto y = torch::empty({M, n}, x.options());
  if (M == 0) return y;
  const Args a{reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), reinterpret_cast<const uint16_t*>(w.data_ptr()), K, n,
               bias ? bias->data_ptr<float>() : nullptr, epilogue, binary ? reinterpret_cast<const uint16_t*>(other->data_ptr()) : nullptr,
               binary ? other->stride(0) : 0, reinterpret_cast<uint16_t*>(y.data_ptr()), y.stride(0)};
  kvpilot::WorkQueue work(P, kvpilot::chunk_for(P));
  kvpilot::on_threads(P, [&] {
    for (int64_t p0, p1; work.claim(p0, p1);)
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t r0 = 0; r0 < M; r0 += kRowTile) panel(a, p, r0, std::min(kRowTile, M - r0));
  });
  return y;
}
