"""The entry's baseline options (``qaccel.training.comm_options``) and the ``step_kind`` of ``metrics.jsonl``: one process.

Each option is either honoured (it reaches Accelerate's DDP kwargs, or the run's plan) or refused before any
process group exists with one line naming the flag, the value and what is allowed. The 2-rank checks (the
hooks' numerics and bytes, the all-to-all reduce-scatter) are in ``test_train_baselines_ranks.py``.
"""

from __future__ import annotations

import pytest
import torch

from qaccel import train as entry
from qaccel._errors import UsageError
from qaccel.optim import ZeroOneAdamSchedule
from qaccel.training import plan_method
from qaccel.training.comm_options import CommOptions, check_comm_options_for_model, comm_options_from_flags
from qaccel.training.run_log import RunProgress, StepMeter

BASE = dict(recipe_qsdp={}, flag_qsdp={}, recipe_onebit={}, flag_onebit={}, learning_rate=1e-3, weight_decay=0.0, launch_parallelism=None)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith(("QACCEL_", "ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(name)


# -- values: refused with the flag, the value and what is allowed -----------------------------------------
@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"ddp_comm_hook": "fp16"}, r"--ddp_comm_hook 'fp16': choose one of none, powersgd, bf16"),
        ({"fsdp_reduce_scatter": "ring"}, r"--fsdp_reduce_scatter 'ring': choose one of fsdp, alltoall"),
        ({"ddp_bucket_cap_mb": 0}, r"--ddp_bucket_cap_mb 0: must be a number of MB > 0"),
        ({"ddp_bucket_cap_mb": "4"}, r"--ddp_bucket_cap_mb '4': must be a number of MB > 0"),
        ({"powersgd_rank": 0}, r"--powersgd_rank 0: must be an int >= 1"),
        ({"powersgd_start_iter": 1}, r"--powersgd_start_iter 1: must be an int >= 2"),
    ],
)
def test_bad_values_are_refused_naming_the_flag(values, message):
    with pytest.raises(ValueError, match=message):
        CommOptions(**values)


def test_a_powersgd_setting_without_the_powersgd_hook_is_refused_not_ignored():
    with pytest.raises(ValueError, match=r"--powersgd_rank 4: a PowerSGD setting; it needs --ddp_comm_hook powersgd \(got none\)"):
        comm_options_from_flags({"powersgd_rank": 4})
    with pytest.raises(ValueError, match=r"--powersgd_start_iter 5: .* \(got bf16\)"):
        comm_options_from_flags({"powersgd_start_iter": 5, "ddp_comm_hook": "bf16"})
    # flags not given (None) leave torch's defaults: rank 1, 1000 iterations of plain all-reduce first
    options = comm_options_from_flags({"ddp_comm_hook": "powersgd", "ddp_bucket_cap_mb": 64.0, "powersgd_rank": None})
    assert (options.powersgd_rank, options.powersgd_start_iter, options.ddp_bucket_cap_mb) == (1, 1000, 64.0)
    assert comm_options_from_flags({}).is_default() and not options.is_default()


# -- against the run's plan -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "recipe_method", "options", "message"),
    [
        ("qsdp", "qsdp", {"ddp_comm_hook": "bf16"}, r"--ddp_comm_hook bf16: replaces the all-reduce of a stock DDP run .* --method qsdp on fsdp2"),
        ("zero_one_adam", "zero_one_adam", {"ddp_comm_hook": "bf16"}, r"--ddp_comm_hook bf16: .* --method zero_one_adam on ddp"),
        ("none", "qsdp", {"ddp_bucket_cap_mb": 4.0}, r"--ddp_bucket_cap_mb 4.0: sizes DDP's gradient buckets; this run is --method none on fsdp2"),
        ("none", "zero_one_adam", {"fsdp_reduce_scatter": "alltoall"}, r"--fsdp_reduce_scatter alltoall: .* this run is --method none on ddp"),
        ("qsdp", "qsdp", {"fsdp_reduce_scatter": "alltoall"}, r"--fsdp_reduce_scatter alltoall: .* --method qsdp on fsdp2 \(grad_bits 8\)"),
    ],
)
def test_an_option_the_run_cannot_honour_is_refused(method, recipe_method, options, message):
    with pytest.raises(ValueError, match=message):
        plan_method(method, recipe_method=recipe_method, comm=CommOptions(**options), **BASE)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the one-bucket rule is gloo's (CPU)")
