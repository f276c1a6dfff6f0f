// Layout table of a fused QSDP payload, as built by qaccel/quant/_payload.py (PayloadSpec.table).
//
// An int64 array: kHeaderLen header entries, then one row of kRowLen entries per segment. Byte
// offsets are from the start of one payload; "cells" (CUDA encode: one warp each) and "groups"
// (8 elements: CUDA decode, one thread each) are counted per slot. Plain C++ (no torch, no CUDA),
// shared by the C++ and CUDA kernels; the indices must match _payload.py's H_* and C_* names.
#pragma once

#include <cstdint>

namespace qaccel {
namespace payload {

enum Header : int {
  kNumSegments = 0,
  kNumel,          // elements of one chunk
  kNbytes,         // bytes of one payload (a multiple of 4)
  kCodeBytes,      // packed codes of all quantized segments
  kMetaOffset,     // align4(code_bytes): the lo array, then the scale array
  kNumBuckets,     // buckets of all quantized segments (each segment restarts its buckets)
  kRawOffset,      // first byte of the raw segments
  kRawBytes,       // bytes of all raw segments
  kBits,
  kBucket,
  kMetaBf16,       // 1: lo/scale are bfloat16, 0: float32
  kNearest,        // 1: round to nearest, 0: stochastic
  kElemDtype,      // 0 float32, 1 bfloat16, 2 float16 (qaccel_cuda::Dtype)
  kElemItemsize,
  kCellNumel,      // lcm(bucket, 8): whole buckets and whole code groups
  kRawCellNumel,   // elements of a raw segment per cell
  kCellsPerSlot,
  kGroupsPerSlot,  // sum over segments of ceil(numel / 8)
  kRotation,       // 1: quantized segments are Hadamard-rotated per bucket (reference.py steps 7-10)
  kRotationMaxBlock,  // longest power-of-two rotation block (ROTATION_MAX_BLOCK)
  kHeaderLen
};

enum Column : int {
  kElemOffset = 0,  // first element of the segment in the chunk
  kSegNumel,
  kQuantized,       // 1 quantized, 0 raw
  kCodeOffset,      // byte offset of the segment's packed codes
  kBucketOffset,    // index of its first bucket in the lo/scale arrays
  kRawByteOffset,   // byte offset of its raw elements (raw segments)
  kCellOffset,      // first cell of the segment within a slot
  kGroupOffset,     // first group of the segment within a slot
  kRowLen
};

// Header values the launchers need, read once on the host.
struct Params {
  int64_t num_segments, numel, nbytes, code_bytes, meta_offset, num_buckets, raw_offset, raw_bytes;
  int bits;
  int64_t bucket;
  bool meta_bf16, nearest;
  int elem_dtype;
  int64_t elem_itemsize, cell_numel, raw_cell_numel, cells_per_slot, groups_per_slot;
  bool rotation;
  int64_t rotation_max_block;
};

inline Params read_params(const int64_t* table) {
  Params p;
  p.num_segments = table[kNumSegments];
  p.numel = table[kNumel];
  p.nbytes = table[kNbytes];
  p.code_bytes = table[kCodeBytes];
  p.meta_offset = table[kMetaOffset];
  p.num_buckets = table[kNumBuckets];
  p.raw_offset = table[kRawOffset];
  p.raw_bytes = table[kRawBytes];
  p.bits = static_cast<int>(table[kBits]);
  p.bucket = table[kBucket];
  p.meta_bf16 = table[kMetaBf16] != 0;
  p.nearest = table[kNearest] != 0;
  p.elem_dtype = static_cast<int>(table[kElemDtype]);
  p.elem_itemsize = table[kElemItemsize];
  p.cell_numel = table[kCellNumel];
  p.raw_cell_numel = table[kRawCellNumel];
  p.cells_per_slot = table[kCellsPerSlot];
  p.groups_per_slot = table[kGroupsPerSlot];
  p.rotation = table[kRotation] != 0;
  p.rotation_max_block = table[kRotationMaxBlock];
  return p;
}

}  // namespace payload
}  // namespace qaccel
