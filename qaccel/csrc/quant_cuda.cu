// CUDA codecs: bit-identical to qaccel/quant/reference.py (see quant_common.h for the maths).
//
// Standalone on purpose: only the CUDA runtime and quant_common.h, no torch headers, so this file
// compiles in seconds with nvcc even where torch is a CPU-only wheel (which lacks the generated
// c10/cuda headers); quant_cuda_binding.cpp is the thin torch layer. Build with --fmad=false.
//
// Quantize, fast path (bucket % 8 == 0 and x 16-byte aligned): one warp per bucket; each lane
// loads whole groups of 8 elements with 16-byte loads, keeps them in registers (buckets up to
// 1024 elements), the warp reduces min/max with shuffles, every lane derives the grid (one
// division per bucket, never per element) and encodes and packs its groups, so x is read once.
// Other buckets: a warp-per-bucket grid pass into a double workspace, then one thread per group.
// Dequantize: one thread per group of 8 codes, 16-byte stores of the decoded values.
// Fused payloads (encode_payloads, decode_payloads, sum_payloads): one launch per call over every
// slot and segment, driven by the layout table of quant_payload.h (see the section's comment); a
// rotated table (Hadamard rotation per bucket) takes separate kernels (see theirs).
#include "quant_common.h"
#include "quant_cuda.h"
#include "quant_cuda_device.cuh"

namespace qaccel_cuda {
namespace {

using qaccel::BucketGrid;

// Min/max over order-preserving integer keys (quant_common.h), as the C++ backend does.
struct MinMax {
  int32_t lo = INT32_MAX;
  int32_t hi = INT32_MIN;
  uint32_t bad = 0;

  __device__ __forceinline__ void add(float v) {
    const int32_t key = qaccel::ordered_key(v);
    lo = min(lo, key);
    hi = max(hi, key);
    bad |= qaccel::is_nonfinite_bits(qaccel::float_bits(v));
  }

  __device__ __forceinline__ void warp_reduce() {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      lo = min(lo, __shfl_xor_sync(kFullMask, lo, offset));
      hi = max(hi, __shfl_xor_sync(kFullMask, hi, offset));
      bad |= __shfl_xor_sync(kFullMask, bad, offset);
    }
  }

  __device__ __forceinline__ BucketGrid grid(int bits, bool meta_bf16) const {
    return qaccel::make_grid(qaccel::key_to_float(lo), qaccel::key_to_float(hi), bad != 0, bits, meta_bf16);
  }
};

__device__ __forceinline__ void store_meta(const BucketGrid& grid, bool meta_bf16, void* lo, void* scale, int64_t b) {
  if (meta_bf16) {
    static_cast<uint16_t*>(lo)[b] = static_cast<uint16_t>(qaccel::float_bits(grid.lo) >> 16);
    static_cast<uint16_t*>(scale)[b] =
        isnan(grid.scale) ? qaccel::kBf16QuietNaN : static_cast<uint16_t>(qaccel::float_bits(grid.scale) >> 16);
  } else {
    static_cast<float*>(lo)[b] = grid.lo;
    static_cast<float*>(scale)[b] = grid.scale;
  }
}

// Codes of the group starting at e0 (< end) under one grid; the group never crosses hi32(index).
__device__ __forceinline__ uint64_t encode_group(const float v[8], int64_t e0, int64_t end, const BucketGrid& grid,
                                                 bool nearest, uint64_t seed, int bits, double levels) {
  const uint32_t key = qaccel::rng_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(e0) >> 32));
  uint64_t word = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const double u = nearest ? 0.5 : qaccel::rng_uniform(key, static_cast<uint32_t>(e0 + j));
    const uint32_t code = qaccel::encode_value(static_cast<double>(v[j]), grid.lo64, grid.inv, u, levels);
    word |= static_cast<uint64_t>(e0 + j < end ? code : 0u) << (bits * j);
  }
  return word;
}

// ---- quantize: fused warp-per-bucket path ----------------------------------------------------

template <typename Tag, int kGroupsPerLane>  // 0: re-read the bucket instead of keeping registers
__global__ void __launch_bounds__(kThreads) quantize_fused_kernel(const typename Tag::T* __restrict__ x, int64_t numel,
                                                                  int bits, int64_t bucket, int64_t num_buckets,
                                                                  bool nearest, uint64_t seed, bool meta_bf16,
                                                                  void* lo, void* scale, uint8_t* __restrict__ codes) {
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const double levels = static_cast<double>((1 << bits) - 1);
  for (int64_t b = first_warp; b < num_buckets; b += warps) {
    const int64_t begin = b * bucket;
    const int64_t end = min(numel, begin + bucket);
    const int64_t groups = (end - begin + 7) >> 3;
    MinMax extremes;
    constexpr int kKept = kGroupsPerLane > 0 ? kGroupsPerLane : 1;
    float kept[kKept][8];
    if constexpr (kGroupsPerLane > 0) {
#pragma unroll
      for (int k = 0; k < kGroupsPerLane; ++k) {
        const int64_t g = lane + 32 * k;
        if (g < groups) {
          const int64_t e0 = begin + 8 * g;
          load_group<Tag>(x, e0, end, kept[k]);
#pragma unroll
          for (int j = 0; j < 8; ++j)
            if (e0 + j < end) extremes.add(kept[k][j]);
        }
      }
    } else {
      for (int64_t g = lane; g < groups; g += 32) {
        const int64_t e0 = begin + 8 * g;
        load_group<Tag>(x, e0, end, kept[0]);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (e0 + j < end) extremes.add(kept[0][j]);
      }
    }
    extremes.warp_reduce();
    const BucketGrid grid = extremes.grid(bits, meta_bf16);
    if (lane == 0) store_meta(grid, meta_bf16, lo, scale, b);
    if constexpr (kGroupsPerLane > 0) {
#pragma unroll
      for (int k = 0; k < kGroupsPerLane; ++k) {
        const int64_t g = lane + 32 * k;
        if (g < groups) {
          const int64_t e0 = begin + 8 * g;
          store_packed(codes + (e0 >> 3) * bits, encode_group(kept[k], e0, end, grid, nearest, seed, bits, levels), bits);
        }
      }
    } else {
      for (int64_t g = lane; g < groups; g += 32) {
        const int64_t e0 = begin + 8 * g;
        load_group<Tag>(x, e0, end, kept[0]);  // second read, mostly from L1/L2
        store_packed(codes + (e0 >> 3) * bits, encode_group(kept[0], e0, end, grid, nearest, seed, bits, levels), bits);
      }
    }
  }
}

// ---- quantize: general two-pass path --------------------------------------------------------------

