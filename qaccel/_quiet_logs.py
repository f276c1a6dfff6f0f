"""Third-party log lines that tell a qaccel user nothing, filtered at their own logger.

bitsandbytes (0.49 and 0.50 at least) warns at import, on CPUs with AVX512-BF16, that its optional
4-bit CPU matmul kernel from the Hub ("kernels-community") did not load unless the ``kernels`` package
can fetch it. qaccel imports bitsandbytes only indirectly (transformers' ``get_scheduler`` imports peft,
which imports bitsandbytes) and never runs that matmul, yet the line stood before every one-line
refusal of ``qaccel train`` and in every rank's output. Importing qaccel drops that notice alone
(bitsandbytes warns at import, so the filter must be there first); ``qaccel -v`` keeps it, and every
other bitsandbytes message passes.
"""

from __future__ import annotations

import logging

__all__ = ["quiet_unused_kernel_notices", "keep_unused_kernel_notices"]

BNB_CPU_OPS_LOGGER = "bitsandbytes.backends.cpu.ops"


class _HubKernelNotice(logging.Filter):
    """Drops bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "kernels-community" not in record.getMessage()


_FILTER = _HubKernelNotice()


def quiet_unused_kernel_notices() -> None:
    """Attach the filter (idempotent); it must come before bitsandbytes is imported, which warns at import."""
    logging.getLogger(BNB_CPU_OPS_LOGGER).addFilter(_FILTER)  # the same Filter object is added once


def keep_unused_kernel_notices() -> None:
    """Detach it again (``qaccel -v``: every library line is shown)."""
    logging.getLogger(BNB_CPU_OPS_LOGGER).removeFilter(_FILTER)
