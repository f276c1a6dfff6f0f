// C++ (CPU) codecs: bit-identical to qaccel/quant/reference.py, parallel with at::parallel_for.
//
// Work is cut into fixed tiles of kTileNumel elements (a multiple of 8, so a tile owns whole
// groups of packed codes). A tile computes the grid of every bucket it touches and writes the
// metadata of the buckets that *start* inside it, so each output byte has exactly one writer and
// the result does not depend on the number of threads. A bucket straddling two tiles has its
// min/max computed by both (the same value), which costs at most 2 * bucket / tile extra reads;
// buckets longer than kFusedMaxBucket get their grids from a separate pass instead.
//
// A rotated payload spec (reference.py steps 7-10) rotates each bucket into a per-thread scratch
// buffer, then computes its grid and codes from there in the same pass; decoding decodes a bucket
// into scratch, rotates it back and stores or adds it. Rotation blocks never straddle a bucket, so a
// bucket of at most kFusedMaxBucket is one "chunk" (rotated whole by each tile touching it, and the
// payload tiles hold whole buckets so that happens once); a longer bucket is cut into chunks of
// rotation_max_block elements from its start, each a whole block, for its grid pass and its tiles.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "quant_checks.h"
#include "quant_common.h"
#include "quant_cpu_avx512.h"
#include "quant_onebit.h"
#include "quant_ops.h"
#include "quant_payload.h"

namespace {

using qaccel::BucketGrid;
using qaccel_cpu::CounterHashes;
using qaccel_cpu::DecodedCodes;
using qaccel_cpu::RotationMode;

constexpr int64_t kTileNumel = 32768;       // 32 KiB of codes per tile: stays in L1/L2
constexpr int64_t kFusedMaxBucket = 4096;   // larger buckets: grids from a separate pass
constexpr int64_t kMaxRotationBlock = 1024;  // the longest rotation block the kernels take

inline float load_f32(const float* x, int64_t i) { return x[i]; }
inline float load_f32(const c10::BFloat16* x, int64_t i) { return static_cast<float>(x[i]); }
inline float load_f32(const c10::Half* x, int64_t i) { return static_cast<float>(x[i]); }
inline float load_f32(const DecodedCodes& x, int64_t i) { return x[i]; }

// fp32 -> output dtype, rounding to nearest even as Tensor.copy_ does. torch's vectorized CPU
// conversion writes NaN as 0xFFFF in bfloat16; do the same so even NaN bits match the reference.
inline void store_out(float* out, int64_t i, float value) { out[i] = value; }
inline void store_out(c10::BFloat16* out, int64_t i, float value) {
  out[i] = std::isnan(value) ? c10::BFloat16(0xFFFF, c10::BFloat16::from_bits()) : c10::BFloat16(value);
}
inline void store_out(c10::Half* out, int64_t i, float value) { out[i] = c10::Half(value); }

// A fresh multi-MB output is backed by new pages, and first-touch faults of 4 KiB pages can cost
// more than the encoding (seen on VMs: ~60 ms for 64 MiB). Asking for transparent huge pages on
// the page-aligned interior, before anything touches it, makes that one fault per 2 MiB. Advice
// only: it changes no byte, and it is ignored where THP is off.
void advise_huge_pages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < 4 * static_cast<int64_t>(kHuge)) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// fp32 min/max (as ordered keys) and the non-finite flag of a bucket, gathered over one or more runs.
struct Extremes {
  int32_t lo_key = INT32_MAX, hi_key = INT32_MIN;
  uint32_t bad = 0;

  template <typename T>
  void add(const T* xs, int64_t n) {
    int32_t lo = lo_key, hi = hi_key;
    uint32_t nonfinite = bad;
    for (int64_t k = 0; k < n; ++k) {
      const float v = load_f32(xs, k);
      const int32_t key = qaccel::ordered_key(v);
      lo = key < lo ? key : lo;
      hi = key > hi ? key : hi;
      nonfinite |= qaccel::is_nonfinite_bits(qaccel::float_bits(v));
    }
    lo_key = lo;
    hi_key = hi;
    bad = nonfinite;
  }

  BucketGrid grid(int bits, bool meta_bf16) const {
    return qaccel::make_grid(qaccel::key_to_float(lo_key), qaccel::key_to_float(hi_key), bad != 0, bits, meta_bf16);
  }
};

template <typename T>
BucketGrid bucket_grid(const T* x, int64_t begin, int64_t end, int bits, bool meta_bf16) {
  Extremes extremes;
  extremes.add(x + begin, end - begin);
  return extremes.grid(bits, meta_bf16);
}

// Calls f(i, run_end, key) for the runs of [begin, end) that share hi32(index), hence one RNG key.
template <typename F>
void for_each_key_run(uint64_t seed, int64_t begin, int64_t end, F&& f) {
  for (int64_t i = begin; i < end;) {
    const uint64_t index_hi = static_cast<uint64_t>(i) >> 32;
    const int64_t run_end = std::min<int64_t>(end, static_cast<int64_t>((index_hi + 1) << 32));
    f(i, run_end, qaccel::rng_key(seed, static_cast<uint32_t>(index_hi)));
    i = run_end;
  }
}

// codes[k] for the n elements at xs, whose flat indices are first, first+1, ... (same hi32). With
// `hashes`, hash k is hashes[k] (key and first unused): a rotated encode computed them for the signs.
template <typename T>
void encode_run(const T* xs, int64_t n, double lo64, double inv, bool nearest, uint32_t key, uint32_t first,
                const uint32_t* hashes, int levels, uint8_t* __restrict codes) {
  int64_t k = 0;
#if defined(QACCEL_HAVE_AVX512)
  k = hashes != nullptr
          ? qaccel_avx512::encode_run<true>(xs, n, lo64, inv, nearest, key, first, hashes, levels, codes)
          : qaccel_avx512::encode_run<false>(xs, n, lo64, inv, nearest, key, first, hashes, levels, codes);
#endif
  const double levels64 = static_cast<double>(levels);
  if (nearest) {
    for (; k < n; ++k) codes[k] = static_cast<uint8_t>(qaccel::encode_value(load_f32(xs, k), lo64, inv, 0.5, levels64));
    return;
  }
  for (; k < n; ++k) {
    const uint32_t hash = hashes != nullptr ? hashes[k] : qaccel::rng_hash(key, first + static_cast<uint32_t>(k));
    const double u = qaccel::hash_uniform(hash);
    codes[k] = static_cast<uint8_t>(qaccel::encode_value(load_f32(xs, k), lo64, inv, u, levels64));
  }
}

// codes[k] for elements [begin, end) of one bucket; the RNG key changes only where hi32(index) does.
template <typename T>
void encode_segment(const T* x, int64_t begin, int64_t end, const BucketGrid& grid, bool nearest, uint64_t seed,
                    int levels, uint8_t* codes) {
  for_each_key_run(seed, begin, end, [&](int64_t i, int64_t run_end, uint32_t key) {
    encode_run(x + i, run_end - i, grid.lo64, grid.inv, nearest, key, static_cast<uint32_t>(i), nullptr, levels,
               codes + (i - begin));
  });
}

// ---- Hadamard rotation (reference.hadamard_rotate; steps 7-10) --------------------------------------