template <typename Tag>
__global__ void __launch_bounds__(kThreads) bucket_grid_kernel(const typename Tag::T* __restrict__ x, int64_t numel,
                                                               int bits, int64_t bucket, int64_t num_buckets,
                                                               bool meta_bf16, void* lo, void* scale,
                                                               double* __restrict__ workspace) {
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t b = first_warp; b < num_buckets; b += warps) {
    const int64_t begin = b * bucket;
    const int64_t end = min(numel, begin + bucket);
    MinMax extremes;
    for (int64_t e = begin + lane; e < end; e += 32) extremes.add(Tag::load(x, e));
    extremes.warp_reduce();
    if (lane == 0) {
      const BucketGrid grid = extremes.grid(bits, meta_bf16);
      store_meta(grid, meta_bf16, lo, scale, b);
      workspace[2 * b] = grid.lo64;
      workspace[2 * b + 1] = grid.inv;
    }
  }
}

__device__ __forceinline__ int64_t bucket_of(int64_t index, int64_t bucket) {
  // 64-bit division is emulated on the GPU; most tensors fit the cheaper 32-bit one.
  if (index <= 0xFFFFFFFFll && bucket <= 0xFFFFFFFFll)
    return static_cast<uint32_t>(index) / static_cast<uint32_t>(bucket);
  return index / bucket;
}

template <typename Tag>
__global__ void __launch_bounds__(kThreads) encode_kernel(const typename Tag::T* __restrict__ x, int64_t numel,
                                                          int bits, int64_t bucket, bool nearest, uint64_t seed,
                                                          const double* __restrict__ workspace,
                                                          uint8_t* __restrict__ codes, int64_t groups) {
  const double levels = static_cast<double>((1 << bits) - 1);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const int64_t e0 = 8 * g;
    int64_t b = bucket_of(e0, bucket);
    int64_t offset = e0 - b * bucket;
    const uint32_t key = qaccel::rng_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(e0) >> 32));
    uint64_t word = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t e = e0 + j;
      if (e < numel) {
        const double u = nearest ? 0.5 : qaccel::rng_uniform(key, static_cast<uint32_t>(e));
        const uint32_t code = qaccel::encode_value(static_cast<double>(Tag::load(x, e)), workspace[2 * b],
                                                   workspace[2 * b + 1], u, levels);
        word |= static_cast<uint64_t>(code) << (bits * j);
      }
      if (++offset == bucket) offset = 0, ++b;
    }
    store_packed(codes + g * bits, word, bits);
  }
}

// ---- dequantize ---------------------------------------------------------------------------------

template <typename MetaTag, typename OutTag>
__global__ void __launch_bounds__(kThreads) decode_kernel(const uint8_t* __restrict__ codes,
                                                          const typename MetaTag::T* __restrict__ lo,
                                                          const typename MetaTag::T* __restrict__ scale, int bits,
                                                          int64_t bucket, typename OutTag::T* __restrict__ out,
                                                          int64_t numel, bool accumulate, bool out_aligned,
                                                          bool codes_aligned, int64_t groups) {
  const uint64_t mask = (1ull << bits) - 1ull;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups; g += stride) {
    const int64_t e0 = 8 * g;
    const uint64_t word = load_packed(codes + g * bits, bits, codes_aligned);
    int64_t b = bucket_of(e0, bucket);
    int64_t offset = e0 - b * bucket;
    float v[8];
    if (offset + 8 <= bucket) {  // the whole group lies in one bucket
      const double lo64 = MetaTag::load(lo, b), scale64 = MetaTag::load(scale, b);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        v[j] = qaccel::decode_value(lo64, scale64, static_cast<uint32_t>((word >> (bits * j)) & mask));
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const bool real = e0 + j < numel;  // padding codes may point past the last bucket
        v[j] = real ? qaccel::decode_value(MetaTag::load(lo, b), MetaTag::load(scale, b),
                                           static_cast<uint32_t>((word >> (bits * j)) & mask))
                    : 0.0f;
        if (++offset == bucket) offset = 0, ++b;
      }
    }
    const bool full = e0 + 8 <= numel;
    if (accumulate) {
      // sum in fp32, then round to the output dtype, as out.to(float32) + x_hat does
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (e0 + j < numel) v[j] = OutTag::load(out, e0 + j) + v[j];
    }
    if (full && out_aligned) {
      store8<OutTag>(out + e0, v);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
        if (e0 + j < numel) OutTag::store(out, e0 + j, v[j]);
    }
  }
}

// ---- sign codec ---------------------------------------------------------------------------------

template <typename Tag>
__global__ void __launch_bounds__(kThreads) sign_pack_kernel(const typename Tag::T* __restrict__ x,
                                                             int64_t chunk_numel, int64_t chunk_bytes,
                                                             int64_t total_bytes, uint8_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total_bytes; k += stride) {
    const int64_t chunk = k / chunk_bytes, first = (k - chunk * chunk_bytes) * 8;
    const typename Tag::T* src = x + chunk * chunk_numel + first;
    uint32_t byte = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (first + j < chunk_numel) byte |= static_cast<uint32_t>(Tag::load(src, j) >= 0.0f) << (7 - j);
    out[k] = static_cast<uint8_t>(byte);
  }
}

__global__ void __launch_bounds__(kThreads) sign_unpack_kernel(const uint8_t* __restrict__ signs,
                                                               const float* __restrict__ scales, int64_t chunk_numel,
                                                               int64_t chunk_bytes, int64_t total_bytes,
                                                               float* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total_bytes; k += stride) {
    const int64_t chunk = k / chunk_bytes, first = (k - chunk * chunk_bytes) * 8;
    const float chunk_scale = scales[chunk];
    const uint32_t byte = signs[k];
    float* dst = out + chunk * chunk_numel + first;
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (first + j < chunk_numel) dst[j] = static_cast<float>(2 * static_cast<int>((byte >> (7 - j)) & 1u) - 1) * chunk_scale;
  }
}

// ---- fused 1-bit error feedback: the element-wise passes (the reductions stay torch's) ----------

template <typename Tag>
__global__ void __launch_bounds__(kThreads) onebit_compensate_kernel(const typename Tag::T* __restrict__ x,
                                                                     int64_t numel, float* __restrict__ error,
                                                                     int64_t padded) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < padded; i += stride)
    error[i] = (i < numel ? Tag::load(x, i) : 0.0f) + error[i];  // pad(x) + error, as the reference adds
}

// One byte per thread: packs `values >= 0` and leaves `value - (+-1) * scale` in place.
__global__ void __launch_bounds__(kThreads) onebit_sign_error_kernel(float* __restrict__ values,
                                                                     const float* __restrict__ scales,
                                                                     int64_t chunk_numel, int64_t chunk_bytes,
                                                                     int64_t total_bytes, uint8_t* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < total_bytes; k += stride) {
    const int64_t chunk = k / chunk_bytes, first = (k - chunk * chunk_bytes) * 8;
    const float chunk_scale = scales[chunk];
    float* v = values + chunk * chunk_numel + first;
    uint32_t byte = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (first + j < chunk_numel) {
        const uint32_t bit = v[j] >= 0.0f;  // NaN compares false -> bit 0
        byte |= bit << (7 - j);
        // (+-1) * scale as sign_unpack_kernel multiplies it, then the difference (two fp32 roundings)
        v[j] = v[j] - static_cast<float>(2 * static_cast<int>(bit) - 1) * chunk_scale;
      }
    }
    out[k] = static_cast<uint8_t>(byte);
  }
}

