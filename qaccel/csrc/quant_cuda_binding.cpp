// Thin torch binding of the CUDA codecs in quant_cuda.cu: checks, allocation, launch, and the CUDA
// kernels of the ops declared in qaccel/quant/_ops.py (registered at the end of this file).
//
// It includes no c10/cuda or ATen/cuda header (a CPU-only torch wheel lacks some of them, so
// tests/unit/test_cuda_compile.py could not compile it): the device guard and the current stream
// come through c10's device-generic interface, which libc10_cuda implements, so kernels run on the
// caller's device and stream like any torch op.
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "quant_checks.h"
#include "quant_cuda.h"
#include "quant_onebit.h"
#include "quant_ops.h"
#include "quant_payload.h"

namespace {

using qaccel_cuda::Dtype;

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, ": expected a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.is_contiguous(), name, ": expected a contiguous tensor");
}

Dtype float_dtype(const at::Tensor& t, const char* name) {
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

// The device of `t` made current for the call, and torch's current stream on it.
struct CudaCall {
  explicit CudaCall(const at::Tensor& t)
      : guard(t.device()),
        stream(static_cast<cudaStream_t>(
            c10::impl::VirtualGuardImpl(c10::DeviceType::CUDA).getStream(t.device()).native_handle())) {}
  c10::DeviceGuard guard;
  cudaStream_t stream;
};

// The seed travels as the int64 bit pattern of the unsigned 64-bit seed (a schema `int` is signed).
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_buckets(const at::Tensor& x, int64_t bits, int64_t bucket_size,
                                                                bool nearest, int64_t seed_bits,
                                                                at::ScalarType meta_dtype) {
  check_cuda(x, "x");
  const CudaCall call(x);
  const bool meta_bf16 = qaccel::is_bf16_meta(meta_dtype);
  const auto seed = static_cast<uint64_t>(seed_bits);
  const Dtype dtype = float_dtype(x, "x");
  qaccel::check_codec_args(bits, bucket_size);
  const int64_t numel = x.numel();
  const int64_t num_buckets = (numel + bucket_size - 1) / bucket_size;
  const auto meta_options = x.options().dtype(meta_bf16 ? at::kBFloat16 : at::kFloat);
  auto lo = at::empty({num_buckets}, meta_options);
  auto scale = at::empty({num_buckets}, meta_options);
  auto codes = at::empty({bits * ((numel + 7) / 8)}, x.options().dtype(at::kByte));
  if (numel == 0) return {codes, lo, scale};
  at::Tensor workspace;
  double* workspace_ptr = nullptr;
  if (qaccel_cuda::quantize_needs_workspace(x.data_ptr(), bucket_size)) {
    workspace = at::empty({2 * num_buckets}, x.options().dtype(at::kDouble));
    workspace_ptr = workspace.data_ptr<double>();
  }
  check_launch(qaccel_cuda::quantize(x.data_ptr(), dtype, numel, static_cast<int>(bits), bucket_size, nearest, seed,
                                     meta_bf16, lo.data_ptr(), scale.data_ptr(), codes.data_ptr<uint8_t>(),
                                     workspace_ptr, call.stream),
               "quantize");
  // `workspace` is released after the launch; the caching allocator keeps it for this stream.
  return {codes, lo, scale};
}

void dequantize_into(const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& scale, int64_t bits,
                     int64_t bucket_size, at::Tensor out, bool accumulate) {
  check_cuda(codes, "codes");
  check_cuda(lo, "lo");
  check_cuda(scale, "scale");
  check_cuda(out, "out");
  const Dtype out_dtype = float_dtype(out, "out");
  const int64_t numel = out.numel();
  qaccel::check_decode_args(codes, lo, scale, bits, bucket_size, numel);
  if (numel == 0) return;
  const CudaCall call(out);
  check_launch(qaccel_cuda::dequantize(codes.data_ptr<uint8_t>(), lo.data_ptr(), scale.data_ptr(),
                                       lo.scalar_type() == at::kBFloat16, static_cast<int>(bits), bucket_size,
                                       out.data_ptr(), out_dtype, numel, accumulate, call.stream),
               "dequantize");
}

at::Tensor sign_pack(const at::Tensor& x, int64_t chunks) {
  check_cuda(x, "x");
  const CudaCall call(x);
  const Dtype dtype = float_dtype(x, "x");
  TORCH_CHECK(chunks >= 1 && x.numel() % chunks == 0, "chunks=", chunks, ": must divide x.numel()=", x.numel());
  const int64_t chunk_numel = x.numel() / chunks;
  const int64_t total = x.numel() == 0 ? 0 : chunks * ((chunk_numel + 7) / 8);
  auto out = at::empty({total}, x.options().dtype(at::kByte));
  if (total == 0) return out;
  check_launch(qaccel_cuda::sign_pack(x.data_ptr(), dtype, chunks, chunk_numel, out.data_ptr<uint8_t>(), call.stream),
               "sign_pack");
  return out;
}

void sign_unpack(const at::Tensor& signs, const at::Tensor& scales, int64_t numel, at::Tensor out) {
  check_cuda(signs, "signs");
  check_cuda(out, "out");
  TORCH_CHECK(out.scalar_type() == at::kFloat, "out.dtype=", out.scalar_type(), ": must be float32");
  TORCH_CHECK(out.numel() == numel, "out.numel()=", out.numel(), ": must equal numel=", numel);
  if (numel == 0) return;
  const CudaCall call(out);
  const auto scales32 = scales.to(out.options()).contiguous();
  const int64_t chunks = scales32.numel();
  TORCH_CHECK(chunks >= 1 && numel % chunks == 0, "scales has ", chunks, " chunks: must divide numel=", numel);
  const int64_t chunk_numel = numel / chunks;
  TORCH_CHECK(signs.numel() == chunks * ((chunk_numel + 7) / 8), "signs has ", signs.numel(), " bytes: expected ",
              chunks * ((chunk_numel + 7) / 8));
  check_launch(qaccel_cuda::sign_unpack(signs.data_ptr<uint8_t>(), scales32.data_ptr<float>(), chunks, chunk_numel,
                                        out.data_ptr<float>(), call.stream),
               "sign_unpack");
}

// ---- fused payloads: the host table gives the launch parameters, the device table the rows -------

namespace pl = qaccel::payload;

Dtype dtype_of_code(int code) { return code == 0 ? Dtype::kFloat32 : (code == 1 ? Dtype::kBFloat16 : Dtype::kFloat16); }

pl::Params payload_params(const at::Tensor& host_table, const at::Tensor& device_table,
                          const at::Tensor& like) {
  TORCH_CHECK(host_table.device().is_cpu() && host_table.is_contiguous() && host_table.scalar_type() == at::kLong &&
                  host_table.numel() >= pl::kHeaderLen,
              "host_table: must be a PayloadSpec table on the CPU");
  const pl::Params p = pl::read_params(host_table.data_ptr<int64_t>());
  TORCH_CHECK(host_table.numel() == pl::kHeaderLen + p.num_segments * pl::kRowLen, "host_table: ", host_table.numel(),
              " entries do not match its ", p.num_segments, " segments");
  check_cuda(device_table, "device_table");
  TORCH_CHECK(device_table.scalar_type() == at::kLong && device_table.numel() == host_table.numel() &&
                  device_table.device() == like.device(),
              "device_table: must be the same table on ", like.device());
  qaccel::check_codec_args(p.bits, p.bucket);
  TORCH_CHECK(!p.rotation || (p.rotation_max_block >= 1 && p.rotation_max_block <= qaccel_cuda::kMaxRotationBlock &&
                              (p.rotation_max_block & (p.rotation_max_block - 1)) == 0),
              "host_table: rotation_max_block=", p.rotation_max_block, ": must be a power of two <= ",
              qaccel_cuda::kMaxRotationBlock);
  return p;
}

// The encode seeds a rotated decode needs (its rotation signs), as a device pointer; null when the
// spec is not rotated (then `maybe_seeds` is ignored). `seeds` receives the table on the device
// (copied there if it was given on the CPU) and must outlive the launch.
const int64_t* rotation_seeds(const std::optional<at::Tensor>& maybe_seeds, const pl::Params& p, int64_t slots,
                              const at::Tensor& like, at::Tensor& seeds) {
  if (!p.rotation) return nullptr;
  TORCH_CHECK(maybe_seeds.has_value(), "seeds: a rotated spec needs the int64 [", slots, ", ", p.num_segments,
              "] table the payloads were encoded with");
  seeds = maybe_seeds->to(like.device()).contiguous();
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 2 && seeds.size(0) == slots &&
                  seeds.size(1) == p.num_segments,
              "seeds: a rotated spec needs the int64 [", slots, ", ", p.num_segments,
              "] table the payloads were encoded with, got ", seeds.scalar_type(), " ", seeds.sizes());
  return seeds.data_ptr<int64_t>();
}