// Per-thread buffers of the rotated codecs; a chunk (see the top of the file) has at most
// kFusedMaxBucket elements.
struct RotationScratch {
  alignas(64) uint32_t hashes[kFusedMaxBucket];         // hash(seed, i) of the chunk: signs and u
  alignas(64) float values[kFusedMaxBucket];            // rotated (encode) or decoded (decode) values
  alignas(64) double block[kMaxRotationBlock];          // a block's doubles between butterfly passes
  alignas(64) uint8_t codes[kFusedMaxBucket + 16];      // unpacked codes of a chunk (decode)
};

std::unique_ptr<RotationScratch> rotation_scratch(bool rotation) {
  return rotation ? std::make_unique<RotationScratch>() : nullptr;
}

// out[k] = hash(seed, first + k) for k < n.
void fill_hashes(uint64_t seed, int64_t first, int64_t n, uint32_t* out) {
  for_each_key_run(seed, first, first + n, [&](int64_t i, int64_t run_end, uint32_t key) {
    uint32_t* dst = out + (i - first);
    const int64_t count = run_end - i;
    int64_t k = 0;
#if defined(QACCEL_HAVE_AVX512)
    k = qaccel_avx512::fill_hashes(key, static_cast<uint32_t>(i), count, dst);
#endif
    for (; k < count; ++k) dst[k] = qaccel::rng_hash(key, static_cast<uint32_t>(i) + static_cast<uint32_t>(k));
  });
}

// One block of `length` (a power of two) elements; `w` holds `length` doubles; `out` may be `in`.
// Forward: w = double(x) * d, butterflies, fp32(w * c). Inverse: w = double(y), butterflies,
// x_hat = fp32((w * c) * d), stored or added (out + x_hat). Operations and operand order are the
// reference's.
template <RotationMode kMode, typename Source, typename Hashes>
void rotate_block_scalar(Source in, int64_t length, Hashes hashes, double c, float* out, double* w) {
  constexpr bool kForward = kMode == RotationMode::kForward;
  for (int64_t k = 0; k < length; ++k) {
    const double value = static_cast<double>(load_f32(in, k));
    w[k] = kForward ? value * qaccel::rotation_sign(hashes[k]) : value;
  }
  for (int64_t h = 1; h < length; h *= 2) {
    for (int64_t j = 0; j < length; ++j) {
      if (j & h) continue;
      const double a = w[j], b = w[j + h];
      w[j] = a + b;
      w[j + h] = a - b;
    }
  }
  for (int64_t k = 0; k < length; ++k) {
    double value = w[k] * c;
    if (!kForward) value = value * qaccel::rotation_sign(hashes[k]);
    out[k] = kMode == RotationMode::kInverseAdd ? out[k] + static_cast<float>(value) : static_cast<float>(value);
  }
}

// Rotates `length` elements starting at a rotation chunk's start: blocks of the largest power of two
// not above what is left, capped at max_block (reference rotation_blocks). `in` is a source pointer
// or DecodedCodes, `hashes` an array or CounterHashes.
template <RotationMode kMode, typename Source, typename Hashes>
void rotate_chunk(Source in, int64_t length, Hashes hashes, int64_t max_block, float* out, double* w) {
  for (int64_t o = 0; o < length;) {
    int64_t block = max_block;
    while (block > length - o) block >>= 1;
    const double c = 1.0 / std::sqrt(static_cast<double>(block));
    bool done = false;
#if defined(QACCEL_HAVE_AVX512)
    done = qaccel_avx512::rotate_block<kMode>(in + o, block, hashes + o, c, out + o, w);
#endif
    if (!done) rotate_block_scalar<kMode>(in + o, block, hashes + o, c, out + o, w);
    o += block;
  }
}

// Rotation chunks of bucket [bs, be) that overlap [s0, s1): f(c0, c1) for chunks of `chunk`
// elements from bs (the last one shorter), each a whole number of rotation blocks.
template <typename F>
void for_each_rotation_chunk(int64_t bs, int64_t be, int64_t s0, int64_t s1, int64_t chunk, F&& f) {
  for (int64_t c0 = bs + (s0 - bs) / chunk * chunk; c0 < s1; c0 += chunk) f(c0, std::min(be, c0 + chunk));
}

// The chunk length of a bucket: the whole bucket when fused, else max_block.
inline int64_t rotation_chunk(int64_t bucket, int64_t max_block) {
  return bucket <= kFusedMaxBucket ? bucket : max_block;
}

// Rotated values r of elements [c0, c1) of x (one chunk) into scratch.values, their hashes in
// scratch.hashes.
template <typename T>
void rotate_forward(const T* x, uint64_t seed, int64_t c0, int64_t c1, int64_t max_block, RotationScratch& scratch) {
  fill_hashes(seed, c0, c1 - c0, scratch.hashes);
  rotate_chunk<RotationMode::kForward>(x + c0, c1 - c0, scratch.hashes, max_block, scratch.values, scratch.block);
}

// The grid of bucket [bs, be) of a rotated segment, from its rotated values chunk by chunk.
template <typename T>
BucketGrid rotated_bucket_grid(const T* x, int64_t bs, int64_t be, uint64_t seed, int64_t max_block, int bits,
                               bool meta_bf16, RotationScratch& scratch) {
  Extremes extremes;
  for_each_rotation_chunk(bs, be, bs, be, max_block, [&](int64_t c0, int64_t c1) {
    rotate_forward(x, seed, c0, c1, max_block, scratch);
    extremes.add(scratch.values, c1 - c0);
  });
  return extremes.grid(bits, meta_bf16);
}

inline void store_grid(const BucketGrid& grid, bool meta_bf16, void* lo, void* scale, int64_t bucket) {
  if (meta_bf16) {
    const uint16_t scale_bits =
        std::isnan(grid.scale) ? qaccel::kBf16QuietNaN : static_cast<uint16_t>(qaccel::float_bits(grid.scale) >> 16);
    static_cast<uint16_t*>(lo)[bucket] = static_cast<uint16_t>(qaccel::float_bits(grid.lo) >> 16);
    static_cast<uint16_t*>(scale)[bucket] = scale_bits;
  } else {
    static_cast<float*>(lo)[bucket] = grid.lo;
    static_cast<float*>(scale)[bucket] = grid.scale;
  }
}

// Pack `count` codes of a tile (a multiple of 8 except at the end of the tensor). The tile buffer
// has room up to the next multiple of 8; those padding codes are zeroed first. bits == 8 never
// gets here: its codes are encoded straight into the output.
template <int kBits>
void pack_groups(const uint8_t* codes, int64_t groups, uint8_t* out) {
  for (int64_t g = 0; g < groups; ++g) qaccel::pack_group(codes + 8 * g, kBits, out + kBits * g);
}

void pack_tile(int bits, uint8_t* codes, int64_t count, uint8_t* out) {
  const int64_t padded = (count + 7) / 8 * 8;
  std::fill(codes + count, codes + padded, uint8_t{0});
  switch (bits) {
    case 2:  // four codes per byte, LSB first (= the 8-codes-in-2-bytes group layout)
      for (int64_t i = 0; i < padded / 4; ++i)
        out[i] = static_cast<uint8_t>(codes[4 * i] | (codes[4 * i + 1] << 2) | (codes[4 * i + 2] << 4) |
                                      (codes[4 * i + 3] << 6));
      return;
    case 4:
      for (int64_t i = 0; i < padded / 2; ++i) out[i] = static_cast<uint8_t>(codes[2 * i] | (codes[2 * i + 1] << 4));
      return;
    case 3: return pack_groups<3>(codes, padded / 8, out);
    case 5: return pack_groups<5>(codes, padded / 8, out);
    case 6: return pack_groups<6>(codes, padded / 8, out);
    default: return pack_groups<7>(codes, padded / 8, out);
  }
}