template <typename Tag>
cudaError_t quantize_typed(const void* x_raw, int64_t numel, int bits, int64_t bucket, bool nearest, uint64_t seed,
                           bool meta_bf16, void* lo, void* scale, uint8_t* codes, double* workspace,
                           cudaStream_t stream) {
  const auto* x = static_cast<const typename Tag::T*>(x_raw);
  const int64_t num_buckets = (numel + bucket - 1) / bucket;
  const unsigned blocks = grid_for(num_buckets, kWarpsPerBlock);
  if (!quantize_needs_workspace(x_raw, bucket)) {
    const int64_t groups_per_lane = (bucket / 8 + 31) / 32;
#define QACCEL_FUSED(G)                                                                                  \
  quantize_fused_kernel<Tag, G><<<blocks, kThreads, 0, stream>>>(x, numel, bits, bucket, num_buckets, nearest, \
                                                                 seed, meta_bf16, lo, scale, codes)
    if (groups_per_lane <= 1) {
      QACCEL_FUSED(1);
    } else if (groups_per_lane <= 2) {
      QACCEL_FUSED(2);
    } else if (groups_per_lane <= 4) {
      QACCEL_FUSED(4);
    } else {
      QACCEL_FUSED(0);
    }
#undef QACCEL_FUSED
    return cudaGetLastError();
  }
  bucket_grid_kernel<Tag><<<blocks, kThreads, 0, stream>>>(x, numel, bits, bucket, num_buckets, meta_bf16, lo, scale,
                                                           workspace);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  const int64_t groups = (numel + 7) / 8;
  encode_kernel<Tag><<<grid_for(groups, kThreads), kThreads, 0, stream>>>(x, numel, bits, bucket, nearest, seed,
                                                                          workspace, codes, groups);
  return cudaGetLastError();
}

template <typename MetaTag, typename OutTag>
cudaError_t dequantize_typed(const uint8_t* codes, const void* lo, const void* scale, int bits, int64_t bucket,
                             void* out, int64_t numel, bool accumulate, cudaStream_t stream) {
  const int64_t groups = (numel + 7) / 8;
  decode_kernel<MetaTag, OutTag><<<grid_for(groups, kThreads), kThreads, 0, stream>>>(
      codes, static_cast<const typename MetaTag::T*>(lo), static_cast<const typename MetaTag::T*>(scale), bits, bucket,
      static_cast<typename OutTag::T*>(out), numel, accumulate, aligned16(out),
      (reinterpret_cast<uintptr_t>(codes) & 7u) == 0, groups);
  return cudaGetLastError();
}

template <typename MetaTag>
cudaError_t dequantize_meta(const uint8_t* codes, const void* lo, const void* scale, int bits, int64_t bucket,
                            void* out, Dtype out_dtype, int64_t numel, bool accumulate, cudaStream_t stream) {
  switch (out_dtype) {
    case Dtype::kFloat32:
      return dequantize_typed<MetaTag, F32>(codes, lo, scale, bits, bucket, out, numel, accumulate, stream);
    case Dtype::kBFloat16:
      return dequantize_typed<MetaTag, BF16>(codes, lo, scale, bits, bucket, out, numel, accumulate, stream);
    default:
      return dequantize_typed<MetaTag, F16>(codes, lo, scale, bits, bucket, out, numel, accumulate, stream);
  }
}

// ---- fused payloads (quant_payload.h) -------------------------------------------------------------
//
// Encode: one warp per cell, a run of lcm(bucket, 8) elements of one quantized segment (whole
// buckets and whole groups of 8 codes, so every byte has one writer), or of RAW_CELL_NUMEL elements
// of a raw segment. The warp reduces each bucket of its cell (at most 8) with shuffles, then every
// lane encodes and packs whole groups; the cell is read twice, the second time mostly from L1/L2.
// Decode and sum: one thread per group of 8 elements of a segment (decode: per slot too; sum: it
// loops over the slots in order, accumulating in fp32 registers). Work items map to segments by a
// binary search over the table's cumulative cell/group offsets.

namespace pl = qaccel::payload;

// The last segment whose first work item (column `column`) is <= item: the one holding it.
__device__ __forceinline__ int64_t find_segment(const int64_t* __restrict__ rows, int64_t num_segments, int column,
                                                int64_t item) {
  int64_t lo = 0, hi = num_segments - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) >> 1;
    if (rows[mid * pl::kRowLen + column] <= item) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

__device__ __forceinline__ float load_any(const void* p, int dtype, int64_t i) {
  switch (dtype) {
    case 0: return F32::load(static_cast<const float*>(p), i);
    case 1: return BF16::load(static_cast<const uint16_t*>(p), i);
    default: return F16::load(static_cast<const uint16_t*>(p), i);
  }
}

// Word accesses only where the address allows them: a segment's codes start at any byte.
__device__ __forceinline__ bool packed_aligned(const uint8_t* p, int bits) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return (bits == 8 && (a & 7u) == 0) || (bits == 4 && (a & 3u) == 0) || (bits == 2 && (a & 1u) == 0);
}

