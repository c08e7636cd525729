// y = x @ W.T for W in GGUF's own block formats, dequantized in registers (CPU, float32 activations).
//
// W arrives re-laid out at load (kvpilot/kernels/quantized.py) in panels of 16 output rows (see the
// panels section below), with the file's block scales (and Q4_1's mins) as float16 beside the quants.
// Per block w = d * q + m, with Q4_0's m = -8 d and Q8_0's m = 0; exactly the weights the GGUF
// reference dequantizes, summed in a different order.
//
// A decode step is memory-bound: reading 0.56 (Q4) or 1.06 (Q8) bytes per weight instead of 4 is the
// point. Each block of 16 output rows is dequantized once per tile of activation rows and FMA'd into
// one accumulator per activation row. Instruction sets chosen at run time (the build is not -march
// specific for these functions): AMX tiles, AVX-512 (16 lanes; with VNNI 16-bit integer products),
// AVX2 + FMA (8 lanes), scalar.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include "amx.h"
#include "vec_math.h"
#include "work_queue.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>

namespace {

// The K-quants, re-laid out at load (panels only; exactly GGUF's values, see quantized.py): K8 (Q5_K,
// Q6_K) one int8 code per weight, a float32 scale and min per 16 input columns; K4 (Q4_K) Q4_1's 4-bit
// layout with each 32-column sub-block's 6-bit scale and min codes (bytes) and each 256-column
// super-block's float16 d and dmin: scale = d·code, min = −dmin·code, products exact in float32. w = d·q + m.
// The zero-point layouts of pre-quantized checkpoints (GPTQ, AWQ, compressed-tensors with zero points):
// Z4 Q4_1's code layout, Z8 Q8_0's (each code stored minus 128), with a float16 scale and a uint8 zero
// point z per 32 columns: w = d·(q − z), the min made here as −d·z (Z8: d·(128 − z)) — an 11-bit
// mantissa times an integer of at most 9 bits, exact in float32, so w is the checkpoint's value exactly.
// F8: FP8 E4M3 weights (a checkpoint's float8_e4m3fn bytes), a float32 scale per 32 columns: w = fp8(q)·d,
// each byte widened exactly in registers (vec_math.h fp8_over256_*: its fields moved into a float16's, whose subnormals
// cover e4m3's, and the exponent biases' difference 2^8 folded into d) — the checkpoint's own product.
enum Kind : int64_t { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, K8 = 3, K4 = 4, Z4 = 5, Z8 = 6, F8 = 7 };
enum Epilogue : int64_t { NONE = 0, SILU = 1, MUL = 2, ADD = 3 };
constexpr int64_t QK = 32;      // weights per block
constexpr int64_t QK8 = 16;     // weights per K8 block
constexpr int64_t ROW_TILE = 8; // activation rows per pass of the scalar path

// The instruction sets, best last. AVX512_VNNI (AVX-512 with VNNI and VBMI: Ice Lake, Zen 4 and later) adds
// 16-bit integer products for the 32-column kinds (Q4_0, Q4_1, Q8_0, K4) at any row count; K8 runs as
// under AVX512 there. AMX (its tiles and AMX-BF16, Sapphire Rapids and later) takes the 32-column
// kinds from AMX_MIN_ROWS rows on.
enum class Isa { SCALAR, AVX2, AVX512, AVX512_VNNI, AMX };

Isa pick(const std::string& isa) {
  static const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("f16c");
  static const bool hasvnni = has512 && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
  static const bool hasamx = hasvnni && __builtin_cpu_supports("avx512bf16") && kvpilot::amx_usable();  // AMX's activations split by AVX512-BF16
  static const bool has2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  if (isa == "auto") return hasamx ? Isa::AMX : hasvnni ? Isa::AVX512_VNNI : has512 ? Isa::AVX512 : has2 ? Isa::AVX2 : Isa::SCALAR;
  if (isa == "amx") { TORCH_CHECK(hasamx, "this CPU (or its kernel) gives no AMX-BF16 tiles"); return Isa::AMX; }
  if (isa == "avx512-vnni") { TORCH_CHECK(hasvnni, "this CPU has no AVX512-VNNI and -VBMI"); return Isa::AVX512_VNNI; }
  if (isa == "avx512") { TORCH_CHECK(has512, "this CPU has no AVX-512"); return Isa::AVX512; }
  if (isa == "avx2") { TORCH_CHECK(has2, "this CPU has no AVX2/FMA"); return Isa::AVX2; }
  TORCH_CHECK(isa == "scalar", "isa must be auto, amx, avx512-vnni, avx512, avx2 or scalar, got ", isa);
  return Isa::SCALAR;
}

// --- panels: 16 output rows side by side (the layout GGUFLinear multiplies with) ---------------------
//
// qs [P, nb, 16, 16] bytes for the 4-bit formats: panel p, block b, element j (0..15), lane l (output
// row 16p + l): low nibble = element j, high nibble = element j + 16 of that row; [P, nb, 32, 16] int8
// for Q8_0. d, m: float16 [P, nb, 16]. One vector of 16 lanes then holds one input column's weights for
// 16 output rows, so an activation is broadcast and FMA'd into 16 outputs at once: no horizontal sums,
// and each dequantized column serves a whole tile of activation rows.
constexpr int64_t LANES = 16;
constexpr int64_t PANEL_ROWS_512 = 8;   // activation rows per pass: 2 panels x 8 accumulators + weights fit 32 registers
constexpr int64_t PANEL_ROWS_AVX2 = 6;  // 2 x 6 accumulators (16 lanes as two halves) + weights fit 16

struct PanelArgs {
  const float* x; int64_t x_stride;
  const uint8_t* qs; const c10::Half* d; const c10::Half* m; int64_t nb, n;
  const float* bias;
  float* y; int64_t y_stride;
  const float* other; int64_t other_stride;
  int64_t kind, epilogue;
  const float* xsum;  // [M, nb]: each activation row's sum over each block (4-bit kinds; the factored path)
  const float* df; const float* mf;  // K8's (and F8's) float32 scales and mins (mf null: none), instead of d and m
  const uint8_t* codes;              // K4: [P, nb/8, 16 (scale, min of 8 sub-blocks), 16] codes; d: [P, nb/8, 2 (d, dmin), 16]
  const uint8_t* zeros;              // Z4, Z8: [P, nb, 16] zero points, shaped like d
  const uint16_t* xhi; const uint16_t* xlo;  // [M, K] bfloat16 bits: x split as x_hi + x_lo (the AMX path)
  const int16_t* xq; const float* xs;        // [M, K] int16 codes, [M, K/32] scales: x ≈ xs·xq per block (the VNNI path)
};

inline int64_t block_cols(int64_t kind) { return kind == K8 ? QK8 : QK; }
inline bool four_bit(int64_t kind) { return kind == Q4_0 || kind == Q4_1 || kind == K4 || kind == Z4; }
inline bool byte_codes(int64_t kind) { return kind == Q8_0 || kind == K8 || kind == Z8 || kind == F8; }  // one code per byte
constexpr float FP8_BIAS = 256.0f;  // 2^(15 − 7): e4m3's fields read as a float16's are its value / 2^8

// One e4m3fn byte's fields moved into a float16's (value / 2^8, exact for every finite byte).
inline float fp8_scaled(uint8_t b) {
  return static_cast<float>(c10::Half(static_cast<uint16_t>(((b & 0x80u) << 8) | ((b & 0x7Fu) << 7)), c10::Half::from_bits()));
}
constexpr int64_t SUB = 8;  // K4: 32-column sub-blocks per super-block

// K4's block b of panel p: its super-block's (d, dmin) and its (scale, min) codes, each 16 lanes.
inline const c10::Half* k4_super(const PanelArgs& a, int64_t p, int64_t b) { return a.d + (p * (a.nb / SUB) + b / SUB) * 2 * LANES; }
inline const uint8_t* k4_codes(const PanelArgs& a, int64_t p, int64_t b) {
  return a.codes + ((p * (a.nb / SUB) + b / SUB) * 2 * SUB + 2 * (b % SUB)) * LANES;
}

// Lane l's scale and min for block b of panel p, every kind.
inline void lane_scales(const PanelArgs& a, int64_t p, int64_t b, int64_t l, float& d, float& mn) {
  const int64_t sb = (p * a.nb + b) * LANES;
  if (a.kind == K4) {
    const c10::Half* s = k4_super(a, p, b);
    const uint8_t* c = k4_codes(a, p, b);
    d = static_cast<float>(s[l]) * c[l];
    mn = -(static_cast<float>(s[LANES + l]) * c[LANES + l]);
    return;
  }
  if (a.kind == K8 || a.kind == F8) {
    d = a.kind == F8 ? a.df[sb + l] * FP8_BIAS : a.df[sb + l];
    mn = a.mf ? a.mf[sb + l] : 0.0f;
    return;
  }
  d = static_cast<float>(a.d[sb + l]);
  if (a.kind == Z4 || a.kind == Z8) {
    mn = d * static_cast<float>((a.kind == Z8 ? 128 : 0) - a.zeros[sb + l]);
    return;
  }
  mn = a.kind == Q4_1 ? static_cast<float>(a.m[sb + l]) : a.kind == Q4_0 ? -8.0f * d : 0.0f;
}

// 16 and 8 bytes as floats (K4's codes). Named functions with their own target attribute: a lambda
// would not inherit its caller's.
__attribute__((target("avx512f"))) inline __m512 bytes_ps512(const uint8_t* c) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(c))));
}
__attribute__((target("avx2"))) inline __m256 bytes_ps256(const uint8_t* c) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(c))));
}