const int64_t* device_rows(const at::Tensor& device_table) {
  return device_table.data_ptr<int64_t>() + pl::kHeaderLen;
}

// One small per-call slot table goes to the device: [slots, 1 + segments] = chunk offset, then the
// segment seeds (`offsets` is on the CPU, `seeds` on the CPU or the device).
void encode_payloads(const at::Tensor& src, const at::Tensor& host_table, const at::Tensor& device_table,
                     const at::Tensor& offsets, const at::Tensor& seeds, at::Tensor out) {
  check_cuda(src, "src");
  check_cuda(out, "out");
  const CudaCall call(src);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1, "src_offsets: expected int64 [slots]");
  TORCH_CHECK(seeds.scalar_type() == at::kLong && seeds.dim() == 2 && seeds.size(0) == offsets.numel(),
              "seeds: expected int64 [", offsets.numel(), ", segments]");
  const at::Tensor slot_info = at::cat({offsets.to(src.device()).view({-1, 1}), seeds.to(src.device())}, 1);
  const Dtype dtype = float_dtype(src, "src");
  const pl::Params p = payload_params(host_table, device_table, src);
  TORCH_CHECK(static_cast<int>(dtype) == p.elem_dtype, "src.dtype=", src.scalar_type(),
              ": must be the spec's element dtype");
  TORCH_CHECK(slot_info.scalar_type() == at::kLong && slot_info.dim() == 2 && slot_info.size(1) == 1 + p.num_segments,
              "slot_info: expected int64 [slots, ", 1 + p.num_segments, "]");
  const int64_t slots = slot_info.size(0);
  TORCH_CHECK(out.scalar_type() == at::kByte && out.numel() == slots * p.nbytes, "out: expected ", slots * p.nbytes,
              " uint8 bytes");
  TORCH_CHECK(src.device() == out.device() && slot_info.device() == out.device(), "src, slot_info, out: one device");
  check_launch(qaccel_cuda::encode_payloads(src.data_ptr(), p, device_rows(device_table),
                                            slot_info.data_ptr<int64_t>(), slots, out.data_ptr<uint8_t>(),
                                            call.stream),
               "encode_payloads");
}

