"""The one module that reads torch's private surface (style guide §9).

Checked against torch 2.13.0 and 2.11.0 (:data:`TORCH`; the whole suite passes under both on CPU). Every private torch name qaccel uses is read here,
through small named accessors; a name that a torch release dropped raises a ``RuntimeError`` naming
it, the installed torch and the checked versions (never a silent ``getattr`` default). What is read,
and why no public API does it:

- FSDP2 (``torch/distributed/fsdp/_fully_shard``, ``docs/qsdp.md``, "Upstream hook points"): the
  custom-comm base classes ``AllGather`` / ``ReduceScatter`` of ``_fsdp_api`` (torch >= 2.9; not
  re-exported by ``torch.distributed.fsdp``) and the default comms ``DefaultAllGather`` /
  ``DefaultReduceScatter`` of ``_fsdp_collectives`` (what a unit carries until a custom one is set); a unit's ``FSDPState`` (``FSDPModule._get_fsdp_state``)
  with its ``_modules``, ``_fsdp_param_groups`` (2.11: ``_fsdp_param_group``) and
  ``_states_to_{forward,backward}_prefetch``; each
  ``FSDPParamGroup``'s ``fsdp_params``, ``mp_policy``, ``mesh_info`` / ``post_forward_mesh_info``,
  ``unshard_async_op`` and installed ``_all_gather_comm`` / ``_reduce_scatter_comm``; each
  ``FSDPParam``'s ``sharded_param`` and ``_sharded_local_tensor``. For the overlapped reduce-scatter
  (``qaccel.fsdp._rs_overlap``), what FSDP2 does with a reduced shard: ``_get_gradient_divide_factors``
  of ``_fsdp_collectives``, a group's ``force_sum_reduction_for_comms`` and ``_orig_dtype``, a param's
  ``sharded_size``, ``contiguous_sharded_stride``, ``offload_to_cpu`` and ``fsdp_placement``.
- Autograd: ``torch._C._current_graph_task_id`` (is this thread in a backward pass) and the engine's
  ``queue_callback`` (run once the pass ends: FSDP2 finalizes its backward the same way), and a
  tensor's ``_post_accumulate_grad_hooks`` (whether something reads ``.grad`` during backward).
- ``torch._C._storage_Use_Count``: how many tensors share a storage (the comm buffer pool's
  "nobody holds this buffer any more" test).
- ``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``: where a DTensor shard
  starts in its tensor (DTensor has no public accessor; 0/1 Adam slices ``exp_avg_mask`` with it).
- ``torch._foreach_norm`` / ``torch._foreach_mul_``: the fused per-list ops
  ``torch.nn.utils.clip_grad_norm_`` itself uses (gradient clipping and the non-finite guard).
- ``filesystem._StorageInfo`` and ``metadata._MEM_FORMAT_ENCODING`` of
  ``torch.distributed.checkpoint``, and ``torch.serialization._get_layout``: private globals that
  torch's DCP ``.metadata`` pickles refer to, which the vetted checkpoint loader must allow
  (:func:`dcp_metadata_private_globals`).
- The flat collectives under both of their names (:func:`all_gather_single`,
  :func:`reduce_scatter_single`): torch 2.13 renamed ``all_gather_into_tensor`` /
  ``reduce_scatter_tensor`` to ``*_single`` (the old names warn there) and 2.11 has only the old ones.

This module sits below every layer (it imports only torch), so ``comm/``, ``fsdp/``, ``optim/``,
``training/`` and ``checkpoint/`` all use it.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ._upstream import PrivateSurface

__all__ = [
    "TORCH",
    "fsdp2_comm_bases",
    "fsdp2_default_comm_types",
    "fsdp_state",
    "state_modules",
    "param_groups",
    "installed_comms",
    "group_params",
    "group_param_dtype",
    "group_post_forward_mesh_size",
    "set_unshard_async_op",
    "clear_prefetch_targets",
    "sharded_param",
    "sharded_local_tensor",
    "group_force_sum_reduction",
    "group_orig_dtype",
    "gradient_divide_factors",
    "param_sharded_size",
    "param_contiguous_sharded_stride",
    "param_offloads_to_cpu",
    "param_shard_dim",
    "current_graph_task_id",
    "queue_backward_callback",
    "has_post_accumulate_grad_hooks",
    "storage_use_count",
    "dtensor_global_offset",
    "foreach_norm",
    "foreach_mul_",
    "dcp_metadata_private_globals",
    "all_gather_single",
    "reduce_scatter_single",
]

TORCH = PrivateSurface("torch", ("2.11.0", "2.13.0"), __name__)

_FSDP_API = "torch.distributed.fsdp._fully_shard._fsdp_api"
_CUSTOM_COMMS = "FSDP2 custom all-gather / reduce-scatter comms, torch >= 2.9"


# ------------------------------------------------------------------------------------------ FSDP2
def fsdp2_comm_bases() -> tuple[type, type]:
    """FSDP2's ``(AllGather, ReduceScatter)`` base classes, which QSDP's comms subclass.

    Raises:
        RuntimeError: this torch has no ``_fsdp_api`` module or lacks one of the classes.
    """
    try:
        api = importlib.import_module(_FSDP_API)
    except ImportError:
        raise TORCH.missing(f"the module {_FSDP_API}", _CUSTOM_COMMS) from None
    return TORCH.get(api, "AllGather", _CUSTOM_COMMS), TORCH.get(api, "ReduceScatter", _CUSTOM_COMMS)


def fsdp2_default_comm_types() -> tuple[type, type]:
    """FSDP2's ``(DefaultAllGather, DefaultReduceScatter)``: the comms a unit carries before a custom one is set.

    Raises:
        RuntimeError: this torch lacks one of the classes.
    """
    module = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    purpose = "telling FSDP2's default comms from a foreign custom comm"
    return TORCH.get(module, "DefaultAllGather", purpose), TORCH.get(module, "DefaultReduceScatter", purpose)


def fsdp_state(module: nn.Module) -> Any:
    """The ``FSDPState`` of an FSDP2 module; the modules of one ``fully_shard`` call share it."""
    getter = TORCH.get(module, "_get_fsdp_state", "the FSDP2 state of a unit", owner="FSDPModule")
    return getter()


def state_modules(state: Any) -> tuple[nn.Module, ...]:
    """The modules passed to the ``fully_shard`` call that made ``state`` (several for list-form calls)."""
    return tuple(TORCH.get(state, "_modules", "the modules of an FSDP2 unit", owner="FSDPState"))


def param_groups(state: Any) -> list[Any]:
    """The ``FSDPParamGroup`` objects of a unit (one unless ``shard_placement_fn`` gave several meshes).

    torch 2.13 keeps a list (``_fsdp_param_groups``); torch 2.11 keeps at most one group
    (``_fsdp_param_group``, None for a unit that owns no parameter).
    """
    purpose = "the param groups of an FSDP2 unit"
    if TORCH.defines(state, "_fsdp_param_groups"):
        return list(TORCH.get(state, "_fsdp_param_groups", purpose, owner="FSDPState"))
    if TORCH.defines(state, "_fsdp_param_group"):
        group = TORCH.get(state, "_fsdp_param_group", purpose, owner="FSDPState")
        return [] if group is None else [group]
    raise TORCH.missing("FSDPState._fsdp_param_groups (torch 2.11: _fsdp_param_group)", purpose)


def installed_comms(group: Any) -> dict[str, Any]:
    """The all-gather and reduce-scatter comm objects a param group uses, by their attribute names."""
    purpose = "which comm an FSDP2 unit already carries"
    return {
        name: TORCH.get(group, name, purpose, owner="FSDPParamGroup")
        for name in ("_all_gather_comm", "_reduce_scatter_comm")
    }


def group_all_reduce_hook(group: Any) -> Any:
    """The hook ``FSDPModule.set_all_reduce_hook`` installed on a param group, or None."""
    return TORCH.get(group, "_all_reduce_hook", "whether an FSDP2 unit already has an all-reduce hook", owner="FSDPParamGroup")


def group_gradient_divide_factor(group: Any) -> float | None:
    """The factor ``FSDPModule.set_gradient_divide_factor`` set on a param group, or None (FSDP2's default)."""
    return TORCH.get(group, "gradient_divide_factor", "the gradient divide factor of an FSDP2 unit", owner="FSDPParamGroup")


def group_params(group: Any) -> list[Any]:
    """The ``FSDPParam`` objects of a param group, in all-gather buffer order."""
    return list(TORCH.get(group, "fsdp_params", "the parameters of an FSDP2 param group", owner="FSDPParamGroup"))


def group_param_dtype(group: Any) -> torch.dtype | None:
    """The mixed-precision policy's ``param_dtype`` of a param group (None: parameters keep their dtype)."""
    purpose = "the dtype FSDP2 all-gathers a unit in"
    policy = TORCH.get(group, "mp_policy", purpose, owner="FSDPParamGroup")
    return TORCH.get(policy, "param_dtype", purpose, owner="MixedPrecisionPolicy")


def group_post_forward_mesh_size(group: Any) -> int | None:
    """The group size of ``reshard_after_forward=<int>``, or None when the post-forward shards are the regular ones."""
    purpose = "whether a unit reshards after forward to a smaller mesh"
    post_forward = TORCH.get(group, "post_forward_mesh_info", purpose, owner="FSDPParamGroup")
    if post_forward is None or post_forward is TORCH.get(group, "mesh_info", purpose, owner="FSDPParamGroup"):
        return None
    return int(TORCH.get(post_forward, "shard_mesh_size", purpose, owner="FSDPMeshInfo"))


def set_unshard_async_op(group: Any, enabled: bool) -> None:
    """Make one param group's unshard asynchronous (FSDP2 then waits on it only when forward needs it).

    ``FSDPModule._set_unshard_async_op`` would do this for every group below the module, including
    nested units the caller did not list, so the flag is set per group.
    """
    TORCH.set(group, "unshard_async_op", enabled, "asynchronous FSDP2 unshards", owner="FSDPParamGroup")


def clear_prefetch_targets(state: Any) -> None:
    """Drop a unit's explicit forward and backward prefetch targets (undoes ``set_modules_to_*_prefetch``)."""
    for name in ("_states_to_forward_prefetch", "_states_to_backward_prefetch"):
        TORCH.set(state, name, [], "clearing FSDP2 explicit prefetching", owner="FSDPState")


def sharded_param(fsdp_param: Any) -> nn.Parameter:
    """The sharded ``DTensor`` parameter an ``FSDPParam`` registers on its module."""
    return TORCH.get(fsdp_param, "sharded_param", "the sharded parameter of an FSDP2 param", owner="FSDPParam")


def sharded_local_tensor(fsdp_param: Any) -> torch.Tensor:
    """The local tensor of an ``FSDPParam``'s shard (a tensor subclass may define ``fsdp_pre_all_gather``)."""
    purpose = "whether an FSDP2 param uses a tensor-subclass all-gather extension"
    return TORCH.get(fsdp_param, "_sharded_local_tensor", purpose, owner="FSDPParam")


_RS_OVERLAP = "overlapping the QSDP reduce-scatter with backward on CPU"
_FSDP_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


def group_force_sum_reduction(group: Any) -> bool:
    """Whether ``set_force_sum_reduction_for_comms(True)`` is set on a param group."""
    return bool(TORCH.get(group, "force_sum_reduction_for_comms", _RS_OVERLAP, owner="FSDPParamGroup"))


def group_orig_dtype(group: Any) -> torch.dtype | None:
    """The parameters' own dtype, which FSDP2 casts a reduced gradient shard to (set at its lazy init)."""
    return TORCH.get(group, "_orig_dtype", _RS_OVERLAP, owner="FSDPParamGroup")


def gradient_divide_factors() -> Any:
    """FSDP2's ``_get_gradient_divide_factors``: the reduce op a comm gets and what FSDP2 divides by afterwards."""
    return TORCH.get(importlib.import_module(_FSDP_COLLECTIVES), "_get_gradient_divide_factors", _RS_OVERLAP)


def param_sharded_size(fsdp_param: Any) -> torch.Size:
    """The local shard's size of an ``FSDPParam`` (padded rows excluded)."""
    return TORCH.get(fsdp_param, "sharded_size", _RS_OVERLAP, owner="FSDPParam")


def param_contiguous_sharded_stride(fsdp_param: Any) -> tuple[int, ...]:
    """The stride FSDP2 views a contiguous shard with, inside its flat reduce-scatter output."""
    return TORCH.get(fsdp_param, "contiguous_sharded_stride", _RS_OVERLAP, owner="FSDPParam")


def param_offloads_to_cpu(fsdp_param: Any) -> bool:
    """Whether an ``FSDPParam`` is offloaded to the CPU (``CPUOffloadPolicy``)."""
    return bool(TORCH.get(fsdp_param, "offload_to_cpu", _RS_OVERLAP, owner="FSDPParam"))


def param_shard_dim(fsdp_param: Any) -> int:
    """The dimension an ``FSDPParam`` is sharded on (0 unless ``shard_placement_fn`` chose another)."""
    return int(TORCH.get(fsdp_param, "fsdp_placement", _RS_OVERLAP, owner="FSDPParam").dim)


# ------------------------------------------------------------------------- flat collectives
def all_gather_single(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None, async_op: bool = False
) -> dist.Work | None:
    """Gather every rank's ``input`` into the flat ``output`` (``group.size() * input.numel()`` elements).

    Calls ``dist.all_gather_single`` where torch has it (2.13 does, 2.11 does not; FSDP2's default comm calls it) and
    ``dist.all_gather_into_tensor`` otherwise. The function is looked up at call time, as FSDP2's own
    comms do, so a wrapper around the torch function (a profiler, a test counting the bytes handed
    to the collective) sees these calls too.

    Returns:
        The collective's ``Work`` when ``async_op``, else None.
    """
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return collective(output, input, group=group, async_op=async_op)


def reduce_scatter_single(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None,
    op: dist.ReduceOp | None = None,
    async_op: bool = False,
) -> dist.Work | None:
    """Reduce the flat ``input`` across ranks with ``op`` (default SUM) and keep this rank's chunk in ``output``.

    ``dist.reduce_scatter_single`` where torch has it, else ``dist.reduce_scatter_tensor``; looked up
    at call time like :func:`all_gather_single`.
    """
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return collective(output, input, op=dist.ReduceOp.SUM if op is None else op, group=group, async_op=async_op)


# ----------------------------------------------------------------------------------- torch core
def current_graph_task_id() -> int:
    """The autograd graph task running in this thread (-1 outside backward)."""
    return int(TORCH.get(torch._C, "_current_graph_task_id", _RS_OVERLAP, owner="torch._C")())


def queue_backward_callback(callback: Any) -> None:
    """Run ``callback`` when the current backward pass ends, after the callbacks queued before it."""
    engine = TORCH.get(torch.autograd.Variable, "_execution_engine", _RS_OVERLAP, owner="torch.autograd.Variable")
    engine.queue_callback(callback)


def has_post_accumulate_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``register_post_accumulate_grad_hook`` put a hook on ``tensor``."""
    return bool(TORCH.get(tensor, "_post_accumulate_grad_hooks", _RS_OVERLAP, owner="Tensor"))


def storage_use_count(tensor: torch.Tensor) -> int:
    """How many tensors (views included) share ``tensor``'s storage."""
    purpose = "telling when a pooled comm buffer is free"
    storage = tensor.untyped_storage()
    count = TORCH.get(TORCH.get(torch, "_C", purpose), "_storage_Use_Count", purpose, owner="torch._C")
    return int(count(TORCH.get(storage, "_cdata", purpose, owner="UntypedStorage")))


def dtensor_global_offset(t: Any) -> tuple[int, ...]:
    """Where a ``DTensor``'s local shard starts in the global tensor, per dimension (no communication)."""
    purpose = "where an FSDP2 shard sits in its parameter (0/1 Adam's exp_avg_mask on shards)"
    module = importlib.import_module("torch.distributed.tensor._utils")
    compute = TORCH.get(module, "compute_local_shape_and_global_offset", purpose)
    return tuple(compute(t.shape, t.device_mesh, t.placements)[1])


def foreach_norm(tensors: Sequence[torch.Tensor], ord: float = 2) -> list[torch.Tensor]:
    """The ``ord``-norm of each tensor, in one fused call (``torch._foreach_norm``)."""
    return list(TORCH.get(torch, "_foreach_norm", "fused per-tensor norms")(list(tensors), ord))


def foreach_mul_(tensors: Sequence[torch.Tensor], factor: torch.Tensor | float) -> None:
    """Multiply every tensor in place by ``factor``, in one fused call (``torch._foreach_mul_``)."""
    TORCH.get(torch, "_foreach_mul_", "fused in-place scaling")(list(tensors), factor)


# Written by ``FileSystemWriter`` (``torch/distributed/checkpoint/filesystem.py``) into every ``.metadata`` pickle.
_DCP_METADATA_GLOBALS = (
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.serialization", "_get_layout"),
)


@functools.cache
def dcp_metadata_private_globals() -> frozenset[tuple[str, str]]:
    """The ``(module, name)`` private globals DCP ``.metadata`` pickles refer to, each checked to exist here.

    Raises:
        RuntimeError: this torch no longer has one of them (its metadata files would name another).
    """
    purpose = "reading DCP checkpoint metadata with a restricted unpickler"
    for module, name in _DCP_METADATA_GLOBALS:
        TORCH.get(importlib.import_module(module), name, purpose)
    return frozenset(_DCP_METADATA_GLOBALS)