// The same for 16 lanes (AVX-512) ...
__attribute__((target("avx512f,f16c"))) inline void scales512(const PanelArgs& a, int64_t p, int64_t b, __m512& d, __m512& mn) {
  const int64_t sb = (p * a.nb + b) * LANES;
  if (a.kind == K4) {
    const c10::Half* s = k4_super(a, p, b);
    const uint8_t* c = k4_codes(a, p, b);
    d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s))), bytes_ps512(c));
    mn = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + LANES))),
                                                          bytes_ps512(c + LANES)));
    return;
  }
  if (a.kind == K8 || a.kind == F8) {
    d = a.kind == F8 ? _mm512_mul_ps(_mm512_loadu_ps(a.df + sb), _mm512_set1_ps(FP8_BIAS)) : _mm512_loadu_ps(a.df + sb);
    mn = a.mf ? _mm512_loadu_ps(a.mf + sb) : _mm512_setzero_ps();
    return;
  }
  d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.d + sb)));
  if (a.kind == Z4 || a.kind == Z8) {
    mn = _mm512_mul_ps(d, _mm512_sub_ps(_mm512_set1_ps(a.kind == Z8 ? 128.0f : 0.0f), bytes_ps512(a.zeros + sb)));
    return;
  }
  mn = a.kind == Q4_1 ? _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.m + sb)))
                      : _mm512_mul_ps(d, _mm512_set1_ps(a.kind == Q4_0 ? -8.0f : 0.0f));
}

// ... and for 8 lanes (AVX2), lanes 8h..8h+7.
__attribute__((target("avx2,fma,f16c"))) inline void scales256(const PanelArgs& a, int64_t p, int64_t b, int64_t h, __m256& d, __m256& mn) {
  const int64_t sb = (p * a.nb + b) * LANES + 8 * h;
  if (a.kind == K4) {
    const c10::Half* s = k4_super(a, p, b) + 8 * h;
    const uint8_t* c = k4_codes(a, p, b) + 8 * h;
    d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s))), bytes_ps256(c));
    mn = _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + LANES))),
                                                          bytes_ps256(c + LANES)));
    return;
  }
  if (a.kind == K8 || a.kind == F8) {
    d = a.kind == F8 ? _mm256_mul_ps(_mm256_loadu_ps(a.df + sb), _mm256_set1_ps(FP8_BIAS)) : _mm256_loadu_ps(a.df + sb);
    mn = a.mf ? _mm256_loadu_ps(a.mf + sb) : _mm256_setzero_ps();
    return;
  }
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.d + sb)));
  if (a.kind == Z4 || a.kind == Z8) {
    mn = _mm256_mul_ps(d, _mm256_sub_ps(_mm256_set1_ps(a.kind == Z8 ? 128.0f : 0.0f), bytes_ps256(a.zeros + sb)));
    return;
  }
  mn = a.kind == Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(a.m + sb)))
                      : _mm256_mul_ps(d, _mm256_set1_ps(a.kind == Q4_0 ? -8.0f : 0.0f));
}

inline void store_lanes(const PanelArgs& a, int64_t row, int64_t p, const float* v) {
  for (int64_t l = 0; l < LANES; ++l) {
    const int64_t n = p * LANES + l;
    if (n >= a.n) return;
    float out = v[l] + (a.bias ? a.bias[n] : 0.0f);
    switch (a.epilogue) {
      case SILU: out = out / (1.0f + std::exp(-out)); break;
      case MUL: out *= a.other[row * a.other_stride + n]; break;
      case ADD: out += a.other[row * a.other_stride + n]; break;
      default: break;
    }
    a.y[row * a.y_stride + n] = out;
  }
}

// store_lanes for 16 values in a register, vectorized when the panel has no padding lanes.
__attribute__((target("avx512f"))) inline void store_vector(const PanelArgs& a, int64_t row, int64_t p, __m512 v) {
  const int64_t n0 = p * LANES;
  if (n0 + LANES > a.n) {
    alignas(64) float out[LANES];
    _mm512_store_ps(out, v);
    return store_lanes(a, row, p, out);
  }
  if (a.bias) v = _mm512_add_ps(v, _mm512_loadu_ps(a.bias + n0));
  switch (a.epilogue) {
    case SILU: v = silu16(v); break;
    case MUL: v = _mm512_mul_ps(v, _mm512_loadu_ps(a.other + row * a.other_stride + n0)); break;
    case ADD: v = _mm512_add_ps(v, _mm512_loadu_ps(a.other + row * a.other_stride + n0)); break;
    default: break;
  }
  _mm512_storeu_ps(a.y + row * a.y_stride + n0, v);
}

