"""Collectives built on the codecs, and exact wire-byte accounting."""

from ._accounting import CollectiveTally, WireMeter, default_meter, ring_all_gather_bytes

__all__ = ["CollectiveTally", "WireMeter", "default_meter", "ring_all_gather_bytes"]