def test_powersgd_on_cpu_needs_an_explicit_bucket_cap():
    with pytest.raises(ValueError, match=r"--ddp_comm_hook powersgd on CPU \(gloo\): needs one DDP bucket .*\(docs/powersgd_gloo.md\); give --ddp_bucket_cap_mb"):
        plan_method("none", recipe_method="zero_one_adam", comm=CommOptions(ddp_comm_hook="powersgd"), **BASE)


def test_options_the_run_honours_are_in_its_plan():
    ddp = plan_method("none", recipe_method="zero_one_adam", comm=CommOptions(ddp_comm_hook="powersgd", ddp_bucket_cap_mb=8.0), **BASE)
    assert ddp.parallelism == "ddp" and ddp.comm == CommOptions(ddp_comm_hook="powersgd", ddp_bucket_cap_mb=8.0)
    # 1-bit optimizers keep their own hook; the bucket size (4 MB buckets: more, shorter 1-bit all-reduces) applies
    onebit = plan_method("onebit_adam", recipe_method="zero_one_adam", comm=CommOptions(ddp_bucket_cap_mb=4.0), **BASE)
    assert onebit.comm.ddp_bucket_cap_mb == 4.0
    # the fair fp32 baseline: stock FSDP2, or QSDP with exact gradients
    stock = plan_method("none", recipe_method="qsdp", comm=CommOptions(fsdp_reduce_scatter="alltoall"), **BASE)
    assert stock.parallelism == "fsdp2" and stock.comm.fsdp_reduce_scatter == "alltoall"
    exact = plan_method("qsdp", recipe_method="qsdp", flag_qsdp={"grad_bits": None}, comm=CommOptions(fsdp_reduce_scatter="alltoall"),
                        **{k: v for k, v in BASE.items() if k != "flag_qsdp"})  # fmt: skip
    assert exact.qsdp.grad_bits is None and exact.qsdp.weight_bits == 8
    # without options: the defaults, which change nothing (the method config a checkpoint records is unchanged)
    plain = plan_method("none", recipe_method="zero_one_adam", **BASE)
    assert plain.comm.is_default() and plain.config_dict() == {"parallelism": "ddp"}


# -- through the entry's own flags ---------------------------------------------------------------------------
def _inputs(*flags: str):
    args = entry.parse_args(["--recipe", "bert-tiny", "--output_dir", "unused", *flags])
    return entry.check_inputs(args, launch_parallelism=None, world_size=2)


def test_the_entry_flags_reach_the_plan():
    inputs = _inputs("--method", "none", "--ddp_comm_hook", "powersgd", "--ddp_bucket_cap_mb", "16", "--powersgd_rank", "2", "--powersgd_start_iter", "3")
    assert inputs.plan.comm == CommOptions(ddp_comm_hook="powersgd", ddp_bucket_cap_mb=16.0, powersgd_rank=2, powersgd_start_iter=3)
    assert _inputs().plan.comm.is_default()


def test_an_unknown_hook_is_a_usage_error_listing_the_choices():
    with pytest.raises(UsageError, match=r"--ddp_comm_hook: invalid choice: 'fp8' \(choose from 'none', 'powersgd', 'bf16'\)"):
        entry.parse_args(["--recipe", "bert-tiny", "--output_dir", "unused", "--ddp_comm_hook", "fp8"])


def test_the_entry_refuses_a_hook_on_the_recipes_1bit_method_before_any_process_group():
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"--ddp_comm_hook bf16: .* --method zero_one_adam on ddp"):
        _inputs("--ddp_comm_hook", "bf16")
    assert not dist.is_initialized()