inline int64_t block_bytes(int64_t kind) { return byte_codes(kind) ? block_cols(kind) * LANES : QK / 2 * LANES; }

void panel_scalar(const PanelArgs& a, int64_t row0, int64_t rows, int64_t p) {
  float acc[ROW_TILE][LANES] = {};
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* q = a.qs + (p * a.nb + b) * block_bytes(a.kind);
    const int64_t bw = block_cols(a.kind);
    for (int64_t l = 0; l < LANES; ++l) {
      float d, mn;
      lane_scales(a, p, b, l, d, mn);
      if (byte_codes(a.kind)) {  // (mn is 0 for Q8_0 and a K8 without mins: the fma is then d·q rounded once)
        for (int64_t k = 0; k < bw; ++k) {
          const uint8_t c = q[k * LANES + l];
          const float w = std::fma(d, a.kind == F8 ? fp8_scaled(c) : static_cast<float>(static_cast<int8_t>(c)), mn);
          for (int64_t r = 0; r < rows; ++r) acc[r][l] += w * a.x[(row0 + r) * a.x_stride + b * bw + k];
        }
        continue;
      }
      for (int64_t k = 0; k < QK; ++k) {
        const float w = d * (k < 16 ? (q[k * LANES + l] & 0x0F) : (q[(k - 16) * LANES + l] >> 4)) + mn;
        for (int64_t r = 0; r < rows; ++r) acc[r][l] += w * a.x[(row0 + r) * a.x_stride + b * QK + k];
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) store_lanes(a, row0 + r, p, acc[r]);
}

template <int R, int NP>
__attribute__((target("avx512f"))) void store_panels(const PanelArgs& a, int64_t row0, int64_t p, const __m512 (&acc)[NP][R]) {
  for (int u = 0; u < NP; ++u)
    for (int r = 0; r < R; ++r) store_vector(a, row0 + r, p + u, acc[u][r]);
}

// NP panels side by side: each broadcast activation feeds NP FMAs (the broadcasts, not the FMAs, would
// otherwise bound the loop).
template <int R, int NP>
__attribute__((target("avx512f,avx512bw,f16c"))) void panel_avx512_t(const PanelArgs& a, int64_t row0, int64_t p) {
  __m512 acc[NP][R];
  for (int u = 0; u < NP; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const int64_t bytes = block_bytes(a.kind);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512 d[NP], mn[NP];
    const uint8_t* q[NP];
    for (int u = 0; u < NP; ++u) {
      q[u] = a.qs + ((p + u) * a.nb + b) * bytes;
      scales512(a, p + u, b, d[u], mn[u]);
    }
    const int64_t bw = block_cols(a.kind);
    const float* x = a.x + row0 * a.x_stride + b * bw;
    if (byte_codes(a.kind)) {
      const bool fp8 = a.kind == F8;
      for (int k = 0; k < bw; ++k) {
        __m512 w[NP];
        for (int u = 0; u < NP; ++u) {
          const __m512 qf = fp8 ? fp8_over256_x16(q[u] + k * LANES)
                                : _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q[u] + k * LANES))));
          w[u] = _mm512_fmadd_ps(d[u], qf, mn[u]);  // (mn 0: Q8_0, K8 without mins)
        }
        for (int r = 0; r < R; ++r) {
          const __m512 xv = _mm512_set1_ps(x[r * a.x_stride + k]);
          for (int u = 0; u < NP; ++u) acc[u][r] = _mm512_fmadd_ps(xv, w[u], acc[u][r]);
        }
      }
      continue;
    }
    for (int j = 0; j < QK / 2; ++j) {
      __m512 lo[NP], hi[NP];
      for (int u = 0; u < NP; ++u) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[u] + j * LANES));
        lo[u] = _mm512_fmadd_ps(d[u], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4))), mn[u]);
        hi[u] = _mm512_fmadd_ps(d[u], _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4))), mn[u]);
      }
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r * a.x_stride + j]), x1 = _mm512_set1_ps(x[r * a.x_stride + j + 16]);
        for (int u = 0; u < NP; ++u) {
          acc[u][r] = _mm512_fmadd_ps(x0, lo[u], acc[u][r]);
          acc[u][r] = _mm512_fmadd_ps(x1, hi[u], acc[u][r]);
        }
      }
    }
  }
  store_panels<R, NP>(a, row0, p, acc);
}

template <int R>
__attribute__((target("avx2,fma,f16c"))) void panel_avx2_t(const PanelArgs& a, int64_t row0, int64_t p) {
  __m256 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* q = a.qs + (p * a.nb + b) * block_bytes(a.kind);
    __m256 d[2], mn[2];
    for (int h = 0; h < 2; ++h) scales256(a, p, b, h, d[h], mn[h]);
    const bool bytes8 = byte_codes(a.kind), fp8 = a.kind == F8;
    const float* x = a.x + row0 * a.x_stride + b * block_cols(a.kind);
    const int cols = bytes8 ? block_cols(a.kind) : QK / 2;
    for (int j = 0; j < cols; ++j) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * LANES));
      __m256 w[2][2];  // [half of the lanes][element j, element j + 16 (4-bit only)]
      if (bytes8) {
        const __m256 q0 = fp8 ? fp8_over256_x8(q + j * LANES) : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
        const __m256 q1 = fp8 ? fp8_over256_x8(q + j * LANES + 8) : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
        w[0][0] = _mm256_fmadd_ps(d[0], q0, mn[0]);  // (mn 0: Q8_0, K8 without mins)
        w[1][0] = _mm256_fmadd_ps(d[1], q1, mn[1]);
      } else {
        const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
        w[0][0] = _mm256_fmadd_ps(d[0], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), mn[0]);
        w[1][0] = _mm256_fmadd_ps(d[1], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), mn[1]);
        w[0][1] = _mm256_fmadd_ps(d[0], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), mn[0]);
        w[1][1] = _mm256_fmadd_ps(d[1], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), mn[1]);
      }
      for (int r = 0; r < R; ++r) {
        const __m256 x0 = _mm256_set1_ps(x[r * a.x_stride + j]);
        acc[r][0] = _mm256_fmadd_ps(x0, w[0][0], acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x0, w[1][0], acc[r][1]);
        if (!bytes8) {
          const __m256 x1 = _mm256_set1_ps(x[r * a.x_stride + j + 16]);
          acc[r][0] = _mm256_fmadd_ps(x1, w[0][1], acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(x1, w[1][1], acc[r][1]);
        }
      }
    }
  }
  alignas(32) float out[LANES];
  for (int r = 0; r < R; ++r) {
    _mm256_store_ps(out, acc[r][0]);
    _mm256_store_ps(out + 8, acc[r][1]);
    store_lanes(a, row0 + r, p, out);
  }
}

