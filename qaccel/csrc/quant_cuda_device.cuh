// Device-side element access, packed-code I/O and launch helpers of the CUDA codecs
// (quant_cuda.cu). CUDA runtime only, like the kernels; included once, by quant_cuda.cu.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "quant_common.h"

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
