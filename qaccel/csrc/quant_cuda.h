// Host launchers of the CUDA codecs. quant_cuda.cu implements them with nothing but the CUDA
// runtime (so it compiles standalone, fast, even against a CPU-only torch install);
// quant_cuda_binding.cpp is the thin torch/pybind11 layer that checks tensors and allocates.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

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

}  // namespace qaccel_cuda