// The factored kernels' end of a block: acc += d·(Σ x·q over the low and the high nibbles) + m·Σ x.
template <int R, int NP>
__attribute__((target("avx512f,f16c"))) inline void add_block(const PanelArgs& a, int64_t row0, int64_t p, int64_t b,
                                                             const __m512 (&lo)[NP][R], const __m512 (&hi)[NP][R], __m512 (&acc)[NP][R]) {
  for (int u = 0; u < NP; ++u) {
    __m512 d, mn;
    scales512(a, p + u, b, d, mn);
    for (int r = 0; r < R; ++r) {
      acc[u][r] = _mm512_fmadd_ps(d, _mm512_add_ps(lo[u][r], hi[u][r]), acc[u][r]);
      acc[u][r] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[(row0 + r) * a.nb + b]), acc[u][r]);
    }
  }
}

// One or two activation rows (decoding one or two sequences), 4-bit kinds. With a single row the loop
// above is bound by the latency of one accumulator chain per panel; here the block's sum of x·q is kept
// in separate registers for the low and high nibbles (four independent chains for two panels), and the
// scale and min are applied once per block instead of per weight: Σ x·(d·q + m) = d·Σ x·q + m·Σ x.
template <int R, int NP>
__attribute__((target("avx512f,avx512bw,f16c"))) void panel_avx512_factored(const PanelArgs& a, int64_t row0, int64_t p) {
  __m512 acc[NP][R];
  for (int u = 0; u < NP; ++u)
    for (int r = 0; r < R; ++r) acc[u][r] = _mm512_setzero_ps();
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const int64_t bytes = block_bytes(a.kind);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512 lo[NP][R], hi[NP][R];
    const uint8_t* q[NP];
    for (int u = 0; u < NP; ++u) {
      q[u] = a.qs + ((p + u) * a.nb + b) * bytes;
      for (int r = 0; r < R; ++r) lo[u][r] = hi[u][r] = _mm512_setzero_ps();
    }
    const float* x = a.x + row0 * a.x_stride + b * QK;
    for (int j = 0; j < QK / 2; ++j) {
      __m512 ql[NP], qh[NP];
      for (int u = 0; u < NP; ++u) {
        const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q[u] + j * LANES));
        ql[u] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(v, low4)));
        qh[u] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(v, 4), low4)));
      }
      for (int r = 0; r < R; ++r) {
        const __m512 x0 = _mm512_set1_ps(x[r * a.x_stride + j]), x1 = _mm512_set1_ps(x[r * a.x_stride + j + 16]);
        for (int u = 0; u < NP; ++u) {
          lo[u][r] = _mm512_fmadd_ps(x0, ql[u], lo[u][r]);
          hi[u][r] = _mm512_fmadd_ps(x1, qh[u], hi[u][r]);
        }
      }
    }
    add_block<R, NP>(a, row0, p, b, lo, hi, acc);
  }
  store_panels<R, NP>(a, row0, p, acc);
}

// VPDPWSSD (the VNNI path) and the AMX activations' pair order want each lane's two elements side by
// side, where the panel layout holds element j of 16 lanes in 16 bytes: two such rows, widened to
// 16-bit words, are interleaved by one VPERMW.
alignas(64) constexpr int16_t kInterleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline __m512 widen(__m256bh h) {  // 16 bfloat16s as floats
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)h), 16));
}

// x [M, K] float32 rows -> x_hi, x_lo [M, K] bfloat16 bits (x_hi = x rounded to nearest, x_lo = the
// rest rounded: x to within ~2^-17), each block's 32 values stored as the column pairs (j, j + 16) side
// by side, the order the AMX path's weight tiles hold.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void split_bf16(const float* x, int64_t stride, int64_t M, int64_t K,
                                                                       uint16_t* xhi, uint16_t* xlo) {
  const __m512i interleave = _mm512_load_si512(kInterleave);
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / QK; ++b) {
      __m256bh vh[2], vl[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_loadu_ps(x + r * stride + b * QK + 16 * h);
        vh[h] = _mm512_cvtneps_pbh(v);
        vl[h] = _mm512_cvtneps_pbh(_mm512_sub_ps(v, widen(vh[h])));
      }
      const __m512i hi = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)vh[0]), (__m256i)vh[1], 1);
      const __m512i lo = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)vl[0]), (__m256i)vl[1], 1);
      _mm512_storeu_si512(xhi + r * K + b * QK, _mm512_permutexvar_epi16(interleave, hi));
      _mm512_storeu_si512(xlo + r * K + b * QK, _mm512_permutexvar_epi16(interleave, lo));
    }
}

// The 32-column kinds at any row count (below AMX_MIN_ROWS where the CPU has AMX) with AVX512-VNNI — at
// one or two rows too, where it measured 1.5-1.7x the factored float path (bench/history/): the
// activations quantized once per call to 16-bit integers per block of 32 (quantize_int16: x ≈ s·c,
// s = max|x| / 32767), so that a block's Σ c·q is exact integer arithmetic — VPDPWSSD, 32 products
// per instruction, twice the float FMA's — and the float work is one scale per block:
// Σ x·(d·q + m) ≈ d·s·Σ c·q + m·Σ s·c. The codes need no conversion to float, only widening to 16
// bits. The rounding of x (≤ max|x| / 65534 per element) is the one change from the float path: on the
// bundled model mean KL vs fp32 6.5e-8–7.3e-8 (both paths) with every greedy continuation unchanged (bench/history/).
// VPDPWSSD multiplies each lane's two adjacent words: rows j and j + 1 of 16 lanes are widened to
// words and interleaved — for 4-bit codes by one zero-masking VPERMB (bytes to the even positions),
// for Q8_0's signed bytes by VPMOVSXBW and VPERMW. Sums fit int32: 32 · 127 · 32767 < 2^31.
// The loop issues two VPDPWSSD per cycle at best (ports 0 and 5, which the unpacking shares): R = 8
// rows per weight vector unpacked keeps the unpacking to a fifth of the work, and the float
// accumulators, touched once per block, live in memory to leave the registers to 2 x 8 integer sums.
// Software prefetch of the weights `ahead` blocks on, for the first row tile of a panel group: in the
// engine the weights come from memory once per call, and the loop otherwise waits for them and
// computes in turn (weights cycled through 8 copies so that they are not cache-resident, 16 rows: the
// head 2.87 -> 2.28 ms with it). Past a panel's last block the stream runs on into the next group's panels.
constexpr int64_t VNNI_PREFETCH_BLOCKS = 4;
inline void prefetch_blocks(const PanelArgs& a, int64_t p, int np, int64_t ahead) {
  const int64_t bytes = block_bytes(a.kind);
  for (int u = 0; u < np; ++u) {
    int64_t panel = p + u, b = ahead;
    if (b >= a.nb) {
      panel += np;
      b -= a.nb;
    }
    if (panel * LANES >= a.n) return;
    const char* q = reinterpret_cast<const char*>(a.qs + (panel * a.nb + b) * bytes);
    for (int64_t c = 0; c < bytes; c += 64) _mm_prefetch(q + c, _MM_HINT_T0);
    if (a.kind != K4 && a.kind != K8) _mm_prefetch(reinterpret_cast<const char*>(a.d + (panel * a.nb + b) * LANES), _MM_HINT_T0);
    if (a.kind == Q4_1) _mm_prefetch(reinterpret_cast<const char*>(a.m + (panel * a.nb + b) * LANES), _MM_HINT_T0);
    if (a.kind == Z4) _mm_prefetch(reinterpret_cast<const char*>(a.zeros + (panel * a.nb + b) * LANES), _MM_HINT_T0);
  }
}

