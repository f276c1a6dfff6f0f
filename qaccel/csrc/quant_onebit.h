// The torch-op parts of the fused 1-bit error-feedback kernels (reference.onebit_encode /
// onebit_server), shared by the CPU extension and the CUDA binding: argument checks, the scale and
// the server's sum over ranks. Those two reductions run as the very torch ops the reference calls
// (their order depends on sizes and thread counts, so no hand-written loop could match them bit for
// bit); each backend fuses the element-wise rest into its own passes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>

namespace qaccel {

// The reference's chunk_rms on a flat fp32 tensor: the same torch calls, so the same bits.
inline at::Tensor onebit_chunk_rms(const at::Tensor& values, int64_t chunks) {
  const int64_t chunk_numel = values.numel() / chunks;
  const double root = std::sqrt(static_cast<double>(chunk_numel));  // math.sqrt: correctly rounded
  if (chunks == 1) return (at::linalg_vector_norm(values, 2) / root).reshape({1}).contiguous();
  return (at::linalg_vector_norm(values.view({chunks, chunk_numel}), 2, at::IntArrayRef{1}) / root).contiguous();
}

inline void check_onebit_error(const at::Tensor& error, int64_t chunks) {
  TORCH_CHECK(error.scalar_type() == at::kFloat && error.dim() == 1 && error.is_contiguous(),
              "error: must be a contiguous 1-D float32 tensor, got ", error.scalar_type(), " ", error.sizes());
  TORCH_CHECK(error.numel() >= 1, "error: must not be empty");
  TORCH_CHECK(chunks >= 1 && error.numel() % chunks == 0, "chunks=", chunks, ": must divide error.numel()=",
              error.numel());
}

inline void check_onebit_encode_args(const at::Tensor& x, const at::Tensor& error, int64_t chunks) {
  check_onebit_error(error, chunks);
  TORCH_CHECK(x.device() == error.device(), "x is on ", x.device(), ", error on ", error.device());
  TORCH_CHECK(x.numel() <= error.numel(), "x has ", x.numel(), " elements: more than error.numel()=", error.numel());
}

// The workers' scales times 1/N, as the reference's `scales * (1 / world)` (the product by a
// wrapped double scalar), after checking the server inputs.
inline at::Tensor onebit_server_scales(const at::Tensor& signs, const at::Tensor& scales, const at::Tensor& error,
                                       int64_t chunks) {
  check_onebit_error(error, chunks);
  TORCH_CHECK(signs.scalar_type() == at::kByte && signs.is_contiguous(), "signs: must be a contiguous uint8 tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 1 && scales.numel() >= 1,
              "scales: must be a non-empty 1-D float32 tensor (one per worker)");
  TORCH_CHECK(signs.device() == error.device() && scales.device() == error.device(),
              "signs, scales and error: must be on one device");
  const int64_t world = scales.numel(), row_bytes = (error.numel() + 7) / 8;
  TORCH_CHECK(signs.numel() == world * row_bytes, "signs has ", signs.numel(), " bytes: expected ", world,
              " rows of ", row_bytes);
  return (scales * (1.0 / static_cast<double>(world))).contiguous();
}

// error = sum over ranks of the decoded rows (torch's order) + error, as the reference adds.
inline void onebit_add_server_sum(const at::Tensor& decoded, at::Tensor& error) {
  at::add_out(error, decoded.sum(0), error);
}

}  // namespace qaccel
