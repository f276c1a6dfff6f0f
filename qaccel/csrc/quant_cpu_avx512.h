// AVX-512 encoder and Hadamard rotation for the C++ codec, bit-identical to the scalar loops.
//
// Compilers do not fuse floor() with the double->int conversion, and the stochastic-rounding
// hash vectorizes poorly from scalar code (64-bit induction variables), which left the encoder
// compute bound at ~0.6 ns/value on one core. Here the hash runs on 16 uint32 lanes and
// floor+convert is one instruction with round-toward-negative-infinity, which equals
// (int)floor(s) for every s in int32 range; NaN converts to INT_MIN, which the clamp to [0, L]
// sends to 0 exactly like the scalar `t > 0 ? t : 0`. Every double operation (convert, subtract,
// multiply, add) is the same IEEE operation, in the same order, as in quant_common.h.
#pragma once

#include <cstdint>

#include "quant_common.h"

namespace qaccel_cpu {

// What a rotation kernel does with a block: rotate source values forward (encode), or rotate decoded
// values back, overwriting or adding to an fp32 destination.
enum class RotationMode { kForward, kInverse, kInverseAdd };

// The decoded values y_k = fp32(double(lo) + double(scale) * q_k) of one bucket's codes, read by an
// inverse rotation as its input (so they never go through memory). 16 bytes, so it is passed in
// registers (the metadata values are fp32 or bf16, exact as floats).
struct DecodedCodes {
  const uint8_t* codes;
  float lo, scale;

  DecodedCodes operator+(int64_t k) const { return {codes + k, lo, scale}; }
  float operator[](int64_t k) const {
    return qaccel::decode_value(static_cast<double>(lo), static_cast<double>(scale), codes[k]);
  }
};

// hash(seed, i) for consecutive indices sharing hi32(i) (one RNG key), computed where a kernel
// reads them: an inverse rotation needs them only for its signs. A kernel reads hashes from this or
// from an array (uint32_t*).
struct CounterHashes {
  uint32_t key, first;

  CounterHashes operator+(int64_t k) const { return {key, first + static_cast<uint32_t>(k)}; }
  uint32_t operator[](int64_t k) const { return qaccel::rng_hash(key, first + static_cast<uint32_t>(k)); }
};

}  // namespace qaccel_cpu

#if defined(__AVX512F__)
#include <immintrin.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#define QACCEL_HAVE_AVX512 1

namespace qaccel_avx512 {

using qaccel_cpu::CounterHashes;
using qaccel_cpu::DecodedCodes;
using qaccel_cpu::RotationMode;

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));  // bf16 is the top half of an fp32
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));  // exact
}
inline __m512 concat(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}
inline __m256 decode8(__m256i q, __m512d lo, __m512d scale) {  // qaccel::decode_value on 8 lanes
  return _mm512_cvtpd_ps(_mm512_add_pd(lo, _mm512_mul_pd(scale, _mm512_cvtepi32_pd(q))));
}
inline __m512 load16(const DecodedCodes& x) {
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x.codes)));
  const __m512d lo = _mm512_set1_pd(static_cast<double>(x.lo));
  const __m512d scale = _mm512_set1_pd(static_cast<double>(x.scale));
  const __m256 y_lo = decode8(_mm512_castsi512_si256(q), lo, scale);
  const __m256 y_hi = decode8(_mm512_extracti64x4_epi64(q, 1), lo, scale);
  return concat(y_lo, y_hi);
}

inline __m512i lowbias32(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7FEB352D));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(static_cast<int>(0x846CA68Bu)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

inline __m512i lane_index(uint32_t first) {
  return _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
}

// Encodes the largest multiple of 16 elements of [0, n); returns how many it encoded.
// u(i) = (hash(first + k) >> 8) * 2**-24, or 0.5 when nearest; the hash is lowbias32((first + k) ^ key),
// or read from hashes[k] when kHashed (a rotated encode computed it already for the signs).
template <bool kHashed, typename T>
int64_t encode_run(const T* xs, int64_t n, double lo64, double inv, bool nearest, uint32_t key, uint32_t first,
                   const uint32_t* hashes, int levels, uint8_t* out) {
  const __m512d lo_v = _mm512_set1_pd(lo64), inv_v = _mm512_set1_pd(inv);
  const __m512d two_m24 = _mm512_set1_pd(5.9604644775390625e-08), half = _mm512_set1_pd(0.5);
  const __m512i key_v = _mm512_set1_epi32(static_cast<int>(key)), levels_v = _mm512_set1_epi32(levels);
  const __m512i zero = _mm512_setzero_si512(), sixteen = _mm512_set1_epi32(16);
  __m512i index = lane_index(first);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 x = load16(xs + k);
    const __m512d x_lo = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
    const __m512d x_hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
    __m512d u_lo = half, u_hi = half;
    if (!nearest) {
      __m512i hash;
      if constexpr (kHashed) {
        hash = _mm512_loadu_si512(hashes + k);
      } else {
        hash = lowbias32(_mm512_xor_si512(index, key_v));
        index = _mm512_add_epi32(index, sixteen);
      }
      const __m512i bits = _mm512_srli_epi32(hash, 8);
      u_lo = _mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_castsi512_si256(bits)), two_m24);
      u_hi = _mm512_mul_pd(_mm512_cvtepu32_pd(_mm512_extracti64x4_epi64(bits, 1)), two_m24);
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

// out[k] = lowbias32((first + k) ^ key) for the largest multiple of 16 of [0, n); returns how many.
inline int64_t fill_hashes(uint32_t key, uint32_t first, int64_t n, uint32_t* out) {
  const __m512i key_v = _mm512_set1_epi32(static_cast<int>(key)), sixteen = _mm512_set1_epi32(16);
  __m512i index = lane_index(first);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    _mm512_storeu_si512(out + k, lowbias32(_mm512_xor_si512(index, key_v)));
    index = _mm512_add_epi32(index, sixteen);
  }
  return k;
}

