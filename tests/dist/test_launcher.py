"""The multi-process fixture itself: real gloo collectives and honest failure reporting."""

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_ranks


def _allreduce_rank(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _crash_on_exit_on_rank_one(rank, world_size):
    if rank == 1:
        import atexit
        import os

        atexit.register(os._exit, 3)  # result delivered, then the process dies on its way out
    return rank


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    return rank


@pytest.mark.parametrize("world_size", [2, 4])
def test_allreduce_over_gloo(tmp_path, world_size):
    expected = world_size * (world_size + 1) / 2
    assert run_ranks(_allreduce_rank, world_size, tmp_path) == [expected] * world_size


def test_failure_names_rank_and_traceback(tmp_path):
    with pytest.raises(AssertionError, match=r"rank 1/2:(.|\n)*boom on purpose"):
        run_ranks(_fail_on_rank_one, 2, tmp_path, timeout_s=60)


def test_crash_after_result_is_reported(tmp_path):
    with pytest.raises(AssertionError, match=r"exited abnormally after returning results: \{1: 3\}"):
        run_ranks(_crash_on_exit_on_rank_one, 2, tmp_path, timeout_s=60)