void decode_payloads(const at::Tensor& blob, const at::Tensor& host_table, const at::Tensor& device_table,
                     at::Tensor out, const at::Tensor& out_offsets, const std::optional<at::Tensor>& seeds) {
  check_cuda(blob, "blob");
  check_cuda(out, "out");
  const CudaCall call(out);
  const at::Tensor offsets = out_offsets.to(out.device()).contiguous();
  const Dtype out_dtype = float_dtype(out, "out");
  const pl::Params p = payload_params(host_table, device_table, out);
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1, "offsets: expected int64 [slots]");
  const int64_t slots = offsets.numel();
  TORCH_CHECK(blob.scalar_type() == at::kByte && blob.numel() == slots * p.nbytes, "blob: expected ",
              slots * p.nbytes, " uint8 bytes");
  TORCH_CHECK(blob.device() == out.device() && offsets.device() == out.device(), "blob, offsets, out: one device");
  at::Tensor device_seeds;
  const int64_t* seed_table = rotation_seeds(seeds, p, slots, out, device_seeds);
  check_launch(qaccel_cuda::decode_payloads(blob.data_ptr<uint8_t>(), p, device_rows(device_table),
                                            offsets.data_ptr<int64_t>(), seed_table, slots, out.data_ptr(),
                                            out_dtype, call.stream),
               "decode_payloads");
}

