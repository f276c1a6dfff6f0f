"""``BufferPool``: a buffer is handed out again only when nothing (no tensor, no view) refers to it."""

import torch

from qaccel.comm import BufferPool


def test_reuses_a_released_buffer_and_not_a_held_one():
    pool = BufferPool()
    first = pool.get(64, torch.float32, "cpu")
    held = pool.get(64, torch.float32, "cpu")
    assert first.data_ptr() != held.data_ptr()
    address = first.data_ptr()
    del first
    again = pool.get(64, torch.float32, "cpu")
    assert again.data_ptr() == address and pool.hits == 1


def test_a_live_view_keeps_the_buffer_out_of_the_pool():
    pool = BufferPool()
    buffer = pool.get(64, torch.float32, "cpu")
    address = buffer.data_ptr()
    view = buffer[8:16].view(torch.uint8)
    del buffer
    assert pool.get(64, torch.float32, "cpu").data_ptr() != address
    del view
    assert pool.get(64, torch.float32, "cpu").data_ptr() == address


def test_keys_are_size_dtype_and_device_and_the_pool_is_bounded():
    pool = BufferPool(max_per_key=2)
    a = pool.get(64, torch.float32, "cpu")
    assert pool.get(64, torch.bfloat16, "cpu").dtype == torch.bfloat16
    assert pool.get(32, torch.float32, "cpu").numel() == 32
    held = [pool.get(64, torch.float32, "cpu") for _ in range(3)]  # a is held too: 4 live, 2 kept
    assert len({t.data_ptr() for t in (a, *held)}) == 4
    assert pool.nbytes() == 2 * 64 * 4 + 64 * 2 + 32 * 4