def test_the_bucket_cap_reaches_accelerates_ddp_kwargs(tmp_path):
    from qaccel.training import build_accelerator

    plan = plan_method("none", recipe_method="zero_one_adam", comm=CommOptions(ddp_bucket_cap_mb=3.5), **BASE)
    accelerator = build_accelerator(plan, layer_cls=None, mixed_precision="no", gradient_accumulation_steps=1, report_to=None, project_dir=str(tmp_path))
    # what Accelerate's prepare hands to DistributedDataParallel(...)
    assert accelerator.ddp_handler.to_kwargs() == {"bucket_cap_mb": 3.5}
    assert accelerator.ddp_handler.comm_hook.value == "no"  # the hooks are registered by qaccel, metered


def test_powersgd_bucket_cap_smaller_than_the_model_is_refused_before_prepare():
    model = torch.nn.Linear(512, 1024)  # (512 * 1024 + 1024) fp32 = 2.004 MB of gradients
    with pytest.raises(ValueError, match=r"--ddp_bucket_cap_mb 2: PowerSGD on CPU \(gloo\) needs one DDP bucket .* \(2.00 MB; .* give --ddp_bucket_cap_mb 3 or more"):
        check_comm_options_for_model(CommOptions(ddp_comm_hook="powersgd", ddp_bucket_cap_mb=2.0), model)
    check_comm_options_for_model(CommOptions(ddp_comm_hook="powersgd", ddp_bucket_cap_mb=3.0), model)
    model.weight.requires_grad_(False)  # frozen weights have no gradient bucket
    check_comm_options_for_model(CommOptions(ddp_comm_hook="powersgd", ddp_bucket_cap_mb=1.0), model)


# -- metrics.jsonl: step_kind ----------------------------------------------------------------------------
class _Optimizer:
    def __init__(self, schedule: ZeroOneAdamSchedule) -> None:
        self.schedule = schedule


class _Accelerator:
    """What StepMeter reads: reduce, the wire meter and the prepared 1-bit optimizers."""

    def __init__(self, optimizers: list) -> None:
        from qaccel.comm import WireMeter

        self.wire_meter = WireMeter()
        self.onebit_wiring = type("Wiring", (), {"optimizers": lambda _self: optimizers})()

    def reduce(self, tensor: torch.Tensor, reduction: str) -> torch.Tensor:
        return tensor


def _advance(schedule: ZeroOneAdamSchedule) -> None:
    schedule.advance(schedule.next_kind())


def test_step_kind_is_the_1bit_schedules_kind_of_each_step():
    settings = dict(var_freeze_step=6, var_update_scaler=2, local_step_scaler=2, local_step_clipper=2)
    schedule = ZeroOneAdamSchedule(**settings)
    expected = []  # an independent schedule of the same settings, stepped alone
    reference = ZeroOneAdamSchedule(**settings)
    for _ in range(12):
        expected.append(reference.next_kind().value)
        _advance(reference)
    meter, run, kinds = StepMeter(_Accelerator([_Optimizer(schedule)])), RunProgress(), []
    for _ in range(12):
        meter.add(torch.tensor(1.0))
        _advance(schedule)  # the optimizer's step
        run.step += 1
        kinds.append(meter.end_step(run, learning_rate=0.1)["step_kind"])
        meter.restart()
    assert kinds == expected
    assert {"init", "full", "onebit_gradient", "local", "sync"} <= set(kinds)


def test_rows_without_a_1bit_optimizer_keep_their_keys():
    meter = StepMeter(_Accelerator([]))
    meter.add(torch.tensor(2.0))
    row = meter.end_step(RunProgress(step=1), learning_rate=0.1)
    assert set(row) == {"step", "loss", "learning_rate", "wire_bytes", "wire_bytes_inter_node", "wire_bytes_total", "step_seconds"}