// ---- Hadamard rotation of one power-of-two block (reference.hadamard_rotate, steps 9-10) ----------
//
// Every butterfly is the reference's IEEE double add or subtract of the same two operands, so the
// order in which independent butterflies run does not matter; only the data movement differs.
// Stages h = 1, 2, 4, 8 run on pairs of vectors (16 elements) as Pease's constant-geometry
// network: split the 16 into even and odd positions, then (even + odd, even - odd). Position p
// then holds element rotr4(p), so after the 4 stages the order is natural again, at one permute per
// vector and stage (the first split is a single fp32 permute before widening). Stages h >= 16 pair
// whole vectors. The signs d_i act on fp32 values, 16 at a time, where that is exact (see below).

inline __m512i load_hashes16(const uint32_t* hashes) { return _mm512_loadu_si512(hashes); }
inline __m512i load_hashes16(const CounterHashes& hashes) {
  return lowbias32(_mm512_xor_si512(lane_index(hashes.first), _mm512_set1_epi32(static_cast<int>(hashes.key))));
}

// Bit 31 set where bit 0 of the hash is (d_i = -1), for 16 elements.
template <typename Hashes>
inline __m512i sign_bits16(Hashes hashes) { return _mm512_slli_epi32(load_hashes16(hashes), 31); }

// Elements [0, 16) of a block after the first stage (h = 1), in Pease order: a = (w0 + w1, w2 + w3, ...),
// b = (w0 - w1, ...). Forward, w = double(x) * d is taken as a sign flip of fp32 x: exact, and unlike
// the multiplication it flips a NaN's sign too, which changes nothing: a NaN makes its whole block,
// hence its bucket, non-finite, and such a bucket encodes without looking at its values.
template <RotationMode kMode, typename Source, typename Hashes>
inline void first_stage(Source in, Hashes hashes, __m512d& a, __m512d& b) {
  __m512 x = load16(in);
  if constexpr (kMode == RotationMode::kForward) {
    x = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign_bits16(hashes)));
  }
  const __m512 split =
      _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), x);
  const __m512d even = _mm512_cvtps_pd(_mm512_castps512_ps256(split));
  const __m512d odd = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(split), 1)));
  a = _mm512_add_pd(even, odd);
  b = _mm512_sub_pd(even, odd);
}

inline void pease_stage(__m512d& a, __m512d& b) {
  const __m512i even = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14), odd = _mm512_setr_epi64(1, 3, 5, 7, 9, 11, 13, 15);
  const __m512d p = _mm512_permutex2var_pd(a, even, b), q = _mm512_permutex2var_pd(a, odd, b);
  a = _mm512_add_pd(p, q);
  b = _mm512_sub_pd(p, q);
}

// Elements [0, 16) of a block, natural order, after the last stage: lo holds [0, 8), hi [8, 16).
// Forward: r = fp32(w * c). Inverse: x_hat = fp32((w * c) * d), computed as fp32(w * c) * d in fp32:
// negation commutes with rounding to nearest, and both multiplications return a NaN operand as it
// is, so the bits agree, NaN included. kInverseAdd stores out + x_hat (fp32, out first).
template <RotationMode kMode, typename Hashes>
inline void last_output(__m512d lo, __m512d hi, __m512d c, Hashes hashes, float* out) {
  const __m256 lo32 = _mm512_cvtpd_ps(_mm512_mul_pd(lo, c)), hi32 = _mm512_cvtpd_ps(_mm512_mul_pd(hi, c));
  if constexpr (kMode == RotationMode::kForward) {
    _mm256_storeu_ps(out, lo32);
    _mm256_storeu_ps(out + 8, hi32);
  } else {
    __m512 v = concat(lo32, hi32);
    const __m512i one = _mm512_set1_epi32(0x3F800000);  // 1.0f
    v = _mm512_mul_ps(v, _mm512_castsi512_ps(_mm512_or_si512(sign_bits16(hashes), one)));
    if constexpr (kMode == RotationMode::kInverseAdd) v = _mm512_add_ps(_mm512_loadu_ps(out), v);
    _mm512_storeu_ps(out, v);
  }
}