template <int kBits>
void unpack_groups(const uint8_t* packed, int64_t groups, uint8_t* codes) {
  constexpr uint64_t mask = (1u << kBits) - 1u;
  for (int64_t g = 0; g < groups; ++g) {
    const uint64_t word = qaccel::load_group(packed + kBits * g, kBits);
    for (int j = 0; j < 8; ++j) codes[8 * g + j] = static_cast<uint8_t>((word >> (kBits * j)) & mask);
  }
}

// Codes of `count` elements starting at a multiple of 8; `buffer` holds count rounded up to 8.
const uint8_t* unpack_tile(int bits, const uint8_t* packed, int64_t count, uint8_t* buffer) {
  const int64_t groups = (count + 7) / 8;
  switch (bits) {
    case 8: return packed;  // one code per byte already
    case 2:
      for (int64_t i = 0; i < 2 * groups; ++i) {
        const uint32_t byte = packed[i];
        for (int j = 0; j < 4; ++j) buffer[4 * i + j] = static_cast<uint8_t>((byte >> (2 * j)) & 3u);
      }
      return buffer;
    case 4:
      for (int64_t i = 0; i < 4 * groups; ++i) {
        buffer[2 * i] = packed[i] & 15u;
        buffer[2 * i + 1] = packed[i] >> 4;
      }
      return buffer;
    case 3: unpack_groups<3>(packed, groups, buffer); return buffer;
    case 5: unpack_groups<5>(packed, groups, buffer); return buffer;
    case 6: unpack_groups<6>(packed, groups, buffer); return buffer;
    default: unpack_groups<7>(packed, groups, buffer); return buffer;
  }
}

// Encode elements [e0, e1) of a tensor of `numel` elements (e0 a multiple of 8, e1 - e0 <= kTileNumel).
// `grids` holds every bucket's grid (buckets longer than kFusedMaxBucket) or is null:
// then the tile computes the grids it touches and stores the metadata of the buckets starting in it.
// `buffer` has room for kTileNumel codes (unused for bits == 8). With `rotation` (scratch of a rotated
// spec), each bucket is Hadamard-rotated chunk by chunk and quantized from the rotated values.
template <typename T>
void encode_tile(const T* x, int64_t numel, int64_t e0, int64_t e1, int bits, int64_t bucket, bool nearest,
                 uint64_t seed, bool meta_bf16, const BucketGrid* grids, void* lo, void* scale, uint8_t* packed,
                 uint8_t* buffer, RotationScratch* rotation = nullptr, int64_t max_block = 0) {
  const int levels = (1 << bits) - 1;
  uint8_t* codes = bits == 8 ? packed + e0 : buffer;
  for (int64_t b = e0 / bucket; b * bucket < e1; ++b) {
    const int64_t bs = b * bucket, be = std::min(numel, bs + bucket);
    const int64_t s0 = std::max(bs, e0), s1 = std::min(be, e1);
    if (rotation != nullptr) {
      // Chunk by chunk through the scratch. A fused bucket is one chunk, whose grid comes from its
      // rotated values right there; a long bucket's grid came from the separate pass.
      BucketGrid grid = grids == nullptr ? BucketGrid{} : grids[b];
      for_each_rotation_chunk(bs, be, s0, s1, rotation_chunk(bucket, max_block), [&](int64_t c0, int64_t c1) {
        rotate_forward(x, seed, c0, c1, max_block, *rotation);
        if (grids == nullptr) {
          grid = bucket_grid(rotation->values, 0, c1 - c0, bits, meta_bf16);
          if (bs >= e0) store_grid(grid, meta_bf16, lo, scale, b);
        }
        const int64_t o0 = std::max(c0, s0), o1 = std::min(c1, s1);
        encode_run(rotation->values + (o0 - c0), o1 - o0, grid.lo64, grid.inv, nearest, 0, 0,
                   rotation->hashes + (o0 - c0), levels, codes + (o0 - e0));
      });
      continue;
    }
    BucketGrid grid;
    if (grids == nullptr) {
      grid = bucket_grid(x, bs, be, bits, meta_bf16);
      if (bs >= e0) store_grid(grid, meta_bf16, lo, scale, b);
    } else {
      grid = grids[b];
    }
    encode_segment(x, s0, s1, grid, nearest, seed, levels, codes + (s0 - e0));
  }
  if (bits == 8) {
    std::fill(codes + (e1 - e0), codes + (e1 - e0 + 7) / 8 * 8, uint8_t{0});  // padding codes
  } else {
    pack_tile(bits, codes, e1 - e0, packed + (e0 / 8) * bits);
  }
}

template <typename T>
void quantize_impl(const T* x, int64_t numel, int bits, int64_t bucket, bool nearest, uint64_t seed, bool meta_bf16,
                   void* lo, void* scale, uint8_t* packed) {
  const int64_t num_buckets = (numel + bucket - 1) / bucket;
  const bool fused = bucket <= kFusedMaxBucket;
  std::vector<BucketGrid> grids;
  if (!fused) {
    grids.resize(num_buckets);
    at::parallel_for(0, num_buckets, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b) {
        grids[b] = bucket_grid(x, b * bucket, std::min(numel, (b + 1) * bucket), bits, meta_bf16);
        store_grid(grids[b], meta_bf16, lo, scale, b);
      }
    });
  }
  const int64_t tiles = (numel + kTileNumel - 1) / kTileNumel;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> buffer(bits == 8 ? 0 : kTileNumel);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e0 = t * kTileNumel, e1 = std::min(numel, e0 + kTileNumel);
      encode_tile(x, numel, e0, e1, bits, bucket, nearest, seed, meta_bf16, fused ? nullptr : grids.data(), lo, scale,
                  packed, buffer.data());
    }
  });
}

// Decode elements [e0, e1) (e0 a multiple of 8, e1 - e0 <= kTileNumel) into out_tile[0, e1 - e0), overwriting or
// adding in fp32. `buffer` has room for kTileNumel codes.
template <typename Meta, typename Out>
void decode_tile(const uint8_t* packed, const Meta* lo, const Meta* scale, int bits, int64_t bucket, int64_t numel,
                 int64_t e0, int64_t e1, Out* out_tile, bool accumulate, uint8_t* buffer) {
  const uint8_t* codes = unpack_tile(bits, packed + (e0 / 8) * bits, e1 - e0, buffer);
  for (int64_t b = e0 / bucket; b * bucket < e1; ++b) {
    const int64_t s0 = std::max(b * bucket, e0), s1 = std::min(std::min(numel, (b + 1) * bucket), e1);
    const double lo64 = static_cast<double>(static_cast<float>(lo[b]));
    const double scale64 = static_cast<double>(static_cast<float>(scale[b]));
    const uint8_t* seg = codes + (s0 - e0);
    Out* out = out_tile + (s0 - e0);
    if (accumulate) {
      for (int64_t i = 0; i < s1 - s0; ++i) {
        const float sum = static_cast<float>(out[i]) + qaccel::decode_value(lo64, scale64, seg[i]);
        store_out(out, i, sum);
      }
    } else {
      for (int64_t i = 0; i < s1 - s0; ++i) store_out(out, i, qaccel::decode_value(lo64, scale64, seg[i]));
    }
  }
}

