// Thin torch binding of the CUDA codecs in quant_cuda.cu: checks, allocation, launch.
//
// It includes no c10/cuda or ATen/cuda header (a CPU-only torch wheel lacks some of them): the
// Python side (qaccel/quant/_native.py) makes the tensors' device current and passes the current
// stream's handle, so kernels run on the caller's stream like any torch op.
#include <torch/extension.h>

#include <string>
#include <vector>

#include "quant_checks.h"
#include "quant_cuda.h"

namespace {

using qaccel_cuda::Dtype;

void check_cuda(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

Dtype float_dtype(const torch::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return Dtype::kFloat32;
    case at::kBFloat16: return Dtype::kBFloat16;
    case at::kHalf: return Dtype::kFloat16;
    default: TORCH_CHECK(false, name, ".dtype=", t.scalar_type(), ": must be float32, bfloat16 or float16");
  }
  return Dtype::kFloat32;
}

void check_launch(cudaError_t status, const char* what) {
  TORCH_CHECK(status == cudaSuccess, "qaccel CUDA ", what, " failed: ", cudaGetErrorString(status));
}

cudaStream_t as_stream(int64_t handle) { return reinterpret_cast<cudaStream_t>(static_cast<intptr_t>(handle)); }

std::vector<torch::Tensor> quantize_buckets(torch::Tensor x, int64_t bits, int64_t bucket_size, bool nearest,
                                            uint64_t seed, bool meta_bf16, int64_t stream) {
  check_cuda(x, "x");
  const Dtype dtype = float_dtype(x, "x");
  qaccel::check_codec_args(bits, bucket_size);
  const int64_t numel = x.numel();
  const int64_t num_buckets = (numel + bucket_size - 1) / bucket_size;
  const auto meta_options = x.options().dtype(meta_bf16 ? at::kBFloat16 : at::kFloat);
  auto lo = torch::empty({num_buckets}, meta_options);
  auto scale = torch::empty({num_buckets}, meta_options);
  auto codes = torch::empty({bits * ((numel + 7) / 8)}, x.options().dtype(at::kByte));
  if (numel == 0) return {codes, lo, scale};
  torch::Tensor workspace;
  double* workspace_ptr = nullptr;
  if (qaccel_cuda::quantize_needs_workspace(x.data_ptr(), bucket_size)) {
    workspace = torch::empty({2 * num_buckets}, x.options().dtype(at::kDouble));
    workspace_ptr = workspace.data_ptr<double>();
  }
  check_launch(qaccel_cuda::quantize(x.data_ptr(), dtype, numel, static_cast<int>(bits), bucket_size, nearest, seed,
                                     meta_bf16, lo.data_ptr(), scale.data_ptr(), codes.data_ptr<uint8_t>(),
                                     workspace_ptr, as_stream(stream)),
               "quantize");
  // `workspace` is released after the launch; the caching allocator keeps it for this stream.
  return {codes, lo, scale};
}

torch::Tensor dequantize_into(torch::Tensor codes, torch::Tensor lo, torch::Tensor scale, int64_t bits,
                              int64_t bucket_size, torch::Tensor out, bool accumulate, int64_t stream) {
  check_cuda(codes, "codes");
  check_cuda(lo, "lo");
  check_cuda(scale, "scale");
  check_cuda(out, "out");
  const Dtype out_dtype = float_dtype(out, "out");
  const int64_t numel = out.numel();
  qaccel::check_decode_args(codes, lo, scale, bits, bucket_size, numel);
  if (numel == 0) return out;
  check_launch(qaccel_cuda::dequantize(codes.data_ptr<uint8_t>(), lo.data_ptr(), scale.data_ptr(),
                                       lo.scalar_type() == at::kBFloat16, static_cast<int>(bits), bucket_size,
                                       out.data_ptr(), out_dtype, numel, accumulate, as_stream(stream)),
               "dequantize");
  return out;
}

torch::Tensor sign_pack(torch::Tensor x, int64_t chunks, int64_t stream) {
  check_cuda(x, "x");
  const Dtype dtype = float_dtype(x, "x");
  TORCH_CHECK(chunks >= 1 && x.numel() % chunks == 0, "chunks=", chunks, ": must divide x.numel()=", x.numel());
  const int64_t chunk_numel = x.numel() / chunks;
  const int64_t total = x.numel() == 0 ? 0 : chunks * ((chunk_numel + 7) / 8);
  auto out = torch::empty({total}, x.options().dtype(at::kByte));
  if (total == 0) return out;
  check_launch(qaccel_cuda::sign_pack(x.data_ptr(), dtype, chunks, chunk_numel, out.data_ptr<uint8_t>(),
                                      as_stream(stream)),
               "sign_pack");
  return out;
}

torch::Tensor sign_unpack(torch::Tensor signs, torch::Tensor scales, int64_t numel, torch::Tensor out,
                          int64_t stream) {
  check_cuda(signs, "signs");
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out.dtype=", out.scalar_type(), ": must be float32");
  TORCH_CHECK(out.numel() == numel, "out.numel()=", out.numel(), ": must equal numel=", numel);
  if (numel == 0) return out;
  const auto scales32 = scales.to(out.options()).contiguous();
  const int64_t chunks = scales32.numel();
  TORCH_CHECK(chunks >= 1 && numel % chunks == 0, "scales has ", chunks, " chunks: must divide numel=", numel);
  const int64_t chunk_numel = numel / chunks;
  TORCH_CHECK(signs.numel() == chunks * ((chunk_numel + 7) / 8), "signs has ", signs.numel(), " bytes: expected ",
              chunks * ((chunk_numel + 7) / 8));
  check_launch(qaccel_cuda::sign_unpack(signs.data_ptr<uint8_t>(), scales32.data_ptr<float>(), chunks, chunk_numel,
                                        out.data_ptr<float>(), as_stream(stream)),
               "sign_unpack");
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "qaccel CUDA codecs (bit-identical to qaccel.quant.reference)";
  m.def("quantize_buckets", &quantize_buckets, "bucketed k-bit quantization -> [codes, lo, scale]");
  m.def("dequantize_into", &dequantize_into, "decode (or add) packed codes into out");
  m.def("sign_pack", &sign_pack, "sign bits, MSB first, per chunk padded to bytes");
  m.def("sign_unpack", &sign_unpack, "scale_c * (+-1) into out");
}