__device__ __forceinline__ void store_packed_any(uint8_t* dst, uint64_t word, int bits) {
  if (packed_aligned(dst, bits)) {
    store_packed(dst, word, bits);
  } else {
    for (int k = 0; k < bits; ++k) dst[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

// One encode cell: its slot's payload, its segment's table row and elements in src, the cell's
// index in the segment and the segment's seed.
template <typename Tag>
struct EncodeCell {
  uint8_t* blob;
  const int64_t* row;
  const typename Tag::T* x;
  int64_t n, k;
  uint64_t seed;
};

// Warp-uniform start of encode work item `item` (slot, cell): zeroes the slot's padding bytes (its
// cell 0, lane 0) so payloads are deterministic byte for byte, fills `c`, and copies a raw cell's
// element bits. Returns true for a cell of a quantized segment, false when the cell is done (raw).
template <typename Tag>
__device__ __forceinline__ bool start_encode_cell(const typename Tag::T* __restrict__ src, const pl::Params& p,
                                                  const int64_t* __restrict__ rows,
                                                  const int64_t* __restrict__ slot_info, uint8_t* __restrict__ out,
                                                  int64_t item, int lane, EncodeCell<Tag>& c) {
  const int64_t slot = item / p.cells_per_slot, cell = item - slot * p.cells_per_slot;
  c.blob = out + slot * p.nbytes;
  const int64_t* info = slot_info + slot * (1 + p.num_segments);
  if (cell == 0 && lane == 0) {
    for (int64_t i = p.code_bytes; i < p.meta_offset; ++i) c.blob[i] = 0;
    for (int64_t i = p.raw_offset + p.raw_bytes; i < p.nbytes; ++i) c.blob[i] = 0;
  }
  const int64_t seg = find_segment(rows, p.num_segments, pl::kCellOffset, cell);
  c.row = rows + seg * pl::kRowLen;
  c.n = c.row[pl::kSegNumel];
  c.k = cell - c.row[pl::kCellOffset];
  c.x = src + info[0] + c.row[pl::kElemOffset];
  c.seed = static_cast<uint64_t>(info[1 + seg]);
  if (c.row[pl::kQuantized]) return true;
  const int64_t begin = c.k * p.raw_cell_numel, end = min(c.n, begin + p.raw_cell_numel);
  auto* dst = reinterpret_cast<typename Tag::T*>(c.blob + c.row[pl::kRawByteOffset]);
  for (int64_t e = begin + lane; e < end; e += 32) dst[e] = c.x[e];
  return false;
}

template <typename Tag>
__global__ void __launch_bounds__(kThreads) encode_payloads_kernel(const typename Tag::T* __restrict__ src,
                                                                   pl::Params p, const int64_t* __restrict__ rows,
                                                                   const int64_t* __restrict__ slot_info,
                                                                   int64_t slots, uint8_t* __restrict__ out) {
  const int lane = threadIdx.x & 31;
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t total = slots * p.cells_per_slot;
  const double levels = static_cast<double>((1 << p.bits) - 1);
  const int64_t meta_size = p.meta_bf16 ? 2 : 4;
  for (int64_t w = first_warp; w < total; w += warps) {  // warp-uniform: every lane takes the same path
    EncodeCell<Tag> cell;
    if (!start_encode_cell<Tag>(src, p, rows, slot_info, out, w, lane, cell)) continue;
    uint8_t* blob = cell.blob;
    const int64_t* row = cell.row;
    const int64_t n = cell.n, k = cell.k;
    const typename Tag::T* x = cell.x;
    const uint64_t seed = cell.seed;
    const int64_t begin = k * p.cell_numel, end = min(n, begin + p.cell_numel);
    const int64_t first_bucket = begin / p.bucket;  // cells start on bucket boundaries
    const int buckets = static_cast<int>((end - begin + p.bucket - 1) / p.bucket);  // <= 8
    uint8_t* lo = blob + p.meta_offset + meta_size * row[pl::kBucketOffset];
    uint8_t* scale = lo + meta_size * p.num_buckets;
    double grid_lo[8], grid_inv[8];
    for (int j = 0; j < buckets; ++j) {
      const int64_t bs = begin + j * p.bucket, be = min(end, bs + p.bucket);
      MinMax extremes;
      for (int64_t e = bs + lane; e < be; e += 32) extremes.add(Tag::load(x, e));
      extremes.warp_reduce();
      const BucketGrid grid = extremes.grid(p.bits, p.meta_bf16);
      if (lane == 0) store_meta(grid, p.meta_bf16, lo, scale, first_bucket + j);
      grid_lo[j] = grid.lo64;
      grid_inv[j] = grid.inv;
    }
    uint8_t* codes = blob + row[pl::kCodeOffset];
    const int64_t groups = (end - begin + 7) >> 3;
    for (int64_t g = lane; g < groups; g += 32) {
      const int64_t e0 = begin + 8 * g;  // groups never cross hi32(index): 2**32 is a multiple of 8
      const uint32_t key = qaccel::rng_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(e0) >> 32));
      int j = static_cast<int>((e0 - begin) / p.bucket);
      int64_t offset = (e0 - begin) - j * p.bucket;
      uint64_t word = 0;
#pragma unroll
      for (int q = 0; q < 8; ++q) {
        const int64_t e = e0 + q;
        if (e < end) {
          const double u = p.nearest ? 0.5 : qaccel::rng_uniform(key, static_cast<uint32_t>(e));
          const uint32_t code =
              qaccel::encode_value(static_cast<double>(Tag::load(x, e)), grid_lo[j], grid_inv[j], u, levels);
          word |= static_cast<uint64_t>(code) << (p.bits * q);
        }
        if (++offset == p.bucket) offset = 0, ++j;
      }
      store_packed_any(codes + (e0 >> 3) * p.bits, word, p.bits);
    }
  }
}

// Decoded values of the group of 8 starting at e0 of a quantized segment of n elements.
template <typename MetaTag>
__device__ __forceinline__ void decode_payload_group(const uint8_t* blob, const pl::Params& p, const int64_t* row,
                                                     int64_t e0, int64_t n, float v[8]) {
  const uint8_t* packed = blob + row[pl::kCodeOffset] + (e0 >> 3) * p.bits;
  const uint64_t word = load_packed(packed, p.bits, packed_aligned(packed, p.bits));
  const uint64_t mask = (1ull << p.bits) - 1ull;
  const auto* lo = reinterpret_cast<const typename MetaTag::T*>(blob + p.meta_offset) + row[pl::kBucketOffset];
  const auto* scale = lo + p.num_buckets;
  int64_t b = bucket_of(e0, p.bucket);
  int64_t offset = e0 - b * p.bucket;
  if (offset + 8 <= p.bucket) {  // the whole group lies in one bucket
    const double lo64 = MetaTag::load(lo, b), scale64 = MetaTag::load(scale, b);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      v[j] = qaccel::decode_value(lo64, scale64, static_cast<uint32_t>((word >> (p.bits * j)) & mask));
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const bool real = e0 + j < n;  // padding codes may point past the last bucket
    v[j] = real ? qaccel::decode_value(MetaTag::load(lo, b), MetaTag::load(scale, b),
                                       static_cast<uint32_t>((word >> (p.bits * j)) & mask))
                : 0.0f;
    if (++offset == p.bucket) offset = 0, ++b;
  }
}

template <typename MetaTag, typename OutTag>
__global__ void __launch_bounds__(kThreads) decode_payloads_kernel(const uint8_t* __restrict__ blob_all, pl::Params p,
                                                                   const int64_t* __restrict__ rows,
                                                                   const int64_t* __restrict__ offsets, int64_t slots,
                                                                   typename OutTag::T* __restrict__ out) {
  const int64_t total = slots * p.groups_per_slot;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; t < total; t += stride) {
    const int64_t slot = t / p.groups_per_slot, group = t - slot * p.groups_per_slot;
    const int64_t seg = find_segment(rows, p.num_segments, pl::kGroupOffset, group);
    const int64_t* row = rows + seg * pl::kRowLen;
    const int64_t n = row[pl::kSegNumel], e0 = 8 * (group - row[pl::kGroupOffset]);
    const uint8_t* blob = blob_all + slot * p.nbytes;
    typename OutTag::T* dst = out + offsets[slot] + row[pl::kElemOffset];
    if (!row[pl::kQuantized]) {
      const uint8_t* raw = blob + row[pl::kRawByteOffset];
      if (p.elem_dtype == OutTag::kDtype) {  // bit copy, as Tensor.copy_ between equal dtypes
        const auto* src = reinterpret_cast<const typename OutTag::T*>(raw);
        for (int j = 0; j < 8 && e0 + j < n; ++j) dst[e0 + j] = src[e0 + j];
      } else {
        for (int j = 0; j < 8 && e0 + j < n; ++j) OutTag::store(dst, e0 + j, load_any(raw, p.elem_dtype, e0 + j));
      }
      continue;
    }
    float v[8];
    decode_payload_group<MetaTag>(blob, p, row, e0, n, v);
    if (e0 + 8 <= n && (reinterpret_cast<uintptr_t>(dst + e0) & 15u) == 0) {
      store8<OutTag>(dst + e0, v);
    } else {
      for (int j = 0; j < 8 && e0 + j < n; ++j) OutTag::store(dst, e0 + j, v[j]);
    }
  }
}