alignas(64) constexpr uint8_t kEvenBytes[64] = {0, 0, 16, 0, 1, 0, 17, 0, 2, 0, 18, 0, 3, 0, 19, 0, 4, 0, 20, 0, 5, 0, 21, 0,
                                                6, 0, 22, 0, 7, 0, 23, 0, 8, 0, 24, 0, 9, 0, 25, 0, 10, 0, 26, 0, 11, 0, 27, 0,
                                                12, 0, 28, 0, 13, 0, 29, 0, 14, 0, 30, 0, 15, 0, 31, 0};
template <int R, int NP, bool BYTE>  // BYTE: Q8_0 (one signed code per byte) instead of two 4-bit ones
__attribute__((target("avx512f,avx512bw,avx512vbmi,avx512vnni,f16c"))) void panel_vnni_t(const PanelArgs& a, int64_t row0, int64_t p) {
  alignas(64) float acc[NP][R][LANES] = {};
  const __m512i low4 = _mm512_set1_epi16(0x000F), interleave = _mm512_load_si512(kInterleave), even = _mm512_load_si512(kEvenBytes);
  const int64_t bytes = block_bytes(a.kind), K = a.nb * QK;
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i sum[NP][R];
    const uint8_t* q[NP];
    for (int u = 0; u < NP; ++u) {
      q[u] = a.qs + ((p + u) * a.nb + b) * bytes;
      for (int r = 0; r < R; ++r) sum[u][r] = _mm512_setzero_si512();
    }
    if (row0 == 0) prefetch_blocks(a, p, NP, b + VNNI_PREFETCH_BLOCKS);
    for (int j = 0; j < (BYTE ? QK : QK / 2); j += 2) {  // bytes j and j + 1 of 16 lanes
      __m512i w0[NP], w1[NP];  // BYTE: elements j, j + 1; 4-bit: those (low nibbles) and j + 16, j + 17 (high)
      for (int u = 0; u < NP; ++u) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[u] + j * LANES));
        if (BYTE) {
          w0[u] = _mm512_permutexvar_epi16(interleave, _mm512_cvtepi8_epi16(v));
        } else {
          const __m512i w = _mm512_maskz_permutexvar_epi8(0x5555555555555555ull, even, _mm512_castsi256_si512(v));
          w0[u] = _mm512_and_si512(w, low4);
          w1[u] = _mm512_srli_epi16(w, 4);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int16_t* x = a.xq + (row0 + r) * K + b * QK + j;
        int32_t pair0, pair1;
        std::memcpy(&pair0, x, 4);
        const __m512i x0 = _mm512_set1_epi32(pair0);
        for (int u = 0; u < NP; ++u) sum[u][r] = _mm512_dpwssd_epi32(sum[u][r], w0[u], x0);
        if (!BYTE) {
          std::memcpy(&pair1, x + 16, 4);
          const __m512i x1 = _mm512_set1_epi32(pair1);
          for (int u = 0; u < NP; ++u) sum[u][r] = _mm512_dpwssd_epi32(sum[u][r], w1[u], x1);
        }
      }
    }
    for (int u = 0; u < NP; ++u) {
      __m512 d, mn;
      scales512(a, p + u, b, d, mn);
      for (int r = 0; r < R; ++r) {
        const int64_t rb = (row0 + r) * a.nb + b;
        __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(a.xs[rb])), _mm512_cvtepi32_ps(sum[u][r]), _mm512_load_ps(acc[u][r]));
        if (!BYTE || a.kind == Z8) v = _mm512_fmadd_ps(mn, _mm512_set1_ps(a.xsum[rb]), v);  // (Q8_0: no min)
        _mm512_store_ps(acc[u][r], v);
      }
    }
  }
  for (int u = 0; u < NP; ++u)
    for (int r = 0; r < R; ++r) store_vector(a, row0 + r, p + u, _mm512_load_ps(acc[u][r]));
}

// x [M, K] float32 rows -> xq [M, K] int16 codes, xs [M, K/32] scales (x ≈ xs·xq per block of 32,
// symmetric, round to nearest) and xsum [M, K/32] = xs·Σ xq, each block's sum of the activations the
// VNNI path multiplies.
__attribute__((target("avx512f,avx512bw"))) void quantize_int16(const float* x, int64_t stride, int64_t M, int64_t K,
                                                               int16_t* xq, float* xs, float* xsum) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t b = 0; b < K / QK; ++b) {
      const float* xb = x + r * stride + b * QK;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float scale = amax / 32767.0f, inv = amax > 0.0f ? 32767.0f / amax : 0.0f;
      const __m512i c0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, _mm512_set1_ps(inv)));  // round to nearest (MXCSR default)
      const __m512i c1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, _mm512_set1_ps(inv)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + b * QK), _mm512_cvtsepi32_epi16(c0));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(xq + r * K + b * QK + 16), _mm512_cvtsepi32_epi16(c1));
      xs[r * (K / QK) + b] = scale;
      xsum[r * (K / QK) + b] = scale * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(c0, c1)));
    }
}

constexpr int64_t PANEL_ROWS_VNNI = 8;

void panel_vnni(const PanelArgs& a, int64_t row0, int64_t rows, int64_t p) {
  const bool two = (p + 2) * LANES <= (a.n + LANES - 1) / LANES * LANES;
#define KVP_VNNI(R)                                                                                                    \
  if (a.kind == Q8_0 || a.kind == Z8) return two ? panel_vnni_t<R, 2, true>(a, row0, p) : panel_vnni_t<R, 1, true>(a, row0, p);       \
  return two ? panel_vnni_t<R, 2, false>(a, row0, p) : panel_vnni_t<R, 1, false>(a, row0, p);
  switch (rows) {
    case 1: { KVP_VNNI(1) }
    case 2: { KVP_VNNI(2) }
    case 3: { KVP_VNNI(3) }
    case 4: { KVP_VNNI(4) }
    case 5: { KVP_VNNI(5) }
    case 6: { KVP_VNNI(6) }
    case 7: { KVP_VNNI(7) }
    default: { KVP_VNNI(8) }
  }
#undef KVP_VNNI
}