// Decoded values y of elements [c0, c1) of one bucket (a rotation chunk), rotated back into `out`
// (scratch.values, or an fp32 destination): x_hat = fp32((w * c) * d) with w = double(y) after the
// butterflies, stored (kInverse) or added (kInverseAdd).
template <RotationMode kMode>
void decode_rotated_chunk(const uint8_t* packed, int bits, float lo, float scale, uint64_t seed, int64_t c0,
                          int64_t c1, int64_t max_block, RotationScratch& scratch, float* out) {
  const int64_t g0 = c0 / 8 * 8, n = c1 - c0;
  const uint8_t* codes = unpack_tile(bits, packed + g0 / 8 * bits, c1 - g0, scratch.codes) + (c0 - g0);
  const DecodedCodes decoded{codes, lo, scale};
  const uint64_t index_hi = static_cast<uint64_t>(c0) >> 32;
  if (static_cast<uint64_t>(c1 - 1) >> 32 == index_hi) {  // one RNG key: hashes computed in the kernel
    const CounterHashes hashes{qaccel::rng_key(seed, static_cast<uint32_t>(index_hi)), static_cast<uint32_t>(c0)};
    rotate_chunk<kMode>(decoded, n, hashes, max_block, out, scratch.block);
  } else {
    fill_hashes(seed, c0, n, scratch.hashes);
    rotate_chunk<kMode>(decoded, n, scratch.hashes, max_block, out, scratch.block);
  }
}

// decode_tile of a rotated segment decoded with `seed`: each bucket chunk by chunk through the scratch.
template <typename Meta, typename Out>
void decode_tile_rotated(const uint8_t* packed, const Meta* lo, const Meta* scale, int bits, int64_t bucket,
                         int64_t numel, int64_t e0, int64_t e1, uint64_t seed, int64_t max_block, Out* out_tile,
                         bool accumulate, RotationScratch& scratch) {
  for (int64_t b = e0 / bucket; b * bucket < e1; ++b) {
    const int64_t bs = b * bucket, be = std::min(numel, bs + bucket);
    const int64_t s0 = std::max(bs, e0), s1 = std::min(be, e1);
    const float lo32 = static_cast<float>(lo[b]), scale32 = static_cast<float>(scale[b]);
    for_each_rotation_chunk(bs, be, s0, s1, rotation_chunk(bucket, max_block), [&](int64_t c0, int64_t c1) {
      const int64_t o0 = std::max(c0, s0), o1 = std::min(c1, s1);
      if constexpr (std::is_same_v<Out, float>) {
        if (o0 == c0 && o1 == c1) {  // the whole chunk is in the tile: rotate straight into the output
          float* dst = out_tile + (c0 - e0);
          if (accumulate) {
            decode_rotated_chunk<RotationMode::kInverseAdd>(packed, bits, lo32, scale32, seed, c0, c1, max_block,
                                                            scratch, dst);
          } else {
            decode_rotated_chunk<RotationMode::kInverse>(packed, bits, lo32, scale32, seed, c0, c1, max_block,
                                                         scratch, dst);
          }
          return;
        }
      }
      decode_rotated_chunk<RotationMode::kInverse>(packed, bits, lo32, scale32, seed, c0, c1, max_block, scratch,
                                                   scratch.values);
      const float* decoded = scratch.values + (o0 - c0);
      Out* out = out_tile + (o0 - e0);
      if (accumulate) {
        for (int64_t i = 0; i < o1 - o0; ++i) store_out(out, i, static_cast<float>(out[i]) + decoded[i]);
      } else {
        for (int64_t i = 0; i < o1 - o0; ++i) store_out(out, i, decoded[i]);
      }
    });
  }
}

template <typename Meta, typename Out>
void dequantize_impl(const uint8_t* packed, const Meta* lo, const Meta* scale, int bits, int64_t bucket, Out* out,
                     int64_t numel, bool accumulate) {
  const int64_t tiles = (numel + kTileNumel - 1) / kTileNumel;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> buffer(bits == 8 ? 0 : kTileNumel);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e0 = t * kTileNumel, e1 = std::min(numel, e0 + kTileNumel);
      decode_tile(packed, lo, scale, bits, bucket, numel, e0, e1, out + e0, accumulate, buffer.data());
    }
  });
}

void check_cpu_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf, name, ".dtype=", dtype,
              ": must be float32, bfloat16 or float16");
}

// The seed travels as the int64 bit pattern of the unsigned 64-bit seed (a schema `int` is signed).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_buckets(const at::Tensor& x, int64_t bits, int64_t bucket_size,
                                                                bool nearest, int64_t seed_bits,
                                                                at::ScalarType meta_dtype) {
  const bool meta_bf16 = qaccel::is_bf16_meta(meta_dtype);
  const auto seed = static_cast<uint64_t>(seed_bits);
  check_cpu_contiguous(x, "x");
  check_float_dtype(x, "x");
  qaccel::check_codec_args(bits, bucket_size);
  const int64_t numel = x.numel();
  const int64_t num_buckets = (numel + bucket_size - 1) / bucket_size;
  const auto meta_options = x.options().dtype(meta_bf16 ? at::kBFloat16 : at::kFloat);
  auto lo = at::empty({num_buckets}, meta_options);
  auto scale = at::empty({num_buckets}, meta_options);
  auto packed = at::empty({bits * ((numel + 7) / 8)}, x.options().dtype(at::kByte));
  if (numel == 0) return {packed, lo, scale};
  advise_huge_pages(packed.data_ptr(), packed.numel());
  const int b = static_cast<int>(bits);
  uint8_t* codes = packed.data_ptr<uint8_t>();
  switch (x.scalar_type()) {
    case at::kFloat:
      quantize_impl(x.data_ptr<float>(), numel, b, bucket_size, nearest, seed, meta_bf16, lo.data_ptr(),
                    scale.data_ptr(), codes);
      break;
    case at::kBFloat16:
      quantize_impl(x.data_ptr<c10::BFloat16>(), numel, b, bucket_size, nearest, seed, meta_bf16, lo.data_ptr(),
                    scale.data_ptr(), codes);
      break;
    default:
      quantize_impl(x.data_ptr<c10::Half>(), numel, b, bucket_size, nearest, seed, meta_bf16, lo.data_ptr(),
                    scale.data_ptr(), codes);
  }
  return {packed, lo, scale};
}

template <typename Meta>
void dequantize_meta(const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& scale, int bits,
                     int64_t bucket, at::Tensor& out, bool accumulate) {
  const uint8_t* packed = codes.data_ptr<uint8_t>();
  const Meta* lo_p = lo.data_ptr<Meta>();
  const Meta* scale_p = scale.data_ptr<Meta>();
  const int64_t numel = out.numel();
  switch (out.scalar_type()) {
    case at::kFloat:
      dequantize_impl(packed, lo_p, scale_p, bits, bucket, out.data_ptr<float>(), numel, accumulate);
      break;
    case at::kBFloat16:
      dequantize_impl(packed, lo_p, scale_p, bits, bucket, out.data_ptr<c10::BFloat16>(), numel, accumulate);
      break;
    default:
      dequantize_impl(packed, lo_p, scale_p, bits, bucket, out.data_ptr<c10::Half>(), numel, accumulate);
  }
}