// No __restrict__ on base/out: they may be the same tensor (each thread reads its elements first).
template <typename MetaTag, typename OutTag>
__global__ void __launch_bounds__(kThreads) sum_payloads_kernel(const uint8_t* __restrict__ blob_all, pl::Params p,
                                                                const int64_t* __restrict__ rows, int64_t slots,
                                                                const void* base, int base_dtype,
                                                                typename OutTag::T* out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; group < p.groups_per_slot;
       group += stride) {
    const int64_t seg = find_segment(rows, p.num_segments, pl::kGroupOffset, group);
    const int64_t* row = rows + seg * pl::kRowLen;
    const int64_t n = row[pl::kSegNumel], e0 = 8 * (group - row[pl::kGroupOffset]);
    const int64_t first = row[pl::kElemOffset] + e0;
    const int count = static_cast<int>(min(static_cast<int64_t>(8), n - e0));
    float acc[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[j] = j < count ? load_any(base, base_dtype, first + j) : 0.0f;
    for (int64_t s = 0; s < slots; ++s) {  // slot order: ((base + d_0) + d_1) + ...
      const uint8_t* blob = blob_all + s * p.nbytes;
      if (!row[pl::kQuantized]) {
        const uint8_t* raw = blob + row[pl::kRawByteOffset];
        for (int j = 0; j < count; ++j) acc[j] = __fadd_rn(acc[j], load_any(raw, p.elem_dtype, e0 + j));
        continue;
      }
      float v[8];
      decode_payload_group<MetaTag>(blob, p, row, e0, n, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j] = __fadd_rn(acc[j], v[j]);
    }
    for (int j = 0; j < count; ++j) OutTag::store(out, first + j, acc[j]);
  }
}

// ---- fused payloads, rotated (p.rotation; reference.py steps 7-10) ------------------------------
//
// Separate kernels, the unrotated ones above untouched. Same work units (cells), one warp each, but
// a warp works one rotation block (a power of two <= kMaxRotationBlock elements, never crossing a
// bucket) at a time: the block sits in shared memory as fp64 while the warp runs the butterflies.
// Encode: pass 1 rotates every block of each bucket of the cell and reduces min/max of r into the
// bucket's grid; pass 2 rotates each block again (a cell of one block is still in shared memory),
// encodes r into a shared window of codes and packs every whole group of 8, carrying the codes of a
// group that continues in the next block. Decode (a warp per cell and slot) and sum (a warp per
// cell, looping over the slots in order with the block's fp32 sums in registers) decode a block,
// rotate it back and write or accumulate it.

// visit(j, s0, block, bucket_end) for every rotation block [s0, s0 + block) of the cell [begin, end),
// in order; begin is on a bucket boundary, j counts the cell's buckets and bucket_end ends bucket j.
template <typename Visit>
__device__ __forceinline__ void for_each_rotation_block(int64_t begin, int64_t end, int64_t bucket, int max_block,
                                                        Visit&& visit) {
  int j = 0;
  for (int64_t bucket_start = begin; bucket_start < end; bucket_start += bucket, ++j) {
    const int64_t bucket_end = min(end, bucket_start + bucket);
    for (int64_t s0 = bucket_start; s0 < bucket_end;) {
      const int block = rotation_block(bucket_end - s0, max_block);
      visit(j, s0, block, bucket_end);
      s0 += block;
    }
  }
}

// Rotates elements [s0, s0 + block) of segment x forward into w: w_i = double(fp32(x_i)) * d_i, then
// the butterflies (r_i = rotated_value(w[i], c)).
template <typename Tag>
__device__ __forceinline__ void rotate_forward(const typename Tag::T* x, int64_t s0, int block, uint64_t seed,
                                               double* w, int lane) {
  for (int i = lane; i < block; i += 32)
    w[i] = __dmul_rn(static_cast<double>(Tag::load(x, s0 + i)), rotation_sign(seed, s0 + i));
  __syncwarp();
  warp_butterflies(w, block, lane);
}

// Decodes elements [s0, s0 + block) of the quantized segment `row` (one bucket) into w as fp64 and
// runs the butterflies (x_hat_i = unrotated_value(w[i], c, d_i)).
template <typename MetaTag>
__device__ __forceinline__ void rotate_decoded_back(const uint8_t* blob, const pl::Params& p, const int64_t* row,
                                                    int64_t s0, int block, double* w, int lane) {
  const uint8_t* codes = blob + row[pl::kCodeOffset];
  const auto* lo = reinterpret_cast<const typename MetaTag::T*>(blob + p.meta_offset) + row[pl::kBucketOffset];
  const auto* scale = lo + p.num_buckets;
  const int64_t b = bucket_of(s0, p.bucket);
  const double lo64 = MetaTag::load(lo, b), scale64 = MetaTag::load(scale, b);
  for (int i = lane; i < block; i += 32)
    w[i] = static_cast<double>(qaccel::decode_value(lo64, scale64, code_at(codes, s0 + i, p.bits)));
  __syncwarp();
  warp_butterflies(w, block, lane);
}