// Prefill and batched decode on CPUs with AMX (Sapphire Rapids and later), on the tile unit: TDPBF16PS
// multiplies a 16x32 bfloat16 tile of activations by a 32x16 one of weights, products exact, summed in
// float32 into a 16x16 float32 tile — 8192 products per instruction where VPDPWSSD does 32.
// Both operands are split into two bfloat16s, so that the result is float32-grade:
// - activations x = x_hi + x_lo (split_bf16: x to within ~2^-17);
// - weights, dequantized per call (d·q + m in float32, exactly the float path's), w = w_hi + w_lo: w_hi
//   its top 16 bits, w_lo the rest rounded to bfloat16 (w to within 2^-16).
// C += x_hi·w_hi + x_lo·w_hi + x_hi·w_lo per block of 32 columns (x_lo·w_lo, ~2^-16 of the sum, left
// out): the scales and mins are inside the weights, so C sums every block and is stored once per
// 16 rows x 16 outputs. Keeping the codes exact instead (C per block, scaled by d and m in AVX-512)
// was measured slower than the VNNI path at 16 rows: every block's C went through memory, and vector
// loads of tile-stored lines were the bottleneck.
// Weights are dequantized into tiles once per (call, panel pair, pass of rows); the tiles of a pass's
// rows (x_hi, x_lo) stay in L2 while every panel pair is multiplied by them.
constexpr int64_t AMX_MIN_ROWS = 64;  // below, making the weight tiles (per call) costs what the tiles save (measured against the 8-row VNNI path: 32 rows 0.8-0.9x, 64 rows 0.9-1.2x, 128 rows 1.0-1.4x; bench/gguf_paths.py)
constexpr int64_t BTILE = 16 * 32;   // bfloat16s in one block's weight tile (16 column pairs x 16 lanes x 2)

// Tiles (kvpilot::kTiles: each 16 rows of 64 bytes): 0, 1 x_hi and x_lo (16 rows x 32 bfloat16); 2, 3 and 4, 5 two
// panels' w_hi and w_lo (32 x 16, column pairs side by side); 6, 7 their C (16 x 16 float32).
using kvpilot::AMX_TILE_ROWS;
using kvpilot::amx_configure;
using kvpilot::amx_release;

// Columns j and j + 16 of a block (16 lanes each, codes as int32) -> w = d·q + m, as one row of the
// w_hi and one of the w_lo tile: per lane the pair (j, j + 16) side by side (the activations are split
// in that order too: split_bf16). w_hi: the top 16 bits of w; w_lo: w - w_hi rounded (adding
// half a unit of the 16th bit to the bit pattern). Integer ops: nothing on the shuffle port.
__attribute__((target("avx512f"))) inline void amx_weight_pair(__m512i q0, __m512i q1, __m512 d, __m512 mn, uint16_t* hi, uint16_t* lo) {
  constexpr int kOrTop = 0xEA;  // ternary logic: (a & b) | c
  const __m512i top = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)), half = _mm512_set1_epi32(0x8000);
  const __m512i w0 = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), d, mn));
  const __m512i w1 = _mm512_castps_si512(_mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), d, mn));
  _mm512_storeu_si512(hi, _mm512_ternarylogic_epi32(w1, top, _mm512_srli_epi32(w0, 16), kOrTop));
  const __m512i r0 = _mm512_add_epi32(_mm512_castps_si512(_mm512_sub_ps(_mm512_castsi512_ps(w0), _mm512_castsi512_ps(_mm512_and_si512(w0, top)))), half);
  const __m512i r1 = _mm512_add_epi32(_mm512_castps_si512(_mm512_sub_ps(_mm512_castsi512_ps(w1), _mm512_castsi512_ps(_mm512_and_si512(w1, top)))), half);
  _mm512_storeu_si512(lo, _mm512_ternarylogic_epi32(r1, top, _mm512_srli_epi32(r0, 16), kOrTop));
}

// Panel p's weights, every block, as w_hi and w_lo tiles [nb][hi, lo][16 column pairs][16 lanes][2].
__attribute__((target("avx512f,avx512bw,f16c"))) void amx_weight_tiles(const PanelArgs& a, int64_t p, uint16_t* tiles) {
  const __m512i low4 = _mm512_set1_epi32(0x0F);
  const int64_t bytes = block_bytes(a.kind);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512 d, mn;
    scales512(a, p, b, d, mn);
    const uint8_t* q = a.qs + (p * a.nb + b) * bytes;
    uint16_t* hi = tiles + 2 * b * BTILE;
    uint16_t* lo = hi + BTILE;
    for (int j = 0; j < 16; ++j) {
      __m512i q0, q1;
      if (a.kind == Q8_0 || a.kind == Z8) {  // byte rows j and j + 16
        q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * LANES)));
        q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (j + 16) * LANES)));
      } else {  // byte row j: column j in the low nibbles, j + 16 in the high ones
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * LANES)));
        q0 = _mm512_and_si512(v, low4);
        q1 = _mm512_srli_epi32(v, 4);
      }
      amx_weight_pair(q0, q1, d, mn, hi + j * 32, lo + j * 32);
    }
  }
}

// Rows [row0, row0 + 16) of the padded activations times panels p..p+NP-1 (`tiles`: their weight
// tiles, panel after panel), C stored to `c` [NP][16 x 16]. x_hi and x_lo are loaded once per block for
// both panels; the two C tiles are independent chains.
template <int NP>
__attribute__((target("amx-tile,amx-bf16"))) void panel_amx(const PanelArgs& a, int64_t row0, const uint16_t* tiles, float* c) {
  const int64_t K = a.nb * QK;
  const uint16_t* xhi = a.xhi + row0 * K;
  const uint16_t* xlo = a.xlo + row0 * K;
  const uint16_t* second = tiles + 2 * a.nb * BTILE;
  _tile_zero(6);
  if constexpr (NP == 2) _tile_zero(7);
  for (int64_t b = 0; b < a.nb; ++b) {
    _tile_loadd(0, xhi + b * QK, K * 2);
    _tile_loadd(1, xlo + b * QK, K * 2);
    _tile_loadd(2, tiles + 2 * b * BTILE, 64);
    _tile_loadd(3, tiles + (2 * b + 1) * BTILE, 64);
    _tile_dpbf16ps(6, 0, 2);
    if constexpr (NP == 2) {
      _tile_loadd(4, second + 2 * b * BTILE, 64);
      _tile_loadd(5, second + (2 * b + 1) * BTILE, 64);
      _tile_dpbf16ps(7, 0, 4);
    }
    _tile_dpbf16ps(6, 1, 2);
    if constexpr (NP == 2) _tile_dpbf16ps(7, 1, 4);
    _tile_dpbf16ps(6, 0, 3);
    if constexpr (NP == 2) _tile_dpbf16ps(7, 0, 5);
  }
  _tile_stored(6, c, 64);
  if constexpr (NP == 2) _tile_stored(7, c + AMX_TILE_ROWS * LANES, 64);
}

// The stored C of `np` panels from p, rows [row0, row0 + rows), through bias and epilogue into y.
__attribute__((target("avx512f"))) void amx_store(const PanelArgs& a, int64_t row0, int64_t rows, int64_t p, int np, const float* c) {
  for (int u = 0; u < np; ++u)
    for (int64_t r = 0; r < rows; ++r) store_vector(a, row0 + r, p + u, _mm512_load_ps(c + (u * AMX_TILE_ROWS + r) * LANES));
}