void dequantize_into(const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& scale, int64_t bits,
                     int64_t bucket_size, at::Tensor out, bool accumulate) {
  check_cpu_contiguous(codes, "codes");
  check_cpu_contiguous(lo, "lo");
  check_cpu_contiguous(scale, "scale");
  check_cpu_contiguous(out, "out");
  check_float_dtype(out, "out");
  const int64_t numel = out.numel();
  qaccel::check_decode_args(codes, lo, scale, bits, bucket_size, numel);
  if (numel == 0) return;
  if (lo.scalar_type() == at::kFloat) {
    dequantize_meta<float>(codes, lo, scale, static_cast<int>(bits), bucket_size, out, accumulate);
  } else {
    dequantize_meta<c10::BFloat16>(codes, lo, scale, static_cast<int>(bits), bucket_size, out, accumulate);
  }
}

template <typename T>
void sign_pack_impl(const T* x, int64_t chunks, int64_t chunk_numel, uint8_t* out) {
  const int64_t chunk_bytes = (chunk_numel + 7) / 8;
  at::parallel_for(0, chunks * chunk_bytes, kTileNumel / 8, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t chunk = k / chunk_bytes, first = (k % chunk_bytes) * 8;
      const int64_t count = std::min<int64_t>(8, chunk_numel - first);
      const T* src = x + chunk * chunk_numel + first;
      uint32_t byte = 0;
      for (int64_t j = 0; j < count; ++j) byte |= static_cast<uint32_t>(load_f32(src, j) >= 0.0f) << (7 - j);
      out[k] = static_cast<uint8_t>(byte);  // MSB first; NaN compares false -> bit 0
    }
  });
}

at::Tensor sign_pack(const at::Tensor& x, int64_t chunks) {
  check_cpu_contiguous(x, "x");
  check_float_dtype(x, "x");
  TORCH_CHECK(chunks >= 1 && x.numel() % chunks == 0, "chunks=", chunks, ": must divide x.numel()=", x.numel());
  const int64_t chunk_numel = x.numel() / chunks;
  const int64_t total = x.numel() == 0 ? 0 : chunks * ((chunk_numel + 7) / 8);
  auto out = at::empty({total}, x.options().dtype(at::kByte));
  if (total == 0) return out;
  uint8_t* dst = out.data_ptr<uint8_t>();
  switch (x.scalar_type()) {
    case at::kFloat: sign_pack_impl(x.data_ptr<float>(), chunks, chunk_numel, dst); break;
    case at::kBFloat16: sign_pack_impl(x.data_ptr<c10::BFloat16>(), chunks, chunk_numel, dst); break;
    default: sign_pack_impl(x.data_ptr<c10::Half>(), chunks, chunk_numel, dst);
  }
  return out;
}

void sign_unpack(const at::Tensor& signs, const at::Tensor& scales, int64_t numel, at::Tensor out) {
  check_cpu_contiguous(signs, "signs");
  check_cpu_contiguous(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out.dtype=", out.scalar_type(), ": must be float32");
  TORCH_CHECK(out.numel() == numel, "out.numel()=", out.numel(), ": must equal numel=", numel);
  if (numel == 0) return;
  const auto scales32 = scales.to(at::kFloat).contiguous();
  const int64_t chunks = scales32.numel();
  TORCH_CHECK(chunks >= 1 && numel % chunks == 0, "scales has ", chunks, " chunks: must divide numel=", numel);
  const int64_t chunk_numel = numel / chunks, chunk_bytes = (chunk_numel + 7) / 8;
  TORCH_CHECK(signs.numel() == chunks * chunk_bytes, "signs has ", signs.numel(), " bytes: expected ",
              chunks * chunk_bytes);
  const uint8_t* src = signs.data_ptr<uint8_t>();
  const float* scale = scales32.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, chunks * chunk_bytes, kTileNumel / 8, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t chunk = k / chunk_bytes, first = (k % chunk_bytes) * 8;
      const int64_t count = std::min<int64_t>(8, chunk_numel - first);
      const float chunk_scale = scale[chunk];
      const uint32_t byte = src[k];
      float* out_byte = dst + chunk * chunk_numel + first;
      for (int64_t j = 0; j < count; ++j) {
        const int sign = 2 * static_cast<int>((byte >> (7 - j)) & 1u) - 1;
        // (+-1) * scale in fp32, as the reference multiplies (negating would flip a NaN's sign).
        out_byte[j] = static_cast<float>(sign) * chunk_scale;
      }
    }
  });
}

// ---- fused payloads (quant_payload.h; reference.encode_payloads / decode_payloads / sum_payloads) --
//
// One call covers every (slot, segment): the work is a list of tiles (slot, segment, [e0, e1)) of
// at most kTileNumel elements, cut at the same places as quantize/dequantize cut a lone segment,
// run by one at::parallel_for. Each output byte has one writer, so the bytes do not depend on the
// thread count. Nothing is allocated per segment.

namespace pl = qaccel::payload;

struct Tile {
  int64_t slot, seg, e0, e1;
};

// Tiles of every segment for `slots` slots (the sum walks elements once: slots == 1 there). A rotated
// spec with fused buckets cuts tiles at multiples of lcm(bucket, 8), so each bucket is rotated once.
std::vector<Tile> payload_tiles(const pl::Params& p, const int64_t* rows, int64_t slots) {
  int64_t tile_numel = kTileNumel;
  if (p.rotation && p.bucket <= kFusedMaxBucket) {
    const int64_t cell = std::lcm<int64_t>(p.bucket, 8);  // <= 8 * kFusedMaxBucket == kTileNumel
    tile_numel = kTileNumel / cell * cell;
  }
  std::vector<Tile> tiles;
  for (int64_t s = 0; s < slots; ++s) {
    for (int64_t i = 0; i < p.num_segments; ++i) {
      const int64_t n = rows[i * pl::kRowLen + pl::kSegNumel];
      for (int64_t e0 = 0; e0 < n; e0 += tile_numel) tiles.push_back({s, i, e0, std::min(n, e0 + tile_numel)});
    }
  }
  return tiles;
}

int dtype_code(at::ScalarType t) { return t == at::kFloat ? 0 : (t == at::kBFloat16 ? 1 : 2); }

// dst[k] = fp32(src[k]) for a tile of a float32 / bfloat16 / float16 array.
void load_tile_f32(const void* src, int dtype, int64_t n, float* dst) {
  switch (dtype) {
    case 0: std::memcpy(dst, src, n * sizeof(float)); break;
    case 1:
      for (int64_t k = 0; k < n; ++k) dst[k] = load_f32(static_cast<const c10::BFloat16*>(src), k);
      break;
    default:
      for (int64_t k = 0; k < n; ++k) dst[k] = load_f32(static_cast<const c10::Half*>(src), k);
  }
}

// acc[k] = acc[k] + fp32(src[k]), as total.add_(raw.to(float32)).
void add_tile_f32(const void* src, int dtype, int64_t n, float* acc) {
  switch (dtype) {
    case 0:
      for (int64_t k = 0; k < n; ++k) acc[k] = acc[k] + static_cast<const float*>(src)[k];
      break;
    case 1:
      for (int64_t k = 0; k < n; ++k) acc[k] = acc[k] + load_f32(static_cast<const c10::BFloat16*>(src), k);
      break;
    default:
      for (int64_t k = 0; k < n; ++k) acc[k] = acc[k] + load_f32(static_cast<const c10::Half*>(src), k);
  }
}

