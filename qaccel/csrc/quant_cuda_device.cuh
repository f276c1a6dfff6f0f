// Device-side element access, packed-code I/O and launch helpers of the CUDA codecs
// (quant_cuda.cu). CUDA runtime only, like the kernels; included once, by quant_cuda.cu.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "quant_common.h"
#include "quant_cuda.h"

namespace qaccel_cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;

// ---- element access ----------------------------------------------------------------------------

// kDtype: the Dtype code (quant_cuda.h), also the payload table's element dtype code.
struct F32 {
  using T = float;
  static constexpr int kDtype = 0;
  static __device__ __forceinline__ float load(const T* p, int64_t i) { return p[i]; }
  static __device__ __forceinline__ void store(T* p, int64_t i, float v) { p[i] = v; }
};

struct BF16 {
  using T = uint16_t;
  static constexpr int kDtype = 1;
  static __device__ __forceinline__ float load(const T* p, int64_t i) { return qaccel::bf16_bits_to_float(p[i]); }
  static __device__ __forceinline__ uint16_t bits(float v) {
    // Round to nearest even as c10::BFloat16(float) does on the device (NaN -> 0x7FFF).
    const uint32_t u = qaccel::float_bits(v);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FFFu;
    return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
  static __device__ __forceinline__ void store(T* p, int64_t i, float v) { p[i] = bits(v); }
};

struct F16 {
  using T = uint16_t;
  static constexpr int kDtype = 2;
  static __device__ __forceinline__ float load(const T* p, int64_t i) { return __half2float(__ushort_as_half(p[i])); }
  static __device__ __forceinline__ uint16_t bits(float v) { return __half_as_ushort(__float2half_rn(v)); }
  static __device__ __forceinline__ void store(T* p, int64_t i, float v) { p[i] = bits(v); }
};

// Eight consecutive elements starting at a multiple of 8 from a 16-byte aligned base.
__device__ __forceinline__ void load8(const float* p, float v[8]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
}

template <typename Tag>
__device__ __forceinline__ void load8_16bit(const uint16_t* p, float v[8]) {
  const uint4 w = *reinterpret_cast<const uint4*>(p);
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t pair[2] = {static_cast<uint16_t>(words[k] & 0xFFFFu), static_cast<uint16_t>(words[k] >> 16)};
    v[2 * k] = Tag::load(pair, 0);
    v[2 * k + 1] = Tag::load(pair, 1);
  }
}

template <typename Tag>
__device__ __forceinline__ void load_group(const typename Tag::T* x, int64_t e0, int64_t end, float v[8]) {
  if (e0 + 8 <= end) {
    if constexpr (sizeof(typename Tag::T) == 4) {
      load8(x + e0, v);
    } else {
      load8_16bit<Tag>(x + e0, v);
    }
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = e0 + j < end ? Tag::load(x, e0 + j) : 0.0f;
  }
}

