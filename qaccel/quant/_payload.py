"""Byte layout of a QSDP payload (one rank-chunk) and the int64 table the fused kernels read.

A payload packs every segment of one chunk into one uint8 blob (``docs/qsdp.md``, "Wire format")::

    [ codes of every quantized segment | pad to 4 B | lo of every bucket | scale of every bucket |
      raw segments in the element dtype | pad to 4 B ]

:class:`PayloadSpec` computes that layout once per unit so that the fused calls
(:func:`qaccel.quant.encode_payloads` and friends) can encode or decode all segments of all slots in
one native call, without per-segment Python or tensor allocations. The layout is the same as
``qaccel.comm.PayloadLayout`` computes; this module lives in the codec layer and knows nothing about
process groups.

Table (``int64``, CPU; ``docs/qsdp.md``, "Fused payload kernels"): ``HEADER_LEN`` header entries
(indices ``H_*``) then one row of ``ROW_LEN`` entries per segment (indices ``C_*``). The C++ and CUDA
kernels read the same constants from ``qaccel/csrc/quant_payload.h``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import cached_property

import torch

from ._types import META_DTYPES, ROTATION_MAX_BLOCK, ROTATIONS, ROUNDINGS, packed_code_bytes

__all__ = ["PayloadSpec", "HEADER_LEN", "ROW_LEN", "RAW_CELL_NUMEL", "DTYPE_CODES"]

# Header entries (must match quant_payload.h).
(H_NSEG, H_NUMEL, H_NBYTES, H_CODE_BYTES, H_META_OFFSET, H_NUM_BUCKETS, H_RAW_OFFSET, H_RAW_BYTES, H_BITS,
 H_BUCKET, H_META_BF16, H_NEAREST, H_ELEM_DTYPE, H_ELEM_ITEMSIZE, H_CELL_NUMEL, H_RAW_CELL_NUMEL,
 H_CELLS_PER_SLOT, H_GROUPS_PER_SLOT, H_ROTATION, H_ROTATION_MAX_BLOCK) = range(20)  # fmt: skip
HEADER_LEN = 20
# Row entries, one row per segment (must match quant_payload.h).
(C_ELEM_OFFSET, C_NUMEL, C_QUANTIZED, C_CODE_OFFSET, C_BUCKET_OFFSET, C_RAW_OFFSET, C_CELL_OFFSET,
 C_GROUP_OFFSET) = range(8)  # fmt: skip
ROW_LEN = 8
# Elements of a raw segment copied by one CUDA warp.
RAW_CELL_NUMEL = 1024
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ITEMSIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def _align4(n: int) -> int:
    return (n + 3) // 4 * 4


@dataclass(frozen=True)
class PayloadSpec:
    """Layout of one payload: segments, codec settings and the byte offset of every part.

    Args:
        segments: ``(numel, quantized)`` per segment, in chunk order; they tile the chunk. Buckets
            restart at every segment; raw (unquantized) segments travel in ``elem_dtype``.
        bits: code width in [2, 8].
        bucket_size: elements per bucket (>= 1).
        meta_dtype: ``torch.float32`` or ``torch.bfloat16``.
        rounding: ``"stochastic"`` or ``"nearest"``.
        elem_dtype: dtype of the chunk (float32, bfloat16 or float16); raw segments keep it.
        rotation: ``"none"`` or ``"hadamard"``: quantized segments are rotated bucket by bucket
            before encoding and rotated back after decoding (``qaccel.quant.reference``, steps
            7-10); decoding then needs the encode's seeds. Bytes do not change.

    Every attribute below is a property computed once: ``numel`` (elements of a chunk),
    ``code_bytes``, ``meta_offset``, ``num_buckets``, ``raw_offset``, ``raw_bytes``, ``nbytes``, and
    per segment ``elem_offsets``, ``code_offsets`` (bytes), ``bucket_offsets`` (bucket index),
    ``raw_offsets`` (bytes from the start of the blob).
    """

    segments: tuple[tuple[int, bool], ...]
    bits: int
    bucket_size: int
    meta_dtype: torch.dtype = torch.float32
    rounding: str = "stochastic"
    elem_dtype: torch.dtype = torch.float32
    rotation: str = "none"

    def __post_init__(self) -> None:
        if self.rotation not in ROTATIONS:
            raise ValueError(f"PayloadSpec: rotation={self.rotation!r}: must be one of {', '.join(ROTATIONS)}")
        if self.meta_dtype not in META_DTYPES.values():
            raise ValueError(f"PayloadSpec: meta_dtype={self.meta_dtype!r}: must be torch.float32 or torch.bfloat16")
        if isinstance(self.bits, bool) or not isinstance(self.bits, int) or not 2 <= self.bits <= 8:
            raise ValueError(f"PayloadSpec: bits={self.bits!r}: must be an int in [2, 8]")
        if isinstance(self.bucket_size, bool) or not isinstance(self.bucket_size, int) or self.bucket_size < 1:
            raise ValueError(f"PayloadSpec: bucket_size={self.bucket_size!r}: must be an int >= 1")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"PayloadSpec: rounding={self.rounding!r}: must be one of {', '.join(ROUNDINGS)}")
        if self.elem_dtype not in DTYPE_CODES:
            raise ValueError(f"PayloadSpec: elem_dtype={self.elem_dtype}: must be one of float32, bfloat16, float16")
        if not isinstance(self.segments, tuple):
            raise ValueError(f"PayloadSpec: segments must be a tuple of (numel, quantized) pairs, got {type(self.segments).__name__}")
        for index, segment in enumerate(self.segments):
            ok = isinstance(segment, tuple) and len(segment) == 2
            numel, quantized = segment if ok else (None, None)
            if not ok or isinstance(numel, bool) or not isinstance(numel, int) or numel < 0 or not isinstance(quantized, bool):
                raise ValueError(f"PayloadSpec: segments[{index}]={segment!r}: must be (numel: int >= 0, quantized: bool)")

    # -- layout -----------------------------------------------------------------------------------

    @cached_property
    def _offsets(self) -> dict:
        elem = codes = buckets = raw = 0
        offsets: dict = {"elem": [], "code": [], "bucket": [], "raw": []}
        for numel, quantized in self.segments:
            offsets["elem"].append(elem)
            offsets["code"].append(codes)
            offsets["bucket"].append(buckets)
            offsets["raw"].append(raw)
            elem += numel
            if quantized:
                codes += packed_code_bytes(numel, self.bits)
                buckets += math.ceil(numel / self.bucket_size)
            else:
                raw += numel * self.elem_itemsize
        offsets.update(numel=elem, code_bytes=codes, num_buckets=buckets, raw_bytes=raw)
        return offsets

    @property
    def elem_itemsize(self) -> int:
        return _ITEMSIZE[self.elem_dtype]

    @property
    def meta_itemsize(self) -> int:
        return 4 if self.meta_dtype == torch.float32 else 2

    @property
    def numel(self) -> int:
        """Elements of one chunk (sum of the segment lengths)."""
        return self._offsets["numel"]

    @property
    def code_bytes(self) -> int:
        return self._offsets["code_bytes"]

    @property
    def num_buckets(self) -> int:
        return self._offsets["num_buckets"]

    @property
    def raw_bytes(self) -> int:
        return self._offsets["raw_bytes"]

    @property
    def meta_offset(self) -> int:
        """Byte offset of the ``lo`` array (``scale`` follows it)."""
        return _align4(self.code_bytes)

    @property
    def raw_offset(self) -> int:
        return self.meta_offset + 2 * self.meta_itemsize * self.num_buckets

    @property
    def nbytes(self) -> int:
        """Bytes of one payload: ``align4(codes) + 2*meta*buckets + align4(raw)``; a multiple of 4."""
        return self.raw_offset + _align4(self.raw_bytes)

    @property
    def elem_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets["elem"])

    @property
    def code_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets["code"])

    @property
    def bucket_offsets(self) -> tuple[int, ...]:
        return tuple(self._offsets["bucket"])

    @property
    def raw_offsets(self) -> tuple[int, ...]:
        """Byte offset of each raw segment from the start of the blob (``raw_offset`` + preceding raw bytes)."""
        return tuple(self.raw_offset + r for r in self._offsets["raw"])

    @property
    def rotated(self) -> bool:
        """True when quantized segments are Hadamard-rotated (decoding needs the encode's seeds)."""
        return self.rotation == "hadamard"

    @property
    def nearest(self) -> bool:
        return self.rounding == "nearest"

    @property
    def cell_numel(self) -> int:
        """Elements one CUDA warp encodes: ``lcm(bucket_size, 8)``, whole buckets and whole code groups."""
        return math.lcm(self.bucket_size, 8)

    # -- table ------------------------------------------------------------------------------------

    @classmethod
    def from_table(cls, table: torch.Tensor) -> PayloadSpec:
        """The spec whose :meth:`table` is ``table``: how the codec ops' reference kernel reads a layout back.

        Raises:
            ValueError: ``table`` is not a PayloadSpec table (wrong length for its segment count).
        """
        return _spec_of_table(tuple(table.detach().to("cpu", torch.int64).reshape(-1).tolist()))

    @cached_property
    def _host_table(self) -> torch.Tensor:
        rows = []
        cells = groups = 0
        offsets = self._offsets
        for index, (numel, quantized) in enumerate(self.segments):
            rows.append([
                offsets["elem"][index], numel, int(quantized), offsets["code"][index], offsets["bucket"][index],
                self.raw_offset + offsets["raw"][index], cells, groups,
            ])  # fmt: skip
            cells += math.ceil(numel / (self.cell_numel if quantized else RAW_CELL_NUMEL))
            groups += math.ceil(numel / 8)
        header = [0] * HEADER_LEN
        header[H_NSEG] = len(self.segments)
        header[H_NUMEL] = self.numel
        header[H_NBYTES] = self.nbytes
        header[H_CODE_BYTES] = self.code_bytes
        header[H_META_OFFSET] = self.meta_offset
        header[H_NUM_BUCKETS] = self.num_buckets
        header[H_RAW_OFFSET] = self.raw_offset
        header[H_RAW_BYTES] = self.raw_bytes
        header[H_BITS] = self.bits
        header[H_BUCKET] = self.bucket_size
        header[H_META_BF16] = int(self.meta_dtype == torch.bfloat16)
        header[H_NEAREST] = int(self.nearest)
        header[H_ELEM_DTYPE] = DTYPE_CODES[self.elem_dtype]
        header[H_ELEM_ITEMSIZE] = self.elem_itemsize
        header[H_CELL_NUMEL] = self.cell_numel
        header[H_RAW_CELL_NUMEL] = RAW_CELL_NUMEL
        header[H_CELLS_PER_SLOT] = cells
        header[H_GROUPS_PER_SLOT] = groups
        header[H_ROTATION] = int(self.rotated)
        header[H_ROTATION_MAX_BLOCK] = ROTATION_MAX_BLOCK
        flat = header + [value for row in rows for value in row]
        return torch.tensor(flat, dtype=torch.int64)

    @cached_property
    def _device_tables(self) -> dict:
        return {}

    def table(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The layout table on ``device``: built once; a CUDA copy is made on first use and kept.

        Layout: header ``[nseg, numel, nbytes, code_bytes, meta_offset, num_buckets, raw_offset,
        raw_bytes, bits, bucket_size, meta_bf16, nearest, elem_dtype (0 fp32, 1 bf16, 2 fp16),
        elem_itemsize, cell_numel, raw_cell_numel, cells_per_slot, groups_per_slot, rotation (0 none,
        1 hadamard), rotation_max_block]``, then per
        segment ``[elem_offset, numel, quantized, code_offset, bucket_offset, raw_offset,
        cell_offset, group_offset]`` (byte offsets from the start of a payload; cells and groups are
        the CUDA kernels' work units).
        """
        device = torch.device(device)
        if device.type == "cpu":
            return self._host_table
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        table = self._device_tables.get(device)
        if table is None:  # two threads racing here copy twice; one copy is kept
            table = self._device_tables.setdefault(device, self._host_table.to(device))
        return table


@functools.lru_cache(maxsize=256)
def _spec_of_table(values: tuple[int, ...]) -> PayloadSpec:
    header, rows = values[:HEADER_LEN], values[HEADER_LEN:]
    if len(header) < HEADER_LEN or len(rows) != header[H_NSEG] * ROW_LEN:
        raise ValueError(f"PayloadSpec.from_table: {len(values)} entries do not form a header of {HEADER_LEN} "
                         f"and {ROW_LEN} per segment")  # fmt: skip
    segments = tuple((rows[start + C_NUMEL], bool(rows[start + C_QUANTIZED])) for start in range(0, len(rows), ROW_LEN))
    elem_dtype = next(dtype for dtype, code in DTYPE_CODES.items() if code == header[H_ELEM_DTYPE])
    return PayloadSpec(
        segments=segments,
        bits=header[H_BITS],
        bucket_size=header[H_BUCKET],
        meta_dtype=torch.bfloat16 if header[H_META_BF16] else torch.float32,
        rounding="nearest" if header[H_NEAREST] else "stochastic",
        elem_dtype=elem_dtype,
        rotation="hadamard" if header[H_ROTATION] else "none",
    )
