"""The entry's baseline communication options: DDP's comm hook and bucket size, FSDP2's reduce-scatter.

What a user comparing methods runs next to QSDP and the 1-bit optimizers, on the stock run
(``--method none``): PowerSGD or bf16 compression of DDP's all-reduce, DDP's bucket size, and an
FSDP2 run whose reduce-scatter is a true one (:func:`qaccel.comm.alltoall_reduce_scatter`; gloo's
reduce-scatter all-reduces the whole buffer, pytorch/pytorch#118911). Flags: ``--ddp_comm_hook``,
``--ddp_bucket_cap_mb``, ``--powersgd_rank``, ``--powersgd_start_iter``, ``--fsdp_reduce_scatter``.

The bucket cap goes through Accelerate's ``DistributedDataParallelKwargs(bucket_cap_mb=...)``. The
two hooks are torch's own functions, the ones ``DistributedDataParallelKwargs(comm_hook=POWER_SGD |
BF16)`` maps to, registered here behind a wrapper that records their bytes in the wire meter:
Accelerate's registration keeps no handle on PowerSGD's state (where the compressed sizes are), and
DDP refuses a hook named ``bf16_compress_hook`` without CUDA and NCCL >= 2.10, although gloo
all-reduces bf16 fine.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ..fsdp import QSDPConfig

__all__ = [
    "DDP_COMM_HOOKS",
    "FSDP_REDUCE_SCATTERS",
    "COMM_FLAGS",
    "CommOptions",
    "add_comm_flags",
    "comm_options_from_flags",
    "check_comm_options_for_model",
    "install_comm_options",
]

DDP_COMM_HOOKS = ("none", "powersgd", "bf16")
FSDP_REDUCE_SCATTERS = ("fsdp", "alltoall")
COMM_FLAGS = ("ddp_comm_hook", "ddp_bucket_cap_mb", "powersgd_rank", "powersgd_start_iter", "fsdp_reduce_scatter")
# wire-meter kinds of the hooks and the all-to-all; none starts with "hsdp.", so all count as intra-node
KIND_POWERSGD, KIND_BF16, KIND_ALLTOALL_RS = "ddp.powersgd", "ddp.bf16_all_reduce", "fsdp.alltoall_reduce_scatter"


@dataclass(frozen=True, kw_only=True)
class CommOptions:
    """The baseline options of one run; the defaults change nothing.

    Attributes:
        ddp_comm_hook: ``none`` (DDP's all-reduce, metered), ``powersgd`` (torch's ``powerSGD_hook``) or
            ``bf16`` (torch's ``bf16_compress_hook``). A hook needs ``--method none`` on DDP.
        ddp_bucket_cap_mb: DDP's gradient bucket cap in MB (> 0; None: DDP's default 25). An explicit cap
            also sizes DDP's first bucket. PowerSGD over gloo needs one bucket holding the whole model:
            torch's hook deadlocks there with several (``docs/powersgd_gloo.md``).
        powersgd_rank: PowerSGD's ``matrix_approximation_rank`` (>= 1; torch's default 1).
        powersgd_start_iter: PowerSGD's ``start_powerSGD_iter``: DDP iterations of plain all-reduce first
            (>= 2, torch's rule with error feedback; torch's default 1000).
        fsdp_reduce_scatter: ``fsdp`` (the installed comm's own) or ``alltoall`` (qaccel's exact
            all-to-all reduce-scatter, fp32 sum: a true reduce-scatter's bytes). ``alltoall`` needs an
            FSDP2 run whose gradients are not quantized (``--method none``, or qsdp with ``grad_bits`` none).

    Raises:
        ValueError: a value out of range, naming the flag and what is allowed.
    """

    ddp_comm_hook: str = "none"
    ddp_bucket_cap_mb: float | None = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 1000
    fsdp_reduce_scatter: str = "fsdp"

    def __post_init__(self) -> None:
        if self.ddp_comm_hook not in DDP_COMM_HOOKS:
            raise ValueError(f"--ddp_comm_hook {self.ddp_comm_hook!r}: choose one of {', '.join(DDP_COMM_HOOKS)}")
        if self.fsdp_reduce_scatter not in FSDP_REDUCE_SCATTERS:
            raise ValueError(f"--fsdp_reduce_scatter {self.fsdp_reduce_scatter!r}: choose one of {', '.join(FSDP_REDUCE_SCATTERS)}")
        cap = self.ddp_bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int | float) or not cap > 0):
            raise ValueError(f"--ddp_bucket_cap_mb {cap!r}: must be a number of MB > 0")
        for name, low in (("powersgd_rank", 1), ("powersgd_start_iter", 2)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name} {value!r}: must be an int >= {low}")

    def check_plan(self, method: str, parallelism: str, qsdp: QSDPConfig | None) -> None:
        """Refuse options the planned run cannot honour (ValueError naming the flag, the run and what works)."""
        if self.ddp_comm_hook != "none" and (method != "none" or parallelism != "ddp"):
            raise ValueError(
                f"--ddp_comm_hook {self.ddp_comm_hook}: replaces the all-reduce of a stock DDP run (--method none on DDP); "
                f"this run is --method {method} on {parallelism}"
            )
        if self.ddp_bucket_cap_mb is not None and parallelism != "ddp":
            raise ValueError(f"--ddp_bucket_cap_mb {self.ddp_bucket_cap_mb}: sizes DDP's gradient buckets; this run is --method {method} on {parallelism}")
        if self.ddp_comm_hook == "powersgd" and self.ddp_bucket_cap_mb is None and not torch.cuda.is_available():
            raise ValueError(
                "--ddp_comm_hook powersgd on CPU (gloo): needs one DDP bucket holding the whole model, or torch's hook "
                "deadlocks (docs/powersgd_gloo.md); give --ddp_bucket_cap_mb of at least the model's size in MB"
            )
        if self.fsdp_reduce_scatter == "alltoall" and (parallelism != "fsdp2" or qsdp is None or qsdp.grad_bits is not None):
            bits = None if qsdp is None else qsdp.grad_bits
            raise ValueError(
                f"--fsdp_reduce_scatter alltoall: replaces the exact reduce-scatter of an FSDP2 run (--method none, or qsdp "
                f"with --qsdp_grad_bits none); this run is --method {method} on {parallelism} (grad_bits {bits})"
            )

    def is_default(self) -> bool:
        """True when no option changes the run."""
        return self == CommOptions()


def add_comm_flags(parser: argparse.ArgumentParser) -> None:
    """The options' flags, in their own group; a flag not given stays None (:func:`comm_options_from_flags`)."""
    group = parser.add_argument_group("baseline communication (--method none; qaccel.training.comm_options)")
    group.add_argument("--ddp_comm_hook", choices=DDP_COMM_HOOKS, help="DDP's gradient hook: none (all-reduce), powersgd or bf16 (torch's hooks)")
    group.add_argument("--ddp_bucket_cap_mb", type=float, help="DDP's gradient bucket cap in MB (default: DDP's 25); PowerSGD on CPU needs one that holds the whole model")
    group.add_argument("--powersgd_rank", type=int, help="PowerSGD's matrix_approximation_rank (default 1)")
    group.add_argument("--powersgd_start_iter", type=int, help="PowerSGD's start_powerSGD_iter, >= 2 (default 1000)")
    group.add_argument("--fsdp_reduce_scatter", choices=FSDP_REDUCE_SCATTERS, help="FSDP2's reduce-scatter: fsdp (its own) or alltoall (a true reduce-scatter over gloo)")


def comm_options_from_flags(flags: Mapping[str, Any]) -> CommOptions:
    """The options from the flags given (None: not given).

    Raises:
        ValueError: a bad value, or a PowerSGD setting without ``--ddp_comm_hook powersgd`` (it would be ignored).
    """
    given = {name: flags[name] for name in COMM_FLAGS if flags.get(name) is not None}
    stray = [name for name in ("powersgd_rank", "powersgd_start_iter") if name in given]
    if stray and given.get("ddp_comm_hook") != "powersgd":
        raise ValueError(f"--{stray[0]} {given[stray[0]]}: a PowerSGD setting; it needs --ddp_comm_hook powersgd (got {given.get('ddp_comm_hook', 'none')})")
    return CommOptions(**given)


def check_comm_options_for_model(options: CommOptions, model: torch.nn.Module) -> None:
    """Before ``prepare`` (no collective yet): PowerSGD over gloo needs a bucket cap that holds every gradient.

    Raises:
        ValueError: the cap is smaller than the model's trainable parameters, naming both sizes.
    """
    if options.ddp_comm_hook != "powersgd" or options.ddp_bucket_cap_mb is None or torch.cuda.is_available():
        return
    size_mb = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / 2**20
    if size_mb > options.ddp_bucket_cap_mb:
        raise ValueError(
            f"--ddp_bucket_cap_mb {options.ddp_bucket_cap_mb:g}: PowerSGD on CPU (gloo) needs one DDP bucket holding the "
            f"whole model's gradients ({size_mb:.2f} MB; docs/powersgd_gloo.md); give --ddp_bucket_cap_mb {int(size_mb) + 1} or more"
        )


def install_comm_options(accelerator: Any, model: torch.nn.Module, options: CommOptions, *, stock_ddp: bool = False) -> str | None:
    """After ``prepare``: register the DDP hook or install the all-to-all reduce-scatter; returns what was installed.

    ``stock_ddp`` (a plain DDP run with AdamW, ``MethodPlan.is_stock_ddp``): without ``--ddp_comm_hook`` its
    stock all-reduce is metered (:func:`qaccel.comm.metered_allreduce_hook`, numerics unchanged); the 1-bit
    optimizers register hooks of their own. Nothing with one process: Accelerate wraps no DDP then and
    nothing is communicated.
    """
    from torch.nn.parallel import DistributedDataParallel

    meter = accelerator.wire_meter
    if isinstance(model, DistributedDataParallel):
        if options.ddp_comm_hook == "powersgd":
            model.register_comm_hook(*_metered_powersgd(meter, options))
            return "ddp hook powersgd"
        if options.ddp_comm_hook == "bf16":
            model.register_comm_hook(None, _metered_bf16(meter))
            return "ddp hook bf16"
        if stock_ddp:
            from ..comm import metered_allreduce_hook

            model.register_comm_hook(None, metered_allreduce_hook(meter))
            return "ddp hook metered all-reduce"
    handle = accelerator.qsdp
    if options.fsdp_reduce_scatter == "alltoall" and handle is not None and handle.world_size > 1:
        for unit, installed in zip(handle.units, handle.reduce_scatters, strict=True):
            comm = _alltoall_reduce_scatter(installed, meter)
            for module in unit.modules:
                module.set_custom_reduce_scatter(comm)
        return "fsdp reduce-scatter alltoall"
    return None


def _metered_powersgd(meter: Any, options: CommOptions) -> tuple[Any, Any]:
    """torch's PowerSGD state and hook, the hook wrapped to record the elements it all-reduces."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=options.powersgd_rank, start_powerSGD_iter=options.powersgd_start_iter)

    # Unannotated on purpose: DDP rejects the string annotations `from __future__ import annotations` makes.
    def powersgd_metered(state, bucket):  # noqa: ANN001, ANN202
        buffer = bucket.buffer()
        compressing = state.iter >= state.start_powerSGD_iter  # read first: the hook advances the iteration
        before = state.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(state, bucket)
        # compressed: the hook adds what it all-reduces (P, Q and the uncompressed tensors) to this total
        numel = state.total_numel_after_compression - before if compressing else buffer.numel()
        _record_all_reduce(meter, KIND_POWERSGD, numel * buffer.element_size(), dist.get_world_size())
        return future

    return state, powersgd_metered


def _metered_bf16(meter: Any) -> Any:
    """torch's ``bf16_compress_hook`` under another name (DDP's NCCL-only name check), its bf16 bucket metered."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    def bf16_metered(state, bucket):  # noqa: ANN001, ANN202
        numel = bucket.buffer().numel()
        _record_all_reduce(meter, KIND_BF16, numel * torch.finfo(torch.bfloat16).bits // 8, dist.get_world_size())
        return bf16_compress_hook(state, bucket)

    return bf16_metered


def _record_all_reduce(meter: Any, kind: str, nbytes: int, world_size: int) -> None:
    from ..comm import ring_all_reduce_bytes

    sent = ring_all_reduce_bytes(nbytes, world_size)
    meter.record(kind, sent_bytes=sent, recv_bytes=sent)


def _alltoall_reduce_scatter(installed: Any, meter: Any) -> Any:
    """An FSDP2 reduce-scatter comm: qaccel's exact all-to-all reduce-scatter on the replaced comm's buffers.

    Buffers come from the QSDP comm it replaces (``installed``, its pooled input); only the transport
    changes, with FSDP2's op (AVG for fp32). Built on use: FSDP2's comm base class is private
    (``_torch_internals``).
    """
    from .._torch_internals import fsdp2_comm_bases
    from ..comm import alltoall_reduce_scatter

    _, reduce_scatter_base = fsdp2_comm_bases()

    class AllToAllReduceScatter(reduce_scatter_base):
        def allocate(self, size, *, dtype, device):  # noqa: ANN001, ANN202
            return installed.allocate(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):  # noqa: ANN001, ANN202
            return alltoall_reduce_scatter(output_tensor, input_tensor, group, meter, KIND_ALLTOALL_RS, op, async_op=async_op)

    return AllToAllReduceScatter()