template <typename Tag>
__global__ void __launch_bounds__(kRotationThreads) encode_payloads_rotated_kernel(
    const typename Tag::T* __restrict__ src, pl::Params p, const int64_t* __restrict__ rows,
    const int64_t* __restrict__ slot_info, int64_t slots, uint8_t* __restrict__ out) {
  __shared__ double rotated[kRotationWarps][kMaxRotationBlock];
  __shared__ uint8_t windows[kRotationWarps][kMaxRotationBlock + 8];
  const int lane = threadIdx.x & 31;
  double* w = rotated[threadIdx.x >> 5];
  uint8_t* window = windows[threadIdx.x >> 5];  // codes not yet packed: < 8 carried + one block
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t total = slots * p.cells_per_slot;
  const double levels = static_cast<double>((1 << p.bits) - 1);
  const int64_t meta_size = p.meta_bf16 ? 2 : 4;
  const int max_block = static_cast<int>(p.rotation_max_block);
  for (int64_t item = first_warp; item < total; item += warps) {  // warp-uniform: every lane takes the same path
    EncodeCell<Tag> cell;
    if (!start_encode_cell<Tag>(src, p, rows, slot_info, out, item, lane, cell)) continue;
    const typename Tag::T* x = cell.x;
    const uint64_t seed = cell.seed;
    const int64_t begin = cell.k * p.cell_numel, end = min(cell.n, begin + p.cell_numel);
    const int64_t first_bucket = begin / p.bucket;  // cells start on bucket boundaries
    uint8_t* lo = cell.blob + p.meta_offset + meta_size * cell.row[pl::kBucketOffset];
    uint8_t* scale = lo + meta_size * p.num_buckets;
    double grid_lo[8], grid_inv[8];  // a cell holds at most 8 buckets
    MinMax extremes;
    for_each_rotation_block(begin, end, p.bucket, max_block, [&](int j, int64_t s0, int block, int64_t bucket_end) {
      rotate_forward<Tag>(x, s0, block, seed, w, lane);
      const double c = rotation_scale(block);
      for (int i = lane; i < block; i += 32) extremes.add(rotated_value(w[i], c));
      __syncwarp();
      if (s0 + block == bucket_end) {  // the bucket's last block: its grid
        extremes.warp_reduce();
        const BucketGrid grid = extremes.grid(p.bits, p.meta_bf16);
        if (lane == 0) store_meta(grid, p.meta_bf16, lo, scale, first_bucket + j);
        grid_lo[j] = grid.lo64;
        grid_inv[j] = grid.inv;
        extremes = MinMax();
      }
    });
    // A cell of one bucket of one block is still in w; any other cell is rotated again block by block.
    const bool one_block = end - begin <= p.bucket && rotation_block(end - begin, max_block) == end - begin;
    uint8_t* codes = cell.blob + cell.row[pl::kCodeOffset];
    int64_t window_start = begin;  // segment index of window[0]: a multiple of 8
    int held = 0;                  // codes in the window
    for_each_rotation_block(begin, end, p.bucket, max_block, [&](int j, int64_t s0, int block, int64_t) {
      if (!one_block) rotate_forward<Tag>(x, s0, block, seed, w, lane);
      const double c = rotation_scale(block);
      for (int i = lane; i < block; i += 32) {
        const int64_t e = s0 + i;
        const uint32_t key = qaccel::rng_key(seed, static_cast<uint32_t>(static_cast<uint64_t>(e) >> 32));
        const double u = p.nearest ? 0.5 : qaccel::rng_uniform(key, static_cast<uint32_t>(e));
        const double r = static_cast<double>(rotated_value(w[i], c));
        window[held + i] = static_cast<uint8_t>(qaccel::encode_value(r, grid_lo[j], grid_inv[j], u, levels));
      }
      __syncwarp();
      held += block;
      const int groups = held >> 3;
      for (int g = lane; g < groups; g += 32) {
        uint64_t word = 0;
#pragma unroll
        for (int q = 0; q < 8; ++q) word |= static_cast<uint64_t>(window[8 * g + q]) << (p.bits * q);
        store_packed_any(codes + ((window_start >> 3) + g) * p.bits, word, p.bits);
      }
      const int rest = held & 7;  // a group continuing in the next block: move it to the front
      const uint8_t carried = lane < rest ? window[8 * groups + lane] : 0;
      __syncwarp();
      if (lane < rest) window[lane] = carried;
      __syncwarp();
      window_start += 8 * groups;
      held = rest;
    });
    if (held > 0 && lane == 0) {  // the segment's last group, padded with code 0
      uint64_t word = 0;
      for (int q = 0; q < held; ++q) word |= static_cast<uint64_t>(window[q]) << (p.bits * q);
      store_packed_any(codes + (window_start >> 3) * p.bits, word, p.bits);
    }
    __syncwarp();  // the window and w are reused by the next cell
  }
}

template <typename MetaTag, typename OutTag>
__global__ void __launch_bounds__(kRotationThreads) decode_payloads_rotated_kernel(
    const uint8_t* __restrict__ blob_all, pl::Params p, const int64_t* __restrict__ rows,
    const int64_t* __restrict__ offsets, const int64_t* __restrict__ seeds, int64_t slots,
    typename OutTag::T* __restrict__ out) {
  __shared__ double rotated[kRotationWarps][kMaxRotationBlock];
  const int lane = threadIdx.x & 31;
  double* w = rotated[threadIdx.x >> 5];
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int64_t total = slots * p.cells_per_slot;
  const int max_block = static_cast<int>(p.rotation_max_block);
  for (int64_t cw = first_warp; cw < total; cw += warps) {  // warp-uniform
    const int64_t slot = cw / p.cells_per_slot, cell = cw - slot * p.cells_per_slot;
    const int64_t seg = find_segment(rows, p.num_segments, pl::kCellOffset, cell);
    const int64_t* row = rows + seg * pl::kRowLen;
    const int64_t n = row[pl::kSegNumel], k = cell - row[pl::kCellOffset];
    const uint8_t* blob = blob_all + slot * p.nbytes;
    typename OutTag::T* dst = out + offsets[slot] + row[pl::kElemOffset];
    if (!row[pl::kQuantized]) {
      const int64_t begin = k * p.raw_cell_numel, end = min(n, begin + p.raw_cell_numel);
      const uint8_t* raw = blob + row[pl::kRawByteOffset];
      if (p.elem_dtype == OutTag::kDtype) {  // bit copy, as Tensor.copy_ between equal dtypes
        const auto* src = reinterpret_cast<const typename OutTag::T*>(raw);
        for (int64_t e = begin + lane; e < end; e += 32) dst[e] = src[e];
      } else {
        for (int64_t e = begin + lane; e < end; e += 32) OutTag::store(dst, e, load_any(raw, p.elem_dtype, e));
      }
      continue;
    }
    const uint64_t seed = static_cast<uint64_t>(seeds[slot * p.num_segments + seg]);
    const int64_t begin = k * p.cell_numel, end = min(n, begin + p.cell_numel);
    for_each_rotation_block(begin, end, p.bucket, max_block, [&](int, int64_t s0, int block, int64_t) {
      rotate_decoded_back<MetaTag>(blob, p, row, s0, block, w, lane);
      const double c = rotation_scale(block);
      for (int i = lane; i < block; i += 32)
        OutTag::store(dst, s0 + i, unrotated_value(w[i], c, rotation_sign(seed, s0 + i)));
      __syncwarp();
    });
  }
}