// The whole product on the AMX path: x split into xhi/xlo (rows padded to 16 with zeros) beforehand.
// Panels in pairs over the threads; per pair and pass of rows, the weight tiles made once, then the
// 16-row tiles in turn. Two lags hide two stalls (measured, each ~2-10x the cost of the access):
// tile loads of freshly stored weight tiles, so a pair's tiles are made while the previous pair is
// multiplied; vector loads right after a tile store, so each 16-row tile's C is read back one tile later.
void gguf_linear_amx(const PanelArgs& a, int64_t M, int64_t P, int64_t rows_per_pass) {
  const int64_t pair_tiles = 4 * a.nb * BTILE;
  auto make_tiles = [&](int64_t p, uint16_t* tiles) {
    amx_weight_tiles(a, p, tiles);
    if (p + 1 < P) amx_weight_tiles(a, p + 1, tiles + 2 * a.nb * BTILE);
  };
  for (int64_t m0 = 0; m0 < M; m0 += rows_per_pass) {
    const int64_t m1 = std::min(M, m0 + rows_per_pass);
    // Pairs claimed one at a time: a thread claims its next pair before multiplying the current one,
    // to make that pair's tiles first.
    kvpilot::WorkQueue work((P + 1) / 2, 1);
    kvpilot::on_threads(work.size(), [&] {
      amx_configure();  // tile state is per thread
      std::vector<uint16_t> tiles(2 * pair_tiles);  // this pair's and the next one's
      alignas(64) float c[2][2 * AMX_TILE_ROWS * LANES];
      int64_t cur, next, end;
      bool more = work.claim(cur, end);
      if (more) make_tiles(2 * cur, tiles.data());
      for (int k = 0; more; cur = next, k ^= 1) {
        const int64_t p = 2 * cur;
        uint16_t* mine = tiles.data() + k * pair_tiles;
        more = work.claim(next, end);
        if (more) make_tiles(2 * next, tiles.data() + (k ^ 1) * pair_tiles);
        const int np = p + 1 < P ? 2 : 1;
        int64_t i = 0;
        for (int64_t r0 = m0; r0 < m1; r0 += AMX_TILE_ROWS, ++i) {
          np == 2 ? panel_amx<2>(a, r0, mine, c[i % 2]) : panel_amx<1>(a, r0, mine, c[i % 2]);
          if (i > 0) amx_store(a, r0 - AMX_TILE_ROWS, AMX_TILE_ROWS, p, np, c[(i - 1) % 2]);
        }
        const int64_t last = m0 + (i - 1) * AMX_TILE_ROWS;
        amx_store(a, last, std::min(AMX_TILE_ROWS, m1 - last), p, np, c[(i - 1) % 2]);
      }
      amx_release();
    });
  }
}

using PanelFn = void (*)(const PanelArgs&, int64_t, int64_t, int64_t);

template <int NP>
void panel_avx512_np(const PanelArgs& a, int64_t row0, int64_t rows, int64_t p) {
  if (a.xsum && rows <= 2) {
    return rows == 1 ? panel_avx512_factored<1, NP>(a, row0, p) : panel_avx512_factored<2, NP>(a, row0, p);
  }
  switch (rows) {
      case 1: return panel_avx512_t<1, NP>(a, row0, p);
      case 2: return panel_avx512_t<2, NP>(a, row0, p);
      case 3: return panel_avx512_t<3, NP>(a, row0, p);
      case 4: return panel_avx512_t<4, NP>(a, row0, p);
      case 5: return panel_avx512_t<5, NP>(a, row0, p);
      case 6: return panel_avx512_t<6, NP>(a, row0, p);
      case 7: return panel_avx512_t<7, NP>(a, row0, p);
      default: return panel_avx512_t<8, NP>(a, row0, p);
  }
}

// `p` is the first of two panels when a second one exists (the caller steps by two).
void panel_avx512(const PanelArgs& a, int64_t row0, int64_t rows, int64_t p) {
  if ((p + 2) * LANES <= (a.n + LANES - 1) / LANES * LANES) return panel_avx512_np<2>(a, row0, rows, p);
  return panel_avx512_np<1>(a, row0, rows, p);
}

void panel_avx2(const PanelArgs& a, int64_t row0, int64_t rows, int64_t p) {
  switch (rows) {
    case 1: return panel_avx2_t<1>(a, row0, p);
    case 2: return panel_avx2_t<2>(a, row0, p);
    case 3: return panel_avx2_t<3>(a, row0, p);
    case 4: return panel_avx2_t<4>(a, row0, p);
    case 5: return panel_avx2_t<5>(a, row0, p);
    default: return panel_avx2_t<6>(a, row0, p);
  }
}

// Q4_1's mins and Z4/Z8's zero points shaped like the scales, the bias [N], the epilogue's operand [M, N].
void check_operands(const torch::Tensor& d, const c10::optional<torch::Tensor>& m, int64_t kind, int64_t N, int64_t M,
                    const c10::optional<torch::Tensor>& bias, int64_t epilogue, const c10::optional<torch::Tensor>& other) {
  if (kind == Q4_1) {
    TORCH_CHECK(m && m->is_contiguous() && m->scalar_type() == torch::kHalf && m->sizes() == d.sizes(), "m: float16, shaped like d");
  }
  if (kind == Z4 || kind == Z8) {
    TORCH_CHECK(m && m->is_contiguous() && m->scalar_type() == torch::kByte && m->sizes() == d.sizes(), "m: Z4/Z8's uint8 zero points, shaped like d");
  }
  if (bias) {
    TORCH_CHECK(bias->is_contiguous() && bias->scalar_type() == torch::kFloat && bias->numel() == N, "bias: float32 [N]");
  }
  if (epilogue == MUL || epilogue == ADD) {
    TORCH_CHECK(other && other->scalar_type() == torch::kFloat && other->dim() == 2 && other->size(0) == M && other->size(1) == N &&
                other->stride(1) == 1, "other: float32 [M, N]");
  } else {
    TORCH_CHECK(epilogue == NONE || epilogue == SILU, "epilogue: 0 none, 1 silu, 2 mul, 3 add");
  }
}

}  // namespace

int64_t gguf_amx_min_rows() { return AMX_MIN_ROWS; }

std::string gguf_linear_isa() {
  switch (pick("auto")) {
    case Isa::AMX: return "amx";
    case Isa::AVX512_VNNI: return "avx512-vnni";
    case Isa::AVX512: return "avx512";
    case Isa::AVX2: return "avx2";
    default: return "scalar";
  }
}

