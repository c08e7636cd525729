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
//
// On a CPU with AMX (Sapphire Rapids and later) a prefill's rows go to the tile unit instead: TDPBF16PS
// multiplies 16 rows x 32 of K of activations by 32 of K x 16 columns of weights into 16 x 16 float32
// sums, the same exact products summed in float32 (another order again). A panel's 16 pairs of K are two
// weight tiles as they lie in memory (16 columns' pairs each, rows 128 bytes apart): nothing is made
// per call, so the tiles pay from one tile of 16 rows on (a 16-row decode step with the weights from memory:
// 2.2x the AVX512-BF16 path; bench/bf16_linear.py); the rows past the last whole tile run on AVX512-BF16.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx.h"
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

constexpr int64_t kAmxK = 32;  // K per activation tile (32 bfloat16s a row) and per pair of weight tiles (16 pairs)

// Rows [row0, row0 + 16 * RT) of panel p over all of K on the tile unit, the sums stored to c [16 * RT][32].
// Tiles: 0, 1 the activations of the two row tiles; 2, 3 the panel's columns 0-15 and 16-31; 4, 5 and 6, 7 the C
// of each row tile and column tile.
template <int RT>
__attribute__((target("amx-tile,amx-bf16"))) void panel_amx(const Args& a, int64_t p, int64_t row0, float* c) {
  const uint16_t* w = a.w + p * a.K * kCols;
  const uint16_t* x = a.x + row0 * a.x_stride;
  const int64_t x_bytes = a.x_stride * 2, w_bytes = kCols * 2 * 2;
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (RT == 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t k = 0; k < a.K; k += kAmxK) {
    const uint16_t* wk = w + k * kCols;  // pair k / 2 of the panel
    _tile_loadd(2, wk, w_bytes);
    _tile_loadd(3, wk + 32, w_bytes);
    _tile_loadd(0, x + k, x_bytes);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if constexpr (RT == 2) {
      _tile_loadd(1, x + kvpilot::AMX_TILE_ROWS * a.x_stride + k, x_bytes);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  const int64_t c_bytes = kCols * 4;
  _tile_stored(4, c, c_bytes);
  _tile_stored(5, c + 16, c_bytes);
  if constexpr (RT == 2) {
    _tile_stored(6, c + kvpilot::AMX_TILE_ROWS * kCols, c_bytes);
    _tile_stored(7, c + kvpilot::AMX_TILE_ROWS * kCols + 16, c_bytes);
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void amx_store(const Args& a, int64_t p, int64_t row0, int64_t rows, const float* c) {
  for (int64_t r = 0; r < rows; ++r) {
    store16(a, row0 + r, p * kCols, _mm512_load_ps(c + r * kCols));
    store16(a, row0 + r, p * kCols + 16, _mm512_load_ps(c + r * kCols + 16));
  }
}

bool amx_fits(int64_t K) { return K % kAmxK == 0 && __builtin_cpu_supports("avx512bf16") && kvpilot::amx_usable(); }

}  // namespace

bool bf16_linear_supported() {
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
}

std::string bf16_linear_isa() { return !bf16_linear_supported() ? "none" : amx_fits(kAmxK) ? "amx" : "avx512-bf16"; }

// x [M, K] bfloat16 (rows contiguous) times W laid out as [P, K/2, 32, 2] bfloat16 (bf16_panels in
// kernels/linear.py) -> [M, n] bfloat16; bias float32 [n]; epilogue 0 none, 1 silu, 2 × other, 3 + other
// (other: bfloat16 [M, n]). isa: "auto" (AMX tiles where the CPU has them and K is whole tiles of 32), "amx"
// (the tiles, refused where they cannot run) or "avx512-bf16".
torch::Tensor bf16_linear(torch::Tensor x, torch::Tensor w, int64_t n, c10::optional<torch::Tensor> bias, int64_t epilogue,
                          c10::optional<torch::Tensor> other, const std::string& isa) {
  TORCH_CHECK(bf16_linear_supported(), "bf16_linear needs AVX512-BF16 (with BW and VL)");
  TORCH_CHECK(isa == "auto" || isa == "amx" || isa == "avx512-bf16", "isa must be auto, amx or avx512-bf16, got ", isa);
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
  TORCH_CHECK(isa != "amx" || amx_fits(K), "isa amx: this CPU (or its kernel) gives no AMX-BF16 tiles, or K is not a multiple of ", kAmxK);
  if (M == 0) return y;
  const Args a{reinterpret_cast<const uint16_t*>(x.data_ptr()), x.stride(0), reinterpret_cast<const uint16_t*>(w.data_ptr()), K, n,
               bias ? bias->data_ptr<float>() : nullptr, epilogue, binary ? reinterpret_cast<const uint16_t*>(other->data_ptr()) : nullptr,
               binary ? other->stride(0) : 0, reinterpret_cast<uint16_t*>(y.data_ptr()), y.stride(0)};
  const bool tiles = isa == "amx" || (isa == "auto" && amx_fits(K));
  const int64_t tiled = tiles ? M / kvpilot::AMX_TILE_ROWS * kvpilot::AMX_TILE_ROWS : 0;  // the rest on AVX512-BF16
  kvpilot::WorkQueue work(P, kvpilot::chunk_for(P));
  kvpilot::on_threads(P, [&] {
    if (tiled) kvpilot::amx_configure();  // tile state is per thread
    // Each block's sums are read back one block later: vector loads right after the tile store that wrote
    // their lines wait for it (as in the GGUF kernel's AMX path).
    alignas(64) float c[2][2 * kvpilot::AMX_TILE_ROWS * kCols];
    int64_t held_p = -1, held_row = 0, held_rows = 0, i = 0;
    auto tile_rows = [&](int64_t p, int64_t r0, int64_t rows) {
      float* mine = c[i++ % 2];
      rows == kvpilot::AMX_TILE_ROWS ? panel_amx<1>(a, p, r0, mine) : panel_amx<2>(a, p, r0, mine);
      if (held_p >= 0) amx_store(a, held_p, held_row, held_rows, c[i % 2]);
      held_p = p, held_row = r0, held_rows = rows;
    };
    for (int64_t p0, p1; work.claim(p0, p1);)
      for (int64_t p = p0; p < p1; ++p) {
        int64_t r0 = 0;
        for (; r0 + 2 * kvpilot::AMX_TILE_ROWS <= tiled; r0 += 2 * kvpilot::AMX_TILE_ROWS) tile_rows(p, r0, 2 * kvpilot::AMX_TILE_ROWS);
        if (r0 < tiled) tile_rows(p, r0, kvpilot::AMX_TILE_ROWS), r0 += kvpilot::AMX_TILE_ROWS;
        for (; r0 < M; r0 += kRowTile) panel(a, p, r0, std::min(kRowTile, M - r0));
      }
    if (held_p >= 0) amx_store(a, held_p, held_row, held_rows, c[(i - 1) % 2]);
    if (tiled) kvpilot::amx_release();
  });
  return y;
}