// No __restrict__ on base/out: they may be the same tensor (a warp reads a block's base before
// writing it, and no other warp touches that block).
template <typename MetaTag, typename OutTag>
__global__ void __launch_bounds__(kRotationThreads) sum_payloads_rotated_kernel(
    const uint8_t* __restrict__ blob_all, pl::Params p, const int64_t* __restrict__ rows,
    const int64_t* __restrict__ seeds, int64_t slots, const void* base, int base_dtype, typename OutTag::T* out) {
  __shared__ double rotated[kRotationWarps][kMaxRotationBlock];
  const int lane = threadIdx.x & 31;
  double* w = rotated[threadIdx.x >> 5];
  const int64_t first_warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  const int max_block = static_cast<int>(p.rotation_max_block);
  for (int64_t cell = first_warp; cell < p.cells_per_slot; cell += warps) {  // warp-uniform
    const int64_t seg = find_segment(rows, p.num_segments, pl::kCellOffset, cell);
    const int64_t* row = rows + seg * pl::kRowLen;
    const int64_t n = row[pl::kSegNumel], k = cell - row[pl::kCellOffset];
    const int64_t first = row[pl::kElemOffset];
    if (!row[pl::kQuantized]) {
      const int64_t begin = k * p.raw_cell_numel, end = min(n, begin + p.raw_cell_numel);
      for (int64_t e = begin + lane; e < end; e += 32) {
        float acc = load_any(base, base_dtype, first + e);
        for (int64_t s = 0; s < slots; ++s)  // slot order: ((base + d_0) + d_1) + ...
          acc = __fadd_rn(acc, load_any(blob_all + s * p.nbytes + row[pl::kRawByteOffset], p.elem_dtype, e));
        OutTag::store(out, first + e, acc);
      }
      continue;
    }
    const int64_t begin = k * p.cell_numel, end = min(n, begin + p.cell_numel);
    for_each_rotation_block(begin, end, p.bucket, max_block, [&](int, int64_t s0, int block, int64_t) {
      float acc[kRotationPerLane];  // element lane + 32 t of the block
#pragma unroll
      for (int t = 0; t < kRotationPerLane; ++t) {
        const int i = lane + 32 * t;
        acc[t] = i < block ? load_any(base, base_dtype, first + s0 + i) : 0.0f;
      }
      for (int64_t s = 0; s < slots; ++s) {  // slot order: ((base + d_0) + d_1) + ...
        const uint64_t seed = static_cast<uint64_t>(seeds[s * p.num_segments + seg]);
        rotate_decoded_back<MetaTag>(blob_all + s * p.nbytes, p, row, s0, block, w, lane);
        const double c = rotation_scale(block);
#pragma unroll
        for (int t = 0; t < kRotationPerLane; ++t) {
          const int i = lane + 32 * t;
          if (i < block) acc[t] = __fadd_rn(acc[t], unrotated_value(w[i], c, rotation_sign(seed, s0 + i)));
        }
        __syncwarp();
      }
#pragma unroll
      for (int t = 0; t < kRotationPerLane; ++t) {
        const int i = lane + 32 * t;
        if (i < block) OutTag::store(out, first + s0 + i, acc[t]);
      }
    });
  }
}

template <typename Tag>
cudaError_t encode_payloads_typed(const void* src, const pl::Params& p, const int64_t* rows, const int64_t* slot_info,
                                  int64_t slots, uint8_t* out, cudaStream_t stream) {
  if (p.rotation) {
    encode_payloads_rotated_kernel<Tag><<<grid_for(slots * p.cells_per_slot, kRotationWarps), kRotationThreads, 0,
                                          stream>>>(static_cast<const typename Tag::T*>(src), p, rows, slot_info,
                                                    slots, out);
    return cudaGetLastError();
  }
  const unsigned blocks = grid_for(slots * p.cells_per_slot, kWarpsPerBlock);
  encode_payloads_kernel<Tag><<<blocks, kThreads, 0, stream>>>(static_cast<const typename Tag::T*>(src), p, rows,
                                                                slot_info, slots, out);
  return cudaGetLastError();
}

template <typename MetaTag, typename OutTag>
cudaError_t decode_payloads_typed(const uint8_t* blob, const pl::Params& p, const int64_t* rows,
                                  const int64_t* offsets, const int64_t* seeds, int64_t slots, void* out,
                                  cudaStream_t stream) {
  if (p.rotation) {
    decode_payloads_rotated_kernel<MetaTag, OutTag>
        <<<grid_for(slots * p.cells_per_slot, kRotationWarps), kRotationThreads, 0, stream>>>(
            blob, p, rows, offsets, seeds, slots, static_cast<typename OutTag::T*>(out));
    return cudaGetLastError();
  }
  decode_payloads_kernel<MetaTag, OutTag><<<grid_for(slots * p.groups_per_slot, kThreads), kThreads, 0, stream>>>(
      blob, p, rows, offsets, slots, static_cast<typename OutTag::T*>(out));
  return cudaGetLastError();
}

template <typename MetaTag>
cudaError_t decode_payloads_meta(const uint8_t* blob, const pl::Params& p, const int64_t* rows, const int64_t* offsets,
                                 const int64_t* seeds, int64_t slots, void* out, Dtype out_dtype,
                                 cudaStream_t stream) {
  switch (out_dtype) {
    case Dtype::kFloat32:
      return decode_payloads_typed<MetaTag, F32>(blob, p, rows, offsets, seeds, slots, out, stream);
    case Dtype::kBFloat16:
      return decode_payloads_typed<MetaTag, BF16>(blob, p, rows, offsets, seeds, slots, out, stream);
    default: return decode_payloads_typed<MetaTag, F16>(blob, p, rows, offsets, seeds, slots, out, stream);
  }
}

template <typename MetaTag, typename OutTag>
cudaError_t sum_payloads_typed(const uint8_t* blob, const pl::Params& p, const int64_t* rows, const int64_t* seeds,
                               int64_t slots, const void* base, Dtype base_dtype, void* out, cudaStream_t stream) {
  if (p.rotation) {
    sum_payloads_rotated_kernel<MetaTag, OutTag>
        <<<grid_for(p.cells_per_slot, kRotationWarps), kRotationThreads, 0, stream>>>(
            blob, p, rows, seeds, slots, base, static_cast<int>(base_dtype), static_cast<typename OutTag::T*>(out));
    return cudaGetLastError();
  }
  sum_payloads_kernel<MetaTag, OutTag><<<grid_for(p.groups_per_slot, kThreads), kThreads, 0, stream>>>(
      blob, p, rows, slots, base, static_cast<int>(base_dtype), static_cast<typename OutTag::T*>(out));
  return cudaGetLastError();
}