// x [M, K] float32 times the panel-laid-out W [n, K] -> [M, n]; epilogue: 0 none, 1 silu(y), 2 y * other,
// 3 y + other (other [M, n]). perm (int64 [K]): W holds its input columns in this order (an act-order
// checkpoint's weight): x's columns are gathered into it first, here rather than by a torch op per call.
torch::Tensor gguf_linear_panel(torch::Tensor x, torch::Tensor qs, torch::Tensor d, c10::optional<torch::Tensor> m, int64_t kind, int64_t n,
                                c10::optional<torch::Tensor> bias, int64_t epilogue, c10::optional<torch::Tensor> other, std::string isa,
                                c10::optional<torch::Tensor> perm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.stride(1) == 1, "x: float32 rows [M, K]");
  if (perm) {
    const int64_t rows = x.size(0), cols = x.size(1);
    TORCH_CHECK(perm->scalar_type() == torch::kLong && perm->dim() == 1 && perm->size(0) == cols && perm->is_contiguous(), "perm: int64 [K]");
    const int64_t* order = perm->data_ptr<int64_t>();
    for (int64_t c = 0; c < cols; ++c) TORCH_CHECK(order[c] >= 0 && order[c] < cols, "perm: column indices in [0, K)");
    auto gathered = torch::empty({rows, cols}, x.options());
    const float* src = x.data_ptr<float>();
    float* dst = gathered.data_ptr<float>();
    const int64_t stride = x.stride(0);
    at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c) dst[r * cols + c] = src[r * stride + order[c]];
    });
    x = gathered;
  }
  TORCH_CHECK(kind >= Q4_0 && kind <= F8, "kind: 0 (Q4_0), 1 (Q4_1), 2 (Q8_0), 3 (K8), 4 (K4), 5 (Z4), 6 (Z8) or 7 (F8)");
  const int64_t M = x.size(0), K = x.size(1), bw = block_cols(kind);
  TORCH_CHECK(qs.is_contiguous() && qs.dim() == 4 && qs.size(1) * bw == K && qs.size(2) == (byte_codes(kind) ? bw : QK / 2) && qs.size(3) == LANES,
              "qs: [P, K/32 (K/16 for K8), 16 or 32, 16] panels");
  const int64_t P = qs.size(0);
  TORCH_CHECK(n > (P - 1) * LANES && n <= P * LANES, "n must be within the last panel");
  const bool k8 = kind == K8, k4 = kind == K4, f32 = k8 || kind == F8;  // f32: float32 scales
  if (k4) {
    const int64_t supers = K / (SUB * QK);
    TORCH_CHECK(K % (SUB * QK) == 0, "K4: K must be a multiple of 256");
    TORCH_CHECK(d.is_contiguous() && d.scalar_type() == torch::kHalf && d.dim() == 4 && d.size(0) == P && d.size(1) == supers &&
                d.size(2) == 2 && d.size(3) == LANES, "d: K4's [P, K/256, 2, 16] float16 (each super-block's d, dmin)");
    TORCH_CHECK(m && m->is_contiguous() && m->scalar_type() == torch::kByte && m->dim() == 4 && m->size(0) == P && m->size(1) == supers &&
                m->size(2) == 2 * SUB && m->size(3) == LANES, "m: K4's [P, K/256, 16, 16] uint8 (each sub-block's scale, min codes)");
  } else {
    TORCH_CHECK(d.is_contiguous() && d.scalar_type() == (f32 ? torch::kFloat : torch::kHalf) && d.dim() == 3 && d.size(0) == P &&
                d.size(1) == K / bw && d.size(2) == LANES, "d: [P, K/32, 16] float16 (K8: [P, K/16, 16] float32; F8: [P, K/32, 16] float32)");
    if (k8 && m) {
      TORCH_CHECK(m->is_contiguous() && m->scalar_type() == torch::kFloat && m->sizes() == d.sizes(), "m: float32, shaped like d");
    }
  }
  check_operands(d, m, kind, n, M, bias, epilogue, other);
  auto y = torch::empty({M, n}, x.options());
  const bool binary = epilogue == MUL || epilogue == ADD;
  PanelArgs a{x.data_ptr<float>(), x.stride(0), qs.data_ptr<uint8_t>(), f32 ? nullptr : d.data_ptr<c10::Half>(),
              kind == Q4_1 ? m->data_ptr<c10::Half>() : nullptr, K / bw, n, bias ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>(),
              y.stride(0), binary ? other->data_ptr<float>() : nullptr, binary ? other->stride(0) : 0, kind, epilogue, nullptr,
              f32 ? d.data_ptr<float>() : nullptr, k8 && m ? m->data_ptr<float>() : nullptr, k4 ? m->data_ptr<uint8_t>() : nullptr,
              kind == Z4 || kind == Z8 ? m->data_ptr<uint8_t>() : nullptr, nullptr, nullptr, nullptr, nullptr};
  const Isa chosen = pick(isa);
  const bool nibbles = four_bit(kind);
  const bool extended = chosen >= Isa::AVX512_VNNI;
  const bool amx = chosen == Isa::AMX && kind != K8 && kind != F8 && M >= AMX_MIN_ROWS;  // (F8: the float paths)
  const bool vnni = !amx && extended && (kind == Q8_0 || kind == Z8 || (nibbles && M > 0));
  std::vector<float> xsum, xs;
  std::vector<uint16_t> xsplit;
  std::vector<int16_t> xq;
  const float* xp = x.data_ptr<float>();
  // The factored paths (one or two activation rows, 4-bit kinds; VNNI) need each block's activation
  // sum: made once per call for every panel. Only then: for a prefill-sized M the float path's serial
  // pass would cost more than it saves (it did: 0.82x offline throughput when it ran for every call).
  if (amx) {  // the rows padded to whole tiles, with zeros
    const int64_t padded = (M + AMX_TILE_ROWS - 1) / AMX_TILE_ROWS * AMX_TILE_ROWS;
    xsplit.assign(2 * padded * K, 0);
    split_bf16(xp, x.stride(0), M, K, xsplit.data(), xsplit.data() + padded * K);
    a.xhi = xsplit.data();
    a.xlo = xsplit.data() + padded * K;
    // Passes of rows whose x_hi and x_lo (4 bytes per value) take about 1 MiB of L2.
    gguf_linear_amx(a, M, P, std::max<int64_t>(4, (1 << 20) / (4 * K * AMX_TILE_ROWS)) * AMX_TILE_ROWS);
    return y;
  }
  if (vnni) {
    xsum.resize(M * (K / QK));
    xs.resize(M * (K / QK));
    xq.resize(M * K);
    quantize_int16(xp, x.stride(0), M, K, xq.data(), xs.data(), xsum.data());
    a.xq = xq.data();
    a.xs = xs.data();
  } else if (nibbles && M <= 2) {
    xsum.resize(M * (K / QK));
    for (int64_t r = 0; r < M; ++r)
      for (int64_t b = 0; b < K / QK; ++b) {
        float s = 0.0f;
        for (int64_t k = 0; k < QK; ++k) s += xp[r * x.stride(0) + b * QK + k];
        xsum[r * (K / QK) + b] = s;
      }
  }
  a.xsum = xsum.empty() ? nullptr : xsum.data();
  const PanelFn panel_fn = vnni ? panel_vnni : chosen >= Isa::AVX512 ? panel_avx512 : chosen == Isa::AVX2 ? panel_avx2 : panel_scalar;
  const int64_t tile = vnni ? PANEL_ROWS_VNNI : chosen >= Isa::AVX512 ? PANEL_ROWS_512 : chosen == Isa::AVX2 ? PANEL_ROWS_AVX2 : ROW_TILE;
  const int64_t step = chosen >= Isa::AVX512 ? 2 : 1;  // panels per call
  const int64_t calls = (P + step - 1) / step;
  kvpilot::WorkQueue work(calls, kvpilot::chunk_for(calls));
  kvpilot::on_threads(calls, [&] {
    for (int64_t s0, s1; work.claim(s0, s1);)
      for (int64_t s = s0; s < s1; ++s)
        for (int64_t r0 = 0; r0 < M; r0 += tile) panel_fn(a, r0, std::min(tile, M - r0), s * step);
  });
  return y;
}