// Stages pairing vector j with j + s for s = first, 2 * first, ... < count (j & s == 0).
template <int kCount, int kFirst>
inline void vector_stages(__m512d* v) {
#pragma GCC unroll 8
  for (int s = kFirst; s < kCount; s *= 2) {
#pragma GCC unroll 16
    for (int j = 0; j < kCount; ++j) {
      if (j & s) continue;
      const __m512d a = v[j], c = v[j + s];
      v[j] = _mm512_add_pd(a, c);
      v[j + s] = _mm512_sub_pd(a, c);
    }
  }
}

// Loads 8 * kVectors consecutive elements and runs stages h = 1 .. 4 * kVectors on them.
template <int kVectors, RotationMode kMode, typename Source, typename Hashes>
inline void load_block(Source in, Hashes hashes, __m512d* v) {
#pragma GCC unroll 8
  for (int j = 0; j < kVectors; j += 2) {
    first_stage<kMode>(in + 8 * j, hashes + 8 * j, v[j], v[j + 1]);
    pease_stage(v[j], v[j + 1]);
    pease_stage(v[j], v[j + 1]);
    pease_stage(v[j], v[j + 1]);
  }
  vector_stages<kVectors, 2>(v);
}

// A block of 8 * kVectors <= 128 elements, in registers. `in` is a source pointer (float, bfloat16,
// half) or DecodedCodes; `out` may be `in`.
template <int kVectors, RotationMode kMode, typename Source, typename Hashes>
void rotate_in_registers(Source in, Hashes hashes, __m512d c, float* out) {
  __m512d v[kVectors];
  load_block<kVectors, kMode>(in, hashes, v);
#pragma GCC unroll 8
  for (int j = 0; j < kVectors; j += 2) last_output<kMode>(v[j], v[j + 1], c, hashes + 8 * j, out + 8 * j);
}

// A block of 128 * kGroups elements: stages h <= 64 per group of 128 into `w` (doubles), then the
// stages across groups on pairs of columns (kGroups vectors each, 16 consecutive elements per
// group). `out` may be `in`.
template <int kGroups, RotationMode kMode, typename Source, typename Hashes>
void rotate_in_two_passes(Source in, Hashes hashes, __m512d c, float* out, double* w) {
  for (int g = 0; g < kGroups; ++g) {
    __m512d v[16];
    load_block<16, kMode>(in + 128 * g, hashes + 128 * g, v);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) _mm512_storeu_pd(w + 128 * g + 8 * j, v[j]);
  }
  for (int column = 0; column < 128; column += 16) {
    __m512d lo[kGroups], hi[kGroups];
#pragma GCC unroll 8
    for (int g = 0; g < kGroups; ++g) {
      lo[g] = _mm512_loadu_pd(w + 128 * g + column);
      hi[g] = _mm512_loadu_pd(w + 128 * g + column + 8);
    }
    vector_stages<kGroups, 1>(lo);
    vector_stages<kGroups, 1>(hi);
#pragma GCC unroll 8
    for (int g = 0; g < kGroups; ++g) {
      const int64_t at = 128 * g + column;
      last_output<kMode>(lo[g], hi[g], c, hashes + at, out + at);
    }
  }
}

// Rotates one block of `length` elements; false (nothing done) for lengths it has no kernel for.
// `w` holds 1024 doubles.
template <RotationMode kMode, typename Source, typename Hashes>
bool rotate_block(Source in, int64_t length, Hashes hashes, double c64, float* out, double* w) {
  const __m512d c = _mm512_set1_pd(c64);
  switch (length) {
    case 16: rotate_in_registers<2, kMode>(in, hashes, c, out); return true;
    case 32: rotate_in_registers<4, kMode>(in, hashes, c, out); return true;
    case 64: rotate_in_registers<8, kMode>(in, hashes, c, out); return true;
    case 128: rotate_in_registers<16, kMode>(in, hashes, c, out); return true;
    case 256: rotate_in_two_passes<2, kMode>(in, hashes, c, out, w); return true;
    case 512: rotate_in_two_passes<4, kMode>(in, hashes, c, out, w); return true;
    case 1024: rotate_in_two_passes<8, kMode>(in, hashes, c, out, w); return true;
    default: return false;
  }
}

}  // namespace qaccel_avx512
#endif