// `bits` bytes of one group; groups of 2, 4 or 8 bytes are naturally aligned in the code buffer.
__device__ __forceinline__ void store_packed(uint8_t* dst, uint64_t word, int bits) {
  switch (bits) {
    case 8: *reinterpret_cast<unsigned long long*>(dst) = word; break;
    case 4: *reinterpret_cast<uint32_t*>(dst) = static_cast<uint32_t>(word); break;
    case 2: *reinterpret_cast<uint16_t*>(dst) = static_cast<uint16_t>(word); break;
    default:
      for (int k = 0; k < bits; ++k) dst[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

// Word loads only when the caller's code buffer is aligned (it may be a slice of a receive buffer).
__device__ __forceinline__ uint64_t load_packed(const uint8_t* src, int bits, bool aligned) {
  if (!aligned) return qaccel::load_group(src, bits);
  switch (bits) {
    case 8: return *reinterpret_cast<const unsigned long long*>(src);
    case 4: return *reinterpret_cast<const uint32_t*>(src);
    case 2: return *reinterpret_cast<const uint16_t*>(src);
    default: return qaccel::load_group(src, bits);
  }
}

// ---- metadata and decoded-output access ------------------------------------------------------

struct MetaF32 {
  using T = float;
  static __device__ __forceinline__ double load(const T* p, int64_t i) { return static_cast<double>(p[i]); }
};
struct MetaBF16 {
  using T = uint16_t;
  static __device__ __forceinline__ double load(const T* p, int64_t i) {
    return static_cast<double>(qaccel::bf16_bits_to_float(p[i]));
  }
};

template <typename OutTag>
__device__ __forceinline__ void store8(typename OutTag::T* p, const float v[8]) {
  if constexpr (sizeof(typename OutTag::T) == 4) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t words[4];
#pragma unroll
    for (int k = 0; k < 4; ++k)
      words[k] = static_cast<uint32_t>(OutTag::bits(v[2 * k])) | (static_cast<uint32_t>(OutTag::bits(v[2 * k + 1])) << 16);
    *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
  }
}

// ---- Hadamard rotation (reference.py steps 7-10): one warp rotates one block in shared memory ----

// Warps of a rotating kernel's block: each holds one block of doubles, so 4 x 8 KiB stay under the
// 48 KiB of static shared memory.
constexpr int kRotationThreads = 128;
constexpr int kRotationWarps = kRotationThreads / 32;
constexpr int kRotationPerLane = static_cast<int>(kMaxRotationBlock) / 32;  // block elements per lane

// Length of the next block of a bucket with `remaining` elements left: the largest power of two not
// above it, at most max_block (itself a power of two), as _types.rotation_blocks tiles a bucket.
__device__ __forceinline__ int rotation_block(int64_t remaining, int max_block) {
  if (remaining >= max_block) return max_block;
  return 1 << (63 - __clzll(static_cast<long long>(remaining)));
}

// d_i of element i of a segment encoded with `seed`: -1 when bit 0 of the rounding hash is set
// (_rng.rotation_signs; u uses the top 24 bits of the same hash).
__device__ __forceinline__ double rotation_sign(uint64_t seed, int64_t i) {
  const uint32_t key = qaccel::rng_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32));
  return (qaccel::lowbias32(static_cast<uint32_t>(i) ^ key) & 1u) ? -1.0 : 1.0;
}

// c = 1 / sqrt(b), the root and the quotient correctly rounded, as Python's 1.0 / math.sqrt(b).
__device__ __forceinline__ double rotation_scale(int block) {
  return __ddiv_rn(1.0, __dsqrt_rn(static_cast<double>(block)));
}

// The unnormalized Walsh-Hadamard butterflies over w[0, block) (shared memory, written by the warp
// and synced with __syncwarp before the call), by the whole warp: stage h = 1, 2, ..., block / 2
// maps every pair (j, j + h) with j & h == 0 to (w_j + w_{j+h}, w_j - w_{j+h}) in fp64. Each pair has
// one lane; __syncwarp orders the stages, and the last one makes w readable by every lane.
__device__ __forceinline__ void warp_butterflies(double* w, int block, int lane) {
  for (int h = 1; h < block; h <<= 1) {
    for (int pair = lane; pair < (block >> 1); pair += 32) {
      const int j = ((pair & ~(h - 1)) << 1) | (pair & (h - 1));
      const double a = w[j], b = w[j + h];
      w[j] = __dadd_rn(a, b);
      w[j + h] = __dsub_rn(a, b);
    }
    __syncwarp();
  }
}

// Forward: r_i = fp32(w_i * c) from a butterflied block.
__device__ __forceinline__ float rotated_value(double w, double c) { return __double2float_rn(__dmul_rn(w, c)); }

// Inverse: x_hat_i = fp32((w_i * c) * d_i) from a butterflied block of decoded values.
__device__ __forceinline__ float unrotated_value(double w, double c, double sign) {
  return __double2float_rn(__dmul_rn(__dmul_rn(w, c), sign));
}

// Code of element i of a run of packed codes: eight codes fill `bits` bytes read little-endian,
// so code i sits at bits [bits * i, bits * i + bits) of the byte stream (at most two bytes).
__device__ __forceinline__ uint32_t code_at(const uint8_t* codes, int64_t i, int bits) {
  const int64_t bit = i * bits;
  const uint8_t* byte = codes + (bit >> 3);
  const int shift = static_cast<int>(bit & 7);
  uint32_t word = byte[0];
  if (shift + bits > 8) word |= static_cast<uint32_t>(byte[1]) << 8;
  return (word >> shift) & ((1u << bits) - 1u);
}

// ---- launch helpers -------------------------------------------------------------------------------

int max_blocks() {
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1024;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) return 1024;
  return sms * 16;  // a grid-stride loop with a few waves of blocks keeps every SM busy
}

unsigned grid_for(int64_t work_items, int64_t items_per_block) {
  const int64_t blocks = (work_items + items_per_block - 1) / items_per_block;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < max_blocks() ? blocks : max_blocks()));
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

}  // namespace
}  // namespace qaccel_cuda
