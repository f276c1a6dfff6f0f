// The codec ops each native backend registers: one list for the CPU extension and the CUDA binding.
//
// The schemas are declared once, in Python (qaccel/quant/_ops.py: torch.library.define in the
// "qaccel" namespace, with a fake kernel for FakeTensor/torch.compile and the pure-torch reference
// as the CompositeExplicitAutograd default). A backend only adds its kernels for its dispatch key,
// as torchao does with TORCH_LIBRARY_IMPL(torchao, CPU/CUDA, m):
//
//   TORCH_LIBRARY_IMPL(qaccel, CPU, m) { QACCEL_IMPL_CODEC_OPS(m); }
//
// inside the translation unit defining the nine functions below. The dispatcher checks each
// function's C++ signature against the declared schema when the library loads, so a backend that
// drifts from the schema fails to load instead of miscomputing. Ops that write into a tensor
// (`Tensor(a!)` in the schema) return nothing, as auto-functionalization under torch.compile needs.
#pragma once

#include <torch/library.h>

#define QACCEL_IMPL_CODEC_OPS(m)                     \
  do {                                               \
    (m).impl("quantize_buckets", &quantize_buckets); \
    (m).impl("dequantize_into", &dequantize_into);   \
    (m).impl("sign_pack", &sign_pack);               \
    (m).impl("sign_unpack", &sign_unpack);           \
    (m).impl("encode_payloads", &encode_payloads);   \
    (m).impl("decode_payloads", &decode_payloads);   \
    (m).impl("sum_payloads", &sum_payloads);         \
    (m).impl("onebit_encode", &onebit_encode);       \
    (m).impl("onebit_server", &onebit_server);       \
  } while (false)