void sum_payloads(const at::Tensor& blob, const at::Tensor& host_table, const at::Tensor& device_table,
                  const at::Tensor& base, at::Tensor out, const std::optional<at::Tensor>& seeds) {
  check_cuda(blob, "blob");
  check_cuda(base, "base");
  check_cuda(out, "out");
  const Dtype base_dtype = float_dtype(base, "base");
  const Dtype out_dtype = float_dtype(out, "out");
  const pl::Params p = payload_params(host_table, device_table, out);
  TORCH_CHECK(base.numel() == p.numel && out.numel() == p.numel, "base/out: expected ", p.numel, " elements");
  TORCH_CHECK(blob.scalar_type() == at::kByte && (p.nbytes == 0 ? blob.numel() == 0 : blob.numel() % p.nbytes == 0),
              "blob: expected a whole number of ", p.nbytes, "-byte payloads");
  TORCH_CHECK(blob.device() == out.device() && base.device() == out.device(), "blob, base, out: one device");
  const int64_t slots = p.nbytes == 0 ? 0 : blob.numel() / p.nbytes;
  const CudaCall call(out);
  at::Tensor device_seeds;
  const int64_t* seed_table = rotation_seeds(seeds, p, slots, out, device_seeds);
  check_launch(qaccel_cuda::sum_payloads(blob.data_ptr<uint8_t>(), p, device_rows(device_table), seed_table, slots,
                                         base.data_ptr(), base_dtype, out.data_ptr(), out_dtype, call.stream),
               "sum_payloads");
}

// ---- fused 1-bit error feedback (reference.onebit_encode / onebit_server; quant_onebit.h) ---------

// The compensated values are in `error`: torch's norm for the scales, then one launch packs the signs
// and leaves the new error in place.
std::tuple<at::Tensor, at::Tensor> onebit_compress_error(at::Tensor& error, int64_t chunks, const CudaCall& call) {
  const int64_t chunk_numel = error.numel() / chunks;
  const auto scales = qaccel::onebit_chunk_rms(error, chunks);
  auto signs = at::empty({chunks * ((chunk_numel + 7) / 8)}, error.options().dtype(at::kByte));
  check_launch(qaccel_cuda::onebit_sign_error(error.data_ptr<float>(), scales.data_ptr<float>(), chunks, chunk_numel,
                                              signs.data_ptr<uint8_t>(), call.stream),
               "onebit_sign_error");
  return {signs, scales};
}

std::tuple<at::Tensor, at::Tensor> onebit_encode(const at::Tensor& x, at::Tensor error, int64_t chunks) {
  check_cuda(x, "x");
  check_cuda(error, "error");
  const Dtype dtype = float_dtype(x, "x");
  qaccel::check_onebit_encode_args(x, error, chunks);
  const CudaCall call(error);
  check_launch(qaccel_cuda::onebit_compensate(x.data_ptr(), dtype, x.numel(), error.data_ptr<float>(), error.numel(),
                                              call.stream),
               "onebit_compensate");
  return onebit_compress_error(error, chunks, call);
}

std::tuple<at::Tensor, at::Tensor> onebit_server(const at::Tensor& signs, const at::Tensor& scales, at::Tensor error,
                                                 int64_t chunks) {
  check_cuda(signs, "signs");
  check_cuda(error, "error");
  const auto averaged_scales = qaccel::onebit_server_scales(signs, scales, error, chunks);
  const CudaCall call(error);
  const int64_t world = scales.numel(), numel = error.numel();
  auto decoded = at::empty({world, numel}, error.options());
  check_launch(qaccel_cuda::sign_unpack(signs.data_ptr<uint8_t>(), averaged_scales.data_ptr<float>(), world, numel,
                                        decoded.data_ptr<float>(), call.stream),
               "sign_unpack");
  qaccel::onebit_add_server_sum(decoded, error);
  return onebit_compress_error(error, chunks, call);
}

}  // namespace

// Kernels for CUDA tensors of the ops declared in qaccel/quant/_ops.py.
TORCH_LIBRARY_IMPL(qaccel, CUDA, m) { QACCEL_IMPL_CODEC_OPS(m); }