template <typename Out>
void store_tile(const float* src, int64_t n, Out* dst) {
  for (int64_t k = 0; k < n; ++k) store_out(dst, k, src[k]);
}

// Raw elements of dtype `dtype` into Out: bit copy when the dtypes agree (as Tensor.copy_), else
// a conversion through fp32, exact for every widening and rounding to nearest even otherwise.
template <typename Out>
void copy_raw(const uint8_t* raw, int dtype, int64_t n, Out* dst, float* scratch) {
  if (dtype == dtype_code(c10::CppTypeToScalarType<Out>::value)) {
    std::memcpy(dst, raw, n * sizeof(Out));
    return;
  }
  load_tile_f32(raw, dtype, n, scratch);
  store_tile(scratch, n, dst);
}

template <typename T>
void encode_payloads_impl(const T* src, const pl::Params& p, const int64_t* rows, const int64_t* offsets,
                          const uint64_t* seeds, int64_t slots, uint8_t* out) {
  const int64_t meta_size = p.meta_bf16 ? 2 : 4;
  const bool fused = p.bucket <= kFusedMaxBucket;
  std::vector<BucketGrid> grids;  // long buckets: every (slot, bucket) grid first, as quantize_impl does
  if (!fused && p.num_buckets > 0) {
    std::vector<int64_t> bucket_seg(p.num_buckets);
    for (int64_t i = 0; i < p.num_segments; ++i) {
      const int64_t* row = rows + i * pl::kRowLen;
      if (!row[pl::kQuantized]) continue;
      const int64_t count = (row[pl::kSegNumel] + p.bucket - 1) / p.bucket;
      for (int64_t b = 0; b < count; ++b) bucket_seg[row[pl::kBucketOffset] + b] = i;
    }
    grids.resize(slots * p.num_buckets);
    at::parallel_for(0, slots * p.num_buckets, 1, [&](int64_t k0, int64_t k1) {
      const auto rotation = rotation_scratch(p.rotation);
      for (int64_t k = k0; k < k1; ++k) {
        const int64_t s = k / p.num_buckets, global = k % p.num_buckets;
        const int64_t seg = bucket_seg[global];
        const int64_t* row = rows + seg * pl::kRowLen;
        const int64_t b = global - row[pl::kBucketOffset], n = row[pl::kSegNumel];
        const int64_t bs = b * p.bucket, be = std::min(n, bs + p.bucket);
        const T* x = src + offsets[s] + row[pl::kElemOffset];
        uint8_t* meta = out + s * p.nbytes + p.meta_offset;
        grids[k] = rotation ? rotated_bucket_grid(x, bs, be, seeds[s * p.num_segments + seg], p.rotation_max_block,
                                                  p.bits, p.meta_bf16, *rotation)
                            : bucket_grid(x, bs, be, p.bits, p.meta_bf16);
        store_grid(grids[k], p.meta_bf16, meta, meta + meta_size * p.num_buckets, global);
      }
    });
  }
  const std::vector<Tile> tiles = payload_tiles(p, rows, slots);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> buffer(p.bits == 8 ? 0 : kTileNumel);
    const auto rotation = rotation_scratch(p.rotation);
    for (int64_t t = t0; t < t1; ++t) {
      const Tile& tile = tiles[t];
      const int64_t* row = rows + tile.seg * pl::kRowLen;
      const T* x = src + offsets[tile.slot] + row[pl::kElemOffset];
      uint8_t* blob = out + tile.slot * p.nbytes;
      if (!row[pl::kQuantized]) {
        std::memcpy(blob + row[pl::kRawByteOffset] + tile.e0 * p.elem_itemsize, x + tile.e0,
                    (tile.e1 - tile.e0) * p.elem_itemsize);
        continue;
      }
      uint8_t* lo = blob + p.meta_offset + meta_size * row[pl::kBucketOffset];
      uint8_t* scale = lo + meta_size * p.num_buckets;
      const BucketGrid* seg_grids = fused ? nullptr : grids.data() + tile.slot * p.num_buckets + row[pl::kBucketOffset];
      encode_tile(x, row[pl::kSegNumel], tile.e0, tile.e1, p.bits, p.bucket, p.nearest,
                  seeds[tile.slot * p.num_segments + tile.seg], p.meta_bf16, seg_grids, lo, scale,
                  blob + row[pl::kCodeOffset], buffer.data(), rotation.get(), p.rotation_max_block);
    }
  });
  for (int64_t s = 0; s < slots; ++s) {  // padding bytes, so payloads are deterministic byte for byte
    uint8_t* blob = out + s * p.nbytes;
    std::fill(blob + p.code_bytes, blob + p.meta_offset, uint8_t{0});
    std::fill(blob + p.raw_offset + p.raw_bytes, blob + p.nbytes, uint8_t{0});
  }
}

// Decode quantized tile [e0, e1) of segment `row` of one payload into out_tile (overwrite or fp32 add),
// rotating back with `seed` when the spec is rotated.
template <typename Meta, typename Out>
void decode_payload_tile(const uint8_t* blob, const pl::Params& p, const int64_t* row, int64_t e0, int64_t e1,
                         uint64_t seed, Out* out_tile, bool accumulate, uint8_t* buffer, RotationScratch* rotation) {
  const Meta* lo = reinterpret_cast<const Meta*>(blob + p.meta_offset) + row[pl::kBucketOffset];
  const Meta* scale = lo + p.num_buckets;
  const uint8_t* packed = blob + row[pl::kCodeOffset];
  if (rotation != nullptr) {
    decode_tile_rotated(packed, lo, scale, p.bits, p.bucket, row[pl::kSegNumel], e0, e1, seed, p.rotation_max_block,
                        out_tile, accumulate, *rotation);
  } else {
    decode_tile(packed, lo, scale, p.bits, p.bucket, row[pl::kSegNumel], e0, e1, out_tile, accumulate, buffer);
  }
}

// `seeds` ([slots, segments]) is read only when the spec is rotated.
template <typename Meta, typename Out>
void decode_payloads_impl(const uint8_t* blob_all, const pl::Params& p, const int64_t* rows, const int64_t* offsets,
                          const uint64_t* seeds, int64_t slots, Out* out) {
  const std::vector<Tile> tiles = payload_tiles(p, rows, slots);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> buffer(p.bits == 8 ? 0 : kTileNumel);
    std::vector<float> scratch(kTileNumel);
    const auto rotation = rotation_scratch(p.rotation);
    for (int64_t t = t0; t < t1; ++t) {
      const Tile& tile = tiles[t];
      const int64_t* row = rows + tile.seg * pl::kRowLen;
      const uint8_t* blob = blob_all + tile.slot * p.nbytes;
      Out* dst = out + offsets[tile.slot] + row[pl::kElemOffset] + tile.e0;
      if (!row[pl::kQuantized]) {
        copy_raw(blob + row[pl::kRawByteOffset] + tile.e0 * p.elem_itemsize, p.elem_dtype, tile.e1 - tile.e0, dst,
                 scratch.data());
        continue;
      }
      const uint64_t seed = p.rotation ? seeds[tile.slot * p.num_segments + tile.seg] : 0;
      decode_payload_tile<Meta>(blob, p, row, tile.e0, tile.e1, seed, dst, false, buffer.data(), rotation.get());
    }
  });
}

