"""``QSDPConfig``'s three paths (``weight_path``, ``grad_path``, ``replica_path``) and the codecs built from them.

Reference: the per-bit defaults as ``docs/qsdp.md`` states them (1024-element buckets with fp32
metadata at 8 bits; 128 with bf16 below), written out here, and the flat fields themselves.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from qaccel.comm import WireCodec
from qaccel.fsdp import QSDPConfig
from qaccel.fsdp.config import PathSettings

CONFIG = QSDPConfig(
    weight_bits=6, grad_bits=3, replica_grad_bits=5, weight_bucket_size=256, grad_meta_dtype="float32",
    rounding="nearest", grad_rotation="hadamard",
)  # fmt: skip


def test_each_path_gathers_its_flat_fields_and_the_shared_rounding():
    assert CONFIG.weight_path == PathSettings(bits=6, bucket_size=256, meta_dtype=None, rotation="none", rounding="nearest")
    assert CONFIG.grad_path == PathSettings(bits=3, bucket_size=None, meta_dtype="float32", rotation="hadamard", rounding="nearest")
    # the replica all-reduce has bits only: per-bit buckets, no rotation
    assert CONFIG.replica_path == PathSettings(bits=5, bucket_size=None, meta_dtype=None, rotation="none", rounding="nearest")


def test_the_codecs_fill_in_the_per_bit_defaults():
    assert CONFIG.weight_codec() == WireCodec(bits=6, bucket_size=256, meta_dtype=torch.bfloat16, rounding="nearest", rotation="none")
    assert CONFIG.grad_codec() == WireCodec(bits=3, bucket_size=128, meta_dtype=torch.float32, rounding="nearest", rotation="hadamard")
    assert CONFIG.replica_grad_codec() == WireCodec(bits=5, bucket_size=128, meta_dtype=torch.bfloat16, rounding="nearest", rotation="none")
    eight = QSDPConfig(replica_grad_bits=8)
    for codec in (eight.weight_codec(), eight.grad_codec(), eight.replica_grad_codec()):
        assert (codec.bits, codec.bucket_size, codec.meta_dtype, codec.rounding) == (8, 1024, torch.float32, "stochastic")


@pytest.mark.parametrize("path", ["weight_path", "grad_path", "replica_path"])
def test_a_path_that_is_off_has_no_codec(path):
    off = QSDPConfig(weight_bits="off", grad_bits=None, replica_grad_bits=False)
    assert getattr(off, path).bits is None and getattr(off, path).codec() is None


def test_a_path_is_frozen_and_follows_replace_on_the_config():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CONFIG.weight_path.bits = 4
    assert dataclasses.replace(CONFIG, weight_bits=2).weight_path.bits == 2
