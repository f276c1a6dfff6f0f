"""Codecs for compressed communication: bucketed k-bit quantization and 1-bit sign packing.

``reference`` is the pure-torch specification; the C++ (CPU) and CUDA kernels built on first use
reproduce it bit for bit. Nothing compiles at import. The kernels are the ``torch.ops.qaccel.*`` ops,
declared once in ``_ops`` with fake kernels (they run under ``FakeTensorMode`` and
``torch.compile(fullgraph=True)``) and the reference as the default kernel of every device.
"""

from . import reference
from ._api import dequantize, quantize, sign_compress, sign_decompress
from ._onebit_api import onebit_encode, onebit_server
from ._payload import PayloadSpec
from ._payload_api import decode_payloads, encode_payloads, sum_payloads
from ._types import (
    META_DTYPES,
    ROTATIONS,
    ROUNDINGS,
    QuantizedTensor,
    SignCompressed,
    packed_code_bytes,
    quantized_nbytes,
    sign_packed_bytes,
)

__all__ = [
    "quantize",
    "dequantize",
    "sign_compress",
    "sign_decompress",
    "onebit_encode",
    "onebit_server",
    "PayloadSpec",
    "encode_payloads",
    "decode_payloads",
    "sum_payloads",
    "QuantizedTensor",
    "SignCompressed",
    "packed_code_bytes",
    "quantized_nbytes",
    "sign_packed_bytes",
    "META_DTYPES",
    "ROUNDINGS",
    "ROTATIONS",
    "reference",
]
