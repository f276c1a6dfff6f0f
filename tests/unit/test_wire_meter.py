"""WireMeter bookkeeping: totals, per-step tallies and JSON snapshot."""

import pytest

from qaccel.comm import WireMeter


def test_totals_steps_and_snapshot():
    meter = WireMeter()
    meter.record("a", sent_bytes=10, recv_bytes=12)
    meter.record("a", sent_bytes=5, recv_bytes=0)
    meter.record("b", sent_bytes=1, recv_bytes=1, calls=3)
    step = meter.end_step()
    assert (step["a"].calls, step["a"].sent_bytes, step["a"].recv_bytes) == (2, 15, 12)
    assert step["b"].calls == 3
    meter.record("a", sent_bytes=7, recv_bytes=7)
    assert meter.current_step()["a"].sent_bytes == 7
    snap = meter.snapshot()
    assert snap["steps"] == 1
    assert snap["total"]["a"] == {"calls": 3, "sent_bytes": 22, "recv_bytes": 19}
    assert snap["last_step"]["a"]["sent_bytes"] == 15
    assert snap["total_sent_bytes"] == 23
    meter.reset()
    assert meter.snapshot()["total"] == {}


def test_negative_bytes_rejected():
    with pytest.raises(ValueError, match="negative byte count"):
        WireMeter().record("x", sent_bytes=-1, recv_bytes=0)


def test_ring_formulas():
    from qaccel.comm import ring_all_gather_bytes, ring_all_reduce_bytes

    # A ring all-reduce is a reduce-scatter plus an all-gather: 2 (N-1)/N of the buffer each way.
    assert ring_all_reduce_bytes(4000, 2) == 4000
    assert ring_all_reduce_bytes(4000, 4) == 6000
    assert ring_all_gather_bytes(1000, 4) == 3000
    assert ring_all_reduce_bytes(4000, 1) == 0
