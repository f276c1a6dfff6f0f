// Argument checks shared by the CPU extension and the CUDA binding, so both reject bad input with
// the same messages (the device checks stay with each backend).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace qaccel {

inline void check_codec_args(int64_t bits, int64_t bucket_size) {
  TORCH_CHECK(bits >= 2 && bits <= 8, "bits=", bits, ": must be an int in [2, 8]");
  TORCH_CHECK(bucket_size >= 1, "bucket_size=", bucket_size, ": must be >= 1");
}

// Checks the decode inputs for `numel` output elements.
inline void check_decode_args(const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& scale,
                                 int64_t bits, int64_t bucket_size, int64_t numel) {
  TORCH_CHECK(codes.scalar_type() == at::kByte, "codes.dtype=", codes.scalar_type(), ": must be uint8");
  check_codec_args(bits, bucket_size);
  TORCH_CHECK(lo.scalar_type() == scale.scalar_type() &&
                  (lo.scalar_type() == at::kFloat || lo.scalar_type() == at::kBFloat16),
              "lo/scale: must both be float32 or both bfloat16");
  if (numel == 0) return;
  const int64_t num_buckets = (numel + bucket_size - 1) / bucket_size;
  TORCH_CHECK(codes.numel() >= bits * ((numel + 7) / 8), "codes has ", codes.numel(), " bytes: expected ",
              bits * ((numel + 7) / 8));
  TORCH_CHECK(lo.numel() >= num_buckets && scale.numel() >= num_buckets, "lo/scale: expected ", num_buckets,
              " buckets");
}

// The metadata dtype of quantize_buckets: true for bfloat16, false for float32, anything else an error.
inline bool is_bf16_meta(at::ScalarType meta_dtype) {
  TORCH_CHECK(meta_dtype == at::kFloat || meta_dtype == at::kBFloat16, "meta_dtype=", meta_dtype,
              ": must be float32 or bfloat16");
  return meta_dtype == at::kBFloat16;
}

}  // namespace qaccel