// `seeds` ([slots, segments]) is read only when the spec is rotated.
template <typename Meta, typename Out>
void sum_payloads_impl(const uint8_t* blob_all, const pl::Params& p, const int64_t* rows, const uint64_t* seeds,
                       int64_t slots, const void* base, int base_dtype, int64_t base_itemsize, Out* out) {
  const std::vector<Tile> tiles = payload_tiles(p, rows, 1);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint8_t> buffer(p.bits == 8 ? 0 : kTileNumel);
    std::vector<float> acc(kTileNumel);
    const auto rotation = rotation_scratch(p.rotation);
    for (int64_t t = t0; t < t1; ++t) {
      const Tile& tile = tiles[t];
      const int64_t* row = rows + tile.seg * pl::kRowLen;
      const int64_t first = row[pl::kElemOffset] + tile.e0, n = tile.e1 - tile.e0;
      load_tile_f32(static_cast<const uint8_t*>(base) + first * base_itemsize, base_dtype, n, acc.data());
      for (int64_t s = 0; s < slots; ++s) {  // slot order: ((base + d_0) + d_1) + ...
        const uint8_t* blob = blob_all + s * p.nbytes;
        if (!row[pl::kQuantized]) {
          add_tile_f32(blob + row[pl::kRawByteOffset] + tile.e0 * p.elem_itemsize, p.elem_dtype, n, acc.data());
          continue;
        }
        const uint64_t seed = p.rotation ? seeds[s * p.num_segments + tile.seg] : 0;
        decode_payload_tile<Meta>(blob, p, row, tile.e0, tile.e1, seed, acc.data(), true, buffer.data(),
                                  rotation.get());
      }
      store_tile(acc.data(), n, out + first);
    }
  });
}

// `device_table` is the same table on the data's device: here the CPU, where the rows are read.
pl::Params checked_params(const at::Tensor& table, const at::Tensor& device_table) {
  check_cpu_contiguous(table, "table");
  check_cpu_contiguous(device_table, "device_table");
  TORCH_CHECK(device_table.scalar_type() == at::kLong && device_table.numel() == table.numel(),
              "device_table: must be the same PayloadSpec table as `table`");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.numel() >= pl::kHeaderLen,
              "table: must be a PayloadSpec table");
  const int64_t* t = table.data_ptr<int64_t>();
  const pl::Params p = pl::read_params(t);
  TORCH_CHECK(table.numel() == pl::kHeaderLen + p.num_segments * pl::kRowLen, "table: ", table.numel(),
              " entries do not match its ", p.num_segments, " segments");
  qaccel::check_codec_args(p.bits, p.bucket);
  const int64_t max_block = p.rotation_max_block;
  TORCH_CHECK(!p.rotation || (max_block >= 1 && max_block <= kMaxRotationBlock && (max_block & (max_block - 1)) == 0),
              "table: rotation_max_block=", max_block, ": must be a power of two <= ", kMaxRotationBlock);
  return p;
}

// The decode seed table ([slots, segments] int64, the encode's) as uint64, or null when the spec is
// not rotated (then `seeds` is ignored: an empty tensor by convention).
const uint64_t* checked_decode_seeds(const std::optional<at::Tensor>& maybe_seeds, const pl::Params& p,
                                     int64_t slots) {
  if (!p.rotation) return nullptr;
  TORCH_CHECK(maybe_seeds.has_value(), "seeds: a rotated spec needs int64 seeds [", slots, ", ", p.num_segments,
              "], got none (the table the payloads were encoded with)");
  const at::Tensor& seeds = *maybe_seeds;
  check_cpu_contiguous(seeds, "seeds");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 2 && seeds.size(0) == slots &&
                  seeds.size(1) == p.num_segments,
              "seeds: a rotated spec needs int64 seeds [", slots, ", ", p.num_segments, "], got ", seeds.scalar_type(),
              " ", seeds.sizes());
  return reinterpret_cast<const uint64_t*>(seeds.data_ptr<int64_t>());
}

void check_slot_offsets(const at::Tensor& offsets, int64_t slots, int64_t numel, int64_t limit, const char* name) {
  check_cpu_contiguous(offsets, name);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.numel() == slots, name, ": expected ", slots,
              " int64 offsets");
  const int64_t* o = offsets.data_ptr<int64_t>();
  for (int64_t s = 0; s < slots; ++s)
    TORCH_CHECK(o[s] >= 0 && o[s] + numel <= limit, name, "[", s, "]=", o[s], ": chunk out of range");
}

void encode_payloads(const at::Tensor& src, const at::Tensor& table, const at::Tensor& device_table,
                     const at::Tensor& offsets, const at::Tensor& seeds, at::Tensor out) {
  check_cpu_contiguous(src, "src");
  check_float_dtype(src, "src");
  check_cpu_contiguous(out, "out");
  check_cpu_contiguous(seeds, "seeds");
  const pl::Params p = checked_params(table, device_table);
  TORCH_CHECK(dtype_code(src.scalar_type()) == p.elem_dtype, "src.dtype=", src.scalar_type(),
              ": must be the spec's element dtype");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 2 && seeds.size(1) == p.num_segments,
              "seeds: expected int64 [slots, ", p.num_segments, "]");
  const int64_t slots = seeds.size(0);
  check_slot_offsets(offsets, slots, p.numel, src.numel(), "src_offsets");
  TORCH_CHECK(out.scalar_type() == at::kByte && out.numel() == slots * p.nbytes, "out: expected ", slots * p.nbytes,
              " uint8 bytes");
  if (slots == 0 || p.nbytes == 0) return;
  const int64_t* rows = device_table.data_ptr<int64_t>() + pl::kHeaderLen;
  const int64_t* o = offsets.data_ptr<int64_t>();
  const auto* sd = reinterpret_cast<const uint64_t*>(seeds.data_ptr<int64_t>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  switch (src.scalar_type()) {
    case at::kFloat: encode_payloads_impl(src.data_ptr<float>(), p, rows, o, sd, slots, dst); break;
    case at::kBFloat16: encode_payloads_impl(src.data_ptr<c10::BFloat16>(), p, rows, o, sd, slots, dst); break;
    default: encode_payloads_impl(src.data_ptr<c10::Half>(), p, rows, o, sd, slots, dst);
  }
}

template <typename Meta>
void decode_payloads_meta(const uint8_t* blob, const pl::Params& p, const int64_t* rows, const int64_t* o,
                          const uint64_t* sd, int64_t slots, at::Tensor& out) {
  switch (out.scalar_type()) {
    case at::kFloat: decode_payloads_impl<Meta>(blob, p, rows, o, sd, slots, out.data_ptr<float>()); break;
    case at::kBFloat16: decode_payloads_impl<Meta>(blob, p, rows, o, sd, slots, out.data_ptr<c10::BFloat16>()); break;
    default: decode_payloads_impl<Meta>(blob, p, rows, o, sd, slots, out.data_ptr<c10::Half>());
  }
}