template <typename MetaTag>
cudaError_t sum_payloads_meta(const uint8_t* blob, const pl::Params& p, const int64_t* rows, const int64_t* seeds,
                              int64_t slots, const void* base, Dtype base_dtype, void* out, Dtype out_dtype,
                              cudaStream_t stream) {
  switch (out_dtype) {
    case Dtype::kFloat32:
      return sum_payloads_typed<MetaTag, F32>(blob, p, rows, seeds, slots, base, base_dtype, out, stream);
    case Dtype::kBFloat16:
      return sum_payloads_typed<MetaTag, BF16>(blob, p, rows, seeds, slots, base, base_dtype, out, stream);
    default: return sum_payloads_typed<MetaTag, F16>(blob, p, rows, seeds, slots, base, base_dtype, out, stream);
  }
}

}  // namespace

bool quantize_needs_workspace(const void* x, int64_t bucket) { return bucket % 8 != 0 || !aligned16(x); }

cudaError_t quantize(const void* x, Dtype dtype, int64_t numel, int bits, int64_t bucket, bool nearest, uint64_t seed,
                     bool meta_bf16, void* lo, void* scale, uint8_t* codes, double* workspace, cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  switch (dtype) {
    case Dtype::kFloat32:
      return quantize_typed<F32>(x, numel, bits, bucket, nearest, seed, meta_bf16, lo, scale, codes, workspace, stream);
    case Dtype::kBFloat16:
      return quantize_typed<BF16>(x, numel, bits, bucket, nearest, seed, meta_bf16, lo, scale, codes, workspace, stream);
    default:
      return quantize_typed<F16>(x, numel, bits, bucket, nearest, seed, meta_bf16, lo, scale, codes, workspace, stream);
  }
}

cudaError_t dequantize(const uint8_t* codes, const void* lo, const void* scale, bool meta_bf16, int bits,
                       int64_t bucket, void* out, Dtype out_dtype, int64_t numel, bool accumulate,
                       cudaStream_t stream) {
  if (numel <= 0) return cudaSuccess;
  if (meta_bf16) return dequantize_meta<MetaBF16>(codes, lo, scale, bits, bucket, out, out_dtype, numel, accumulate, stream);
  return dequantize_meta<MetaF32>(codes, lo, scale, bits, bucket, out, out_dtype, numel, accumulate, stream);
}

cudaError_t sign_pack(const void* x, Dtype dtype, int64_t chunks, int64_t chunk_numel, uint8_t* out,
                      cudaStream_t stream) {
  const int64_t chunk_bytes = (chunk_numel + 7) / 8, total = chunks * chunk_bytes;
  if (total <= 0) return cudaSuccess;
  const unsigned blocks = grid_for(total, kThreads);
  switch (dtype) {
    case Dtype::kFloat32:
      sign_pack_kernel<F32><<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(x), chunk_numel, chunk_bytes,
                                                             total, out);
      break;
    case Dtype::kBFloat16:
      sign_pack_kernel<BF16><<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(x), chunk_numel,
                                                              chunk_bytes, total, out);
      break;
    default:
      sign_pack_kernel<F16><<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(x), chunk_numel,
                                                             chunk_bytes, total, out);
  }
  return cudaGetLastError();
}

cudaError_t sign_unpack(const uint8_t* signs, const float* scales, int64_t chunks, int64_t chunk_numel, float* out,
                        cudaStream_t stream) {
  const int64_t chunk_bytes = (chunk_numel + 7) / 8, total = chunks * chunk_bytes;
  if (total <= 0) return cudaSuccess;
  sign_unpack_kernel<<<grid_for(total, kThreads), kThreads, 0, stream>>>(signs, scales, chunk_numel, chunk_bytes,
                                                                         total, out);
  return cudaGetLastError();
}

cudaError_t onebit_compensate(const void* x, Dtype dtype, int64_t numel, float* error, int64_t padded,
                              cudaStream_t stream) {
  if (padded <= 0) return cudaSuccess;
  const unsigned blocks = grid_for(padded, kThreads);
  switch (dtype) {
    case Dtype::kFloat32:
      onebit_compensate_kernel<F32><<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(x), numel, error, padded);
      break;
    case Dtype::kBFloat16:
      onebit_compensate_kernel<BF16><<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(x), numel, error,
                                                                      padded);
      break;
    default:
      onebit_compensate_kernel<F16><<<blocks, kThreads, 0, stream>>>(static_cast<const uint16_t*>(x), numel, error,
                                                                     padded);
  }
  return cudaGetLastError();
}

cudaError_t onebit_sign_error(float* values, const float* scales, int64_t chunks, int64_t chunk_numel, uint8_t* out,
                              cudaStream_t stream) {
  const int64_t chunk_bytes = (chunk_numel + 7) / 8, total = chunks * chunk_bytes;
  if (total <= 0) return cudaSuccess;
  onebit_sign_error_kernel<<<grid_for(total, kThreads), kThreads, 0, stream>>>(values, scales, chunk_numel,
                                                                               chunk_bytes, total, out);
  return cudaGetLastError();
}

cudaError_t encode_payloads(const void* src, const pl::Params& p, const int64_t* rows, const int64_t* slot_info,
                            int64_t slots, uint8_t* out, cudaStream_t stream) {
  if (slots <= 0 || p.cells_per_slot <= 0) return cudaSuccess;
  switch (p.elem_dtype) {
    case 0: return encode_payloads_typed<F32>(src, p, rows, slot_info, slots, out, stream);
    case 1: return encode_payloads_typed<BF16>(src, p, rows, slot_info, slots, out, stream);
    default: return encode_payloads_typed<F16>(src, p, rows, slot_info, slots, out, stream);
  }
}

cudaError_t decode_payloads(const uint8_t* blob, const pl::Params& p, const int64_t* rows, const int64_t* offsets,
                            const int64_t* seeds, int64_t slots, void* out, Dtype out_dtype, cudaStream_t stream) {
  if (slots <= 0 || p.groups_per_slot <= 0) return cudaSuccess;
  if (p.meta_bf16)
    return decode_payloads_meta<MetaBF16>(blob, p, rows, offsets, seeds, slots, out, out_dtype, stream);
  return decode_payloads_meta<MetaF32>(blob, p, rows, offsets, seeds, slots, out, out_dtype, stream);
}

cudaError_t sum_payloads(const uint8_t* blob, const pl::Params& p, const int64_t* rows, const int64_t* seeds,
                         int64_t slots, const void* base, Dtype base_dtype, void* out, Dtype out_dtype,
                         cudaStream_t stream) {
  if (p.groups_per_slot <= 0) return cudaSuccess;
  if (p.meta_bf16)
    return sum_payloads_meta<MetaBF16>(blob, p, rows, seeds, slots, base, base_dtype, out, out_dtype, stream);
  return sum_payloads_meta<MetaF32>(blob, p, rows, seeds, slots, base, base_dtype, out, out_dtype, stream);
}

}  // namespace qaccel_cuda
