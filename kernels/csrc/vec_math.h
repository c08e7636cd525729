// Vector math the CPU kernels share (AVX-512). Each function carries its own target attribute, so that a
// translation unit built for a lower level (its callers chosen at run time) can include it too.
#pragma once

#include <immintrin.h>

#include <cstdint>

// e^x for x <= 0 on 16 lanes (a softmax after subtracting the max, a sigmoid of -|x|): Cody-Waite
// reduction x = n*ln2 + r and a degree-6 polynomial for e^r, |rel. error| < 2e-7; scalef applies the
// 2^n exactly. glibc's vector expf is only declared under -ffast-math.
__attribute__((target("avx512f"))) inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));  // below this e^x underflows float anyway
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.98756915e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.39819994e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.33345205e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.16657981e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.66666672e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.00000000e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// x·sigmoid(x) on 16 lanes, through e^-|x| (never overflows): sigmoid = 1 / (1 + e) for x >= 0, e / (1 + e) below.
__attribute__((target("avx512f"))) inline __m512 silu16(__m512 x) {
  const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ), e, _mm512_set1_ps(1.0f));
  return _mm512_mul_ps(x, _mm512_div_ps(num, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

// e4m3fn bytes widened to floats / 2^8, exactly: each byte's fields moved into a float16's (whose subnormals
// cover e4m3's) and converted by F16C; the caller multiplies by 2^8 (15 - 7, the exponent biases'
// difference), usually folded into a scale. 8 bytes (AVX2) or 16 (AVX-512).
__attribute__((target("avx2,f16c"))) inline __m256 fp8_over256_x8(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8), _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7)));
}
__attribute__((target("avx512f,avx2,f16c"))) inline __m512 fp8_over256_x16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(_mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                         _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7)));
}