void decode_payloads(const at::Tensor& blob, const at::Tensor& table, const at::Tensor& device_table, at::Tensor out,
                     const at::Tensor& offsets, const std::optional<at::Tensor>& seeds) {
  check_cpu_contiguous(blob, "blob");
  check_cpu_contiguous(out, "out");
  check_float_dtype(out, "out");
  const pl::Params p = checked_params(table, device_table);
  const int64_t slots = offsets.numel();
  check_slot_offsets(offsets, slots, p.numel, out.numel(), "out_offsets");
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.numel() == slots * p.nbytes, "blob: expected ",
              slots * p.nbytes, " uint8 bytes");
  const uint64_t* sd = checked_decode_seeds(seeds, p, slots);
  if (slots == 0 || p.numel == 0) return;
  const int64_t* rows = device_table.data_ptr<int64_t>() + pl::kHeaderLen;
  const uint8_t* src = blob.data_ptr<uint8_t>();
  const int64_t* o = offsets.data_ptr<int64_t>();
  if (p.meta_bf16) {
    decode_payloads_meta<c10::BFloat16>(src, p, rows, o, sd, slots, out);
  } else {
    decode_payloads_meta<float>(src, p, rows, o, sd, slots, out);
  }
}

template <typename Meta>
void sum_payloads_meta(const uint8_t* blob, const pl::Params& p, const int64_t* rows, const uint64_t* sd,
                       int64_t slots, const at::Tensor& base, at::Tensor& out) {
  const void* b = base.data_ptr();
  const int bd = dtype_code(base.scalar_type());
  const int64_t bs = base.element_size();
  switch (out.scalar_type()) {
    case at::kFloat: sum_payloads_impl<Meta>(blob, p, rows, sd, slots, b, bd, bs, out.data_ptr<float>()); break;
    case at::kBFloat16:
      sum_payloads_impl<Meta>(blob, p, rows, sd, slots, b, bd, bs, out.data_ptr<c10::BFloat16>());
      break;
    default: sum_payloads_impl<Meta>(blob, p, rows, sd, slots, b, bd, bs, out.data_ptr<c10::Half>());
  }
}

void sum_payloads(const at::Tensor& blob, const at::Tensor& table, const at::Tensor& device_table,
                  const at::Tensor& base, at::Tensor out, const std::optional<at::Tensor>& seeds) {
  check_cpu_contiguous(blob, "blob");
  check_cpu_contiguous(base, "base");
  check_cpu_contiguous(out, "out");
  check_float_dtype(base, "base");
  check_float_dtype(out, "out");
  const pl::Params p = checked_params(table, device_table);
  TORCH_CHECK(base.numel() == p.numel && out.numel() == p.numel, "base/out: expected ", p.numel, " elements");
  TORCH_CHECK(blob.scalar_type() == at::kByte && (p.nbytes == 0 ? blob.numel() == 0 : blob.numel() % p.nbytes == 0),
              "blob: expected a whole number of ", p.nbytes, "-byte payloads");
  const int64_t slots = p.nbytes == 0 ? 0 : blob.numel() / p.nbytes;
  const uint64_t* sd = checked_decode_seeds(seeds, p, slots);
  if (p.numel == 0) return;
  const int64_t* rows = device_table.data_ptr<int64_t>() + pl::kHeaderLen;
  if (p.meta_bf16) {
    sum_payloads_meta<c10::BFloat16>(blob.data_ptr<uint8_t>(), p, rows, sd, slots, base, out);
  } else {
    sum_payloads_meta<float>(blob.data_ptr<uint8_t>(), p, rows, sd, slots, base, out);
  }
}

// ---- fused 1-bit error feedback (reference.onebit_encode / onebit_server; quant_onebit.h) ---------
//
// One pass to compensate, the scale as torch's norm, one pass to sign + pack + update the error.

// Packs `values >= 0` (MSB first, each chunk padded to whole bytes) and overwrites each value with
// `value - (+-1) * scale`, the error the reference computes as values - sign_unpack(...).
void onebit_sign_error(float* values, const float* scales, int64_t chunks, int64_t chunk_numel, uint8_t* out) {
  const int64_t chunk_bytes = (chunk_numel + 7) / 8;
  at::parallel_for(0, chunks * chunk_bytes, kTileNumel / 8, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t chunk = k / chunk_bytes, first = (k % chunk_bytes) * 8;
      const int64_t count = std::min<int64_t>(8, chunk_numel - first);
      const float chunk_scale = scales[chunk];
      float* v = values + chunk * chunk_numel + first;
      uint32_t byte = 0;
      for (int64_t j = 0; j < count; ++j) {
        const uint32_t bit = v[j] >= 0.0f;  // NaN compares false -> bit 0
        byte |= bit << (7 - j);
        // (+-1) * scale as sign_unpack multiplies it (negating would flip a NaN scale's sign), then the
        // difference: the reference's two fp32 roundings.
        const float decoded = static_cast<float>(2 * static_cast<int>(bit) - 1) * chunk_scale;
        v[j] = v[j] - decoded;
      }
      out[k] = static_cast<uint8_t>(byte);
    }
  });
}

// The compensated values are in `error`: compress them and leave the new error there.
std::tuple<at::Tensor, at::Tensor> onebit_compress_error(at::Tensor& error, int64_t chunks) {
  const int64_t chunk_numel = error.numel() / chunks;
  const auto scales = qaccel::onebit_chunk_rms(error, chunks);
  auto signs = at::empty({chunks * ((chunk_numel + 7) / 8)}, error.options().dtype(at::kByte));
  onebit_sign_error(error.data_ptr<float>(), scales.data_ptr<float>(), chunks, chunk_numel, signs.data_ptr<uint8_t>());
  return {signs, scales};
}

template <typename T>
void onebit_compensate(const T* x, int64_t numel, float* error, int64_t padded) {
  at::parallel_for(0, padded, kTileNumel, [&](int64_t i0, int64_t i1) {
    const int64_t split = std::clamp(numel, i0, i1);  // two branch-free loops the compiler vectorizes
    for (int64_t i = i0; i < split; ++i) error[i] = load_f32(x, i) + error[i];
    for (int64_t i = split; i < i1; ++i) error[i] = 0.0f + error[i];  // the zero padding, added as the reference adds it
  });
}

std::tuple<at::Tensor, at::Tensor> onebit_encode(const at::Tensor& x, at::Tensor error, int64_t chunks) {
  check_cpu_contiguous(x, "x");
  check_float_dtype(x, "x");
  qaccel::check_onebit_encode_args(x, error, chunks);
  float* e = error.data_ptr<float>();
  switch (x.scalar_type()) {
    case at::kFloat: onebit_compensate(x.data_ptr<float>(), x.numel(), e, error.numel()); break;
    case at::kBFloat16: onebit_compensate(x.data_ptr<c10::BFloat16>(), x.numel(), e, error.numel()); break;
    default: onebit_compensate(x.data_ptr<c10::Half>(), x.numel(), e, error.numel());
  }
  return onebit_compress_error(error, chunks);
}

std::tuple<at::Tensor, at::Tensor> onebit_server(const at::Tensor& signs, const at::Tensor& scales, at::Tensor error,
                                                 int64_t chunks) {
  check_cpu_contiguous(error, "error");
  const auto averaged_scales = qaccel::onebit_server_scales(signs, scales, error, chunks);
  const int64_t world = scales.numel(), numel = error.numel();
  auto decoded = at::empty({world, numel}, error.options());
  sign_unpack(signs, averaged_scales, world * numel, decoded.view({-1}));
  qaccel::onebit_add_server_sum(decoded, error);
  return onebit_compress_error(error, chunks);
}
}  // namespace

// Kernels for CPU tensors of the ops declared in qaccel/quant/_ops.py.
TORCH_LIBRARY_IMPL(qaccel, CPU, m) { QACCEL_IMPL_CODEC_OPS(m); }
