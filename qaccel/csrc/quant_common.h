// Scalar building blocks shared by the C++ (CPU) and CUDA codecs.
//
// Each function mirrors one step of the specification in qaccel/quant/reference.py (module
// docstring) and qaccel/quant/_rng.py, bit for bit. Everything here is plain integer or IEEE
// arithmetic with round-to-nearest-even; the builds disable FMA contraction (-ffp-contract=off,
// nvcc --fmad=false) because a fused multiply-add rounds once where the reference rounds twice.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define QACCEL_HD __host__ __device__ __forceinline__
#else
#define QACCEL_HD inline
#endif

namespace qaccel {

// ---- bit casts -------------------------------------------------------------------------------

QACCEL_HD uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

QACCEL_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

QACCEL_HD float bf16_bits_to_float(uint16_t bits) { return bits_float(static_cast<uint32_t>(bits) << 16); }

QACCEL_HD bool is_nonfinite_bits(uint32_t bits) { return (bits & 0x7F800000u) == 0x7F800000u; }

// Order-preserving map of a float's bits to int32 (-0.0 sorts just below +0.0). Bucket min/max are
// integer reductions over these keys: vectorizable, and every backend picks the same zero.
// NaN/Inf sort outside the finite range; callers track non-finite buckets separately.
QACCEL_HD int32_t ordered_key(float value) {
  const int32_t bits = static_cast<int32_t>(float_bits(value));
  return bits ^ ((bits >> 31) & 0x7FFFFFFF);
}

QACCEL_HD float key_to_float(int32_t key) {
  return bits_float(static_cast<uint32_t>(key ^ ((key >> 31) & 0x7FFFFFFF)));
}

// ---- counter-based RNG (_rng.py) ---------------------------------------------------------------

QACCEL_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// key(seed, i) depends on i only through hi32(i): compute it once per run of indices.
QACCEL_HD uint32_t rng_key(uint64_t seed, uint32_t index_hi) {
  return static_cast<uint32_t>(seed) ^ lowbias32(static_cast<uint32_t>(seed >> 32) + index_hi);
}

// hash(seed, i) = lowbias32(lo32(i) ^ key(seed, i)): its top 24 bits give u, its bit 0 the rotation sign.
QACCEL_HD uint32_t rng_hash(uint32_t key, uint32_t index_lo) { return lowbias32(index_lo ^ key); }

// u(seed, i) in [0, 1): top 24 bits of the hash times 2**-24 (exact in fp32 and fp64).
QACCEL_HD double hash_uniform(uint32_t hash) { return static_cast<double>(hash >> 8) * 5.9604644775390625e-08; }

QACCEL_HD double rng_uniform(uint32_t key, uint32_t index_lo) { return hash_uniform(rng_hash(key, index_lo)); }

// d_i of the Hadamard rotation (reference.py step 8): -1.0 when bit 0 of the hash is set, else +1.0.
// Built from bits so no compiler turns `x * d` into a negation, which would flip a NaN's sign where
// the reference's multiplication keeps it.
QACCEL_HD double rotation_sign(uint32_t hash) {
  const uint64_t bits = 0x3FF0000000000000ull | (static_cast<uint64_t>(hash & 1u) << 63);
#if defined(__CUDA_ARCH__)
  return __longlong_as_double(static_cast<long long>(bits));
#else
  double value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// ---- directed rounding of the metadata (reference.round_down_to / round_up_to) -----------------

// One fp32 ulp toward +inf (std::nextafter(f, +inf) for non-NaN f).
QACCEL_HD float next_up_f32(float value) {
  uint32_t bits = float_bits(value);
  if ((bits & 0x7FFFFFFFu) == 0) return bits_float(1u);  // +-0 -> smallest subnormal
  if (bits == 0x7F800000u) return value;                 // +inf stays
  return bits_float((bits & 0x80000000u) ? bits - 1u : bits + 1u);
}

// Smallest fp32 >= value (value finite or +-0).
QACCEL_HD float ceil_to_f32(double value) {
  float rounded = static_cast<float>(value);
  if (static_cast<double>(rounded) < value) rounded = next_up_f32(rounded);
  return rounded;
}

// Largest bf16 <= value, returned as its bits. Truncating the low 16 bits rounds toward zero.
QACCEL_HD uint16_t floor_to_bf16_bits(float value) {
  uint32_t bits = float_bits(value);
  uint32_t high = bits >> 16;
  if ((bits & 0xFFFFu) == 0 || !(bits & 0x80000000u)) return static_cast<uint16_t>(high);
  return static_cast<uint16_t>(high + 1u);  // negative and inexact: one ulp away from zero
}

// Smallest bf16 >= value. For a double d, ceil_bf16(d) == ceil_bf16(ceil_f32(d)) because every
// bf16 is an fp32, so callers pass ceil_to_f32(d).
QACCEL_HD uint16_t ceil_to_bf16_bits(float value) {
  uint32_t bits = float_bits(value);
  uint32_t high = bits >> 16;
  if ((bits & 0xFFFFu) == 0 || (bits & 0x80000000u)) return static_cast<uint16_t>(high);
  return static_cast<uint16_t>(high + 1u);  // positive and inexact: carries into the exponent
}

constexpr uint16_t kBf16QuietNaN = 0x7FC0u;  // what torch.full(..., nan, dtype=bfloat16) stores
constexpr uint32_t kF32QuietNaN = 0x7FC00000u;

// ---- per-bucket grid (steps 1-4 of the specification) ---------------------------------------

struct BucketGrid {
  float lo;      // lo_m, a value of the metadata dtype
  float scale;   // scale_m, a value of the metadata dtype; NaN for a non-finite bucket
  double lo64;   // double(lo_m)
  double inv;    // 1/scale_m, 0 for scale_m == 0, NaN for a non-finite bucket (encodes as code 0)
};

// min/max are the bucket's fp32 extremes; nonfinite is true when any element is NaN or +-Inf.
QACCEL_HD BucketGrid make_grid(float min_value, float max_value, bool nonfinite, int bits, bool meta_bf16) {
  BucketGrid grid;
  if (nonfinite) {
    grid.lo = 0.0f;
    grid.scale = bits_float(kF32QuietNaN);
    grid.lo64 = 0.0;
    grid.inv = static_cast<double>(grid.scale);
    return grid;
  }
  const double levels = static_cast<double>((1 << bits) - 1);
  float lo = min_value;
  if (meta_bf16) lo = bits_float(static_cast<uint32_t>(floor_to_bf16_bits(lo)) << 16);
  // double difference: hi - lo never overflows; division rounds once, then outward to the dtype.
  float scale = ceil_to_f32((static_cast<double>(max_value) - static_cast<double>(lo)) / levels);
  if (meta_bf16) scale = bits_float(static_cast<uint32_t>(ceil_to_bf16_bits(scale)) << 16);
  grid.lo = lo;
  grid.scale = scale;
  grid.lo64 = static_cast<double>(lo);
  const double scale64 = static_cast<double>(scale);
  grid.inv = scale64 > 0.0 ? 1.0 / scale64 : 0.0;
  return grid;
}

// q = clamp(floor((x - lo) * inv + u), 0, L). The "t > 0 ? t : 0" form also sends NaN to code 0
// (non-finite bucket, or a bf16 grid whose lo overflowed to -inf).
QACCEL_HD uint32_t encode_value(double x, double lo64, double inv, double u, double levels) {
#if defined(__CUDA_ARCH__)
  double t = floor(__dadd_rn(__dmul_rn(__dsub_rn(x, lo64), inv), u));
#else
  double y = (x - lo64) * inv;
  double t = __builtin_floor(y + u);
#endif
  t = t > 0.0 ? t : 0.0;
  t = t < levels ? t : levels;
  return static_cast<uint32_t>(t);
}

// x_hat = fp32(double(lo) + double(scale) * q): the product is exact, the sum rounds once.
QACCEL_HD float decode_value(double lo64, double scale64, uint32_t code) {
#if defined(__CUDA_ARCH__)
  return __double2float_rn(__dadd_rn(lo64, __dmul_rn(scale64, static_cast<double>(code))));
#else
  return static_cast<float>(lo64 + scale64 * static_cast<double>(code));
#endif
}

// ---- packing: eight codes -> `bits` bytes, little-endian, code j at bits [bits*j, bits*j+bits) ---

QACCEL_HD void pack_group(const uint8_t* codes, int bits, uint8_t* out) {
  uint64_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) word |= static_cast<uint64_t>(codes[j]) << (bits * j);
  for (int k = 0; k < bits; ++k) out[k] = static_cast<uint8_t>(word >> (8 * k));
}

QACCEL_HD uint64_t load_group(const uint8_t* packed, int bits) {
  uint64_t word = 0;
  for (int k = 0; k < bits; ++k) word |= static_cast<uint64_t>(packed[k]) << (8 * k);
  return word;
}

}  // namespace qaccel
