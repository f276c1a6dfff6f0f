"""Importing qaccel drops bitsandbytes' import-time notice about its unused Hub CPU kernel, and nothing else.

The notice (bitsandbytes 0.49/0.50 on AVX512-BF16 CPUs without the ``kernels`` package) stood before every
one-line refusal of ``qaccel train``; ``qaccel -v`` keeps it.
"""

from __future__ import annotations

import logging

import qaccel  # noqa: F401  (importing qaccel attaches the filter)
from qaccel._quiet_logs import BNB_CPU_OPS_LOGGER, keep_unused_kernel_notices, quiet_unused_kernel_notices

NOTICE = "Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure you already `pip install kernels`"


def _logged(caplog) -> list[str]:
    logger = logging.getLogger(BNB_CPU_OPS_LOGGER)  # the logger bitsandbytes' module logs to
    with caplog.at_level(logging.WARNING):
        caplog.clear()
        logger.warning(NOTICE, "No module named 'kernels'")
        logger.warning("a bitsandbytes warning about something else")
    return [record.getMessage() for record in caplog.records]


def test_the_hub_kernel_notice_alone_is_dropped(caplog):
    assert _logged(caplog) == ["a bitsandbytes warning about something else"]


def test_verbose_keeps_it_and_quieting_twice_adds_one_filter(caplog):
    keep_unused_kernel_notices()
    try:
        assert len(_logged(caplog)) == 2
    finally:
        quiet_unused_kernel_notices()
        quiet_unused_kernel_notices()
    assert len(logging.getLogger(BNB_CPU_OPS_LOGGER).filters) == 1
    assert len(_logged(caplog)) == 1
