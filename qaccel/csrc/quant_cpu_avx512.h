// AVX-512 encoder for the C++ codec: 16 elements per step, bit-identical to the scalar loop.
//
// Compilers do not fuse floor() with the double->int conversion, and the stochastic-rounding
// hash vectorizes poorly from scalar code (64-bit induction variables), which left the encoder
// compute bound at ~0.6 ns/value on one core. Here the hash runs on 16 uint32 lanes and
// floor+convert is one instruction with round-toward-negative-infinity, which equals
// (int)floor(s) for every s in int32 range; NaN converts to INT_MIN, which the clamp to [0, L]
// sends to 0 exactly like the scalar `t > 0 ? t : 0`. Every double operation (convert, subtract,
// multiply, add) is the same IEEE operation, in the same order, as in quant_common.h.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#define QACCEL_HAVE_AVX512 1

namespace qaccel_avx512 {

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));  // bf16 is the top half of an fp32
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // exact
}

inline __m512i lowbias32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// Encodes the largest multiple of 16 elements of [0, n); returns how many it encoded.
// u(i) = (lowbias32((first + k) ^ key) >> 8) * 2**-24, or 0.5 when nearest.
template <typename T>
int64_t encode_run(const T* xs, int64_t n, double lo64, double inv, bool nearest, uint32_t key, uint32_t first,
                   int levels, uint8_t* out) {
  const __m512d lo_v = _mm512_set1_pd(lo64), inv_v = _mm512_set1_pd(inv);
  const __m512d two_m24 = _mm512_set1_pd(5.9604644775390625e-08), half = _mm512_set1_pd(0.5);
  const __m512i key_v = _mm512_set1_epi32(static_cast<int>(key)), levels_v = _mm512_set1_epi32(levels);
  const __m512i zero = _mm512_setzero_si512(), sixteen = _mm512_set1_epi32(16);
  __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 x = load16(xs + k);
    const __m512d x_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d x_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    __m512d u_lo = half, u_hi = half;
    if (!nearest) {
      const __m512i bits = _mm512_srli_epi32(lowbias32(_mm512_xor_si512(index, key_v)), 8);
      u_lo = _mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_castsi512_si256(bits)), two_m24);
      u_hi = _mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(bits, 1)), two_m24);
      index = _mm512_add_epi32(index, sixteen);
    }
    const __m512d s_lo = _mm512_add_pd(_mm512_mul_pd(_mm512_sub_pd(x_lo, lo_v), inv_v), u_lo);
    const __m512d s_hi = _mm512_add_pd(_mm512_mul_pd(_mm512_sub_pd(x_hi, lo_v), inv_v), u_hi);
    const __m256i q_lo = _mm512_cvt_roundpd_epi32(s_lo, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m256i q_hi = _mm512_cvt_roundpd_epi32(s_hi, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(q_lo), q_hi, 1);
    q = _mm512_min_epi32(_mm512_max_epi32(q, zero), levels_v);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k), _mm512_cvtepi32_epi8(q));
  }
  return k;
}

}  // namespace qaccel_avx512
#endif
