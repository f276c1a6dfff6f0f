"""The multi-process harness itself: real gloo collectives, honest failure reporting, and a rank pool whose jobs
share processes but neither state nor failures."""

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
        run_ranks(_crash_on_exit_on_rank_one, 2, tmp_path, timeout_s=60, fresh=True)


# -- the rank pool (tests/_rank_pool.py): jobs share processes, never state or failures --------------------------


def _process_state(rank, world_size, leave_behind):
    """This job's view of what an earlier job could have left; then, if asked, leave things behind for the next."""
    import os

    import torch.distributed.distributed_c10d as c10d

    from qaccel.comm import default_meter

    seen = {"pid": os.getpid(), "env": os.environ.get("QACCEL_TEST_LEFT_BEHIND"), "cwd": os.getcwd(),
            "groups": c10d.get_pg_count(), "seed": torch.initial_seed(), "grad": torch.is_grad_enabled(),
            "metered": sum(t.sent_bytes for t in default_meter.totals().values())}  # fmt: skip
    if leave_behind:
        default_meter.record("test.left_behind", sent_bytes=7, recv_bytes=7)
        os.environ["QACCEL_TEST_LEFT_BEHIND"] = "1"
        os.chdir("/")
        dist.new_group([0, 1])
        torch.manual_seed(1)
        torch.set_grad_enabled(False)
    return seen


def _exit_on_rank_zero(rank, world_size):
    if rank == 0:
        import os

        os._exit(3)  # no result, no goodbye: the pool must notice and end
    dist.barrier()  # rank 1 waits on the dead rank until gloo reports it gone
    return rank


def test_jobs_share_processes_but_not_their_state(tmp_path):
    first = run_ranks(_process_state, 2, tmp_path, True)
    second = run_ranks(_process_state, 2, tmp_path, False)
    for before, after in zip(first, second, strict=True):
        assert after["pid"] == before["pid"], "the second job ran in new processes: no pool"
        assert after["env"] is None and after["cwd"] == before["cwd"] and after["grad"] and after["metered"] == 0
        assert after["groups"] == before["groups"] == 1, "a subgroup of the first job outlived it"
        assert after["seed"] != 1, "torch's seed of the first job leaked"
    assert first[0]["seed"] != second[0]["seed"], "every job gets freshly seeded RNGs, as a new process would"


def test_a_failed_job_fails_alone_and_the_pool_keeps_serving(tmp_path):
    pids = [out["pid"] for out in run_ranks(_process_state, 2, tmp_path, False)]
    with pytest.raises(AssertionError, match=r"rank 1/2:(.|\n)*boom on purpose"):
        run_ranks(_fail_on_rank_one, 2, tmp_path, timeout_s=60)
    assert [out["pid"] for out in run_ranks(_process_state, 2, tmp_path, False)] == pids


def test_a_rank_that_dies_fails_its_job_and_the_next_job_gets_new_ranks(tmp_path):
    pids = [out["pid"] for out in run_ranks(_process_state, 2, tmp_path, False)]
    with pytest.raises(AssertionError, match=r"ranks \[0[^\]]*\] of 2 gave no result(.|\n)*exit codes \{0: 3"):
        run_ranks(_exit_on_rank_zero, 2, tmp_path, timeout_s=60, pg_timeout_s=20)
    after = [out["pid"] for out in run_ranks(_process_state, 2, tmp_path, False)]
    assert not set(after) & set(pids)
