// Host launchers of the CUDA codecs. quant_cuda.cu implements them with nothing but the CUDA
// runtime (so it compiles standalone, fast, even against a CPU-only torch install);
// quant_cuda_binding.cpp is the thin torch/pybind11 layer that checks tensors and allocates.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "quant_payload.h"

namespace qaccel_cuda {

enum class Dtype : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// True when quantize() needs a workspace of 2 * num_buckets doubles (the two-pass path, taken
// when buckets are not whole groups of 8 or x is not 16-byte aligned).
bool quantize_needs_workspace(const void* x, int64_t bucket);

cudaError_t quantize(const void* x, Dtype dtype, int64_t numel, int bits, int64_t bucket, bool nearest, uint64_t seed,
                     bool meta_bf16, void* lo, void* scale, uint8_t* codes, double* workspace, cudaStream_t stream);

cudaError_t dequantize(const uint8_t* codes, const void* lo, const void* scale, bool meta_bf16, int bits,
                       int64_t bucket, void* out, Dtype out_dtype, int64_t numel, bool accumulate,
                       cudaStream_t stream);

cudaError_t sign_pack(const void* x, Dtype dtype, int64_t chunks, int64_t chunk_numel, uint8_t* out,
                      cudaStream_t stream);

cudaError_t sign_unpack(const uint8_t* signs, const float* scales, int64_t chunks, int64_t chunk_numel, float* out,
                        cudaStream_t stream);

// Fused 1-bit error feedback (reference.onebit_encode / onebit_server), the element-wise passes:
// error = pad(x) + error over `padded` elements; then, once the scales are known, pack `values >= 0`
// per chunk and leave `value - (+-1) * scale` in `values`.
cudaError_t onebit_compensate(const void* x, Dtype dtype, int64_t numel, float* error, int64_t padded,
                              cudaStream_t stream);

cudaError_t onebit_sign_error(float* values, const float* scales, int64_t chunks, int64_t chunk_numel, uint8_t* out,
                              cudaStream_t stream);

// Longest Hadamard rotation block the kernels hold in shared memory (ROTATION_MAX_BLOCK of
// qaccel/quant/_types.py); a rotated table must not ask for more.
constexpr int64_t kMaxRotationBlock = 1024;

// Fused payloads (one launch each; qaccel/quant/_payload.py). `rows` points at the segment rows of
// the device copy of the layout table; `p` holds its header. encode: `slot_info` is a device int64
// [slots, 1 + segments] array: chunk offset in `src`, then the uint64 seed of every segment.
// A rotated table (p.rotation) rotates every quantized bucket first (reference.py steps 7-10).
cudaError_t encode_payloads(const void* src, const qaccel::payload::Params& p, const int64_t* rows,
                            const int64_t* slot_info, int64_t slots, uint8_t* out, cudaStream_t stream);

// decode: `offsets` is a device int64 [slots] array, the element offset of each slot's chunk in `out`.
// `seeds` is the device int64 [slots, segments] table the payloads were encoded with; read only when
// p.rotation (the rotation signs come from it), may be null otherwise.
cudaError_t decode_payloads(const uint8_t* blob, const qaccel::payload::Params& p, const int64_t* rows,
                            const int64_t* offsets, const int64_t* seeds, int64_t slots, void* out, Dtype out_dtype,
                            cudaStream_t stream);

// sum: out = fp32(base) + every payload's decoded values in slot order, rounded once; base may be out.
// `seeds` as for decode_payloads.
cudaError_t sum_payloads(const uint8_t* blob, const qaccel::payload::Params& p, const int64_t* rows,
                         const int64_t* seeds, int64_t slots, const void* base, Dtype base_dtype, void* out,
                         Dtype out_dtype, cudaStream_t stream);

}  // namespace qaccel_cuda
