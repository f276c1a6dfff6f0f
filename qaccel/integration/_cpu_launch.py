"""Multi-process launches on a machine without a GPU: run them as Accelerate's ``cpu=True`` does.

Upstream behaviour relied on (accelerate 1.15, ``state.py`` ``PartialState._prepare_backend``): under
``torchrun`` (``LOCAL_RANK`` set) and without ``cpu=True``, Accelerate looks for an accelerator (XLA, MLU,
SDAA, MUSA, NPU, HPU, CUDA, XPU with XCCL, Neuron, in that order) and, finding none, leaves the distributed
type at ``NO``: each of the N processes then reports one process and believes it is the main process,
while ``torch.distributed`` would have N ranks. With ``cpu=True`` the same launch is ``MULTI_CPU`` over gloo.
So when the environment says "N > 1 processes" and none of those devices is usable, ``qaccel.Accelerator``
passes ``cpu=True`` itself (and logs it once, at INFO, on rank 0); an explicit ``cpu=False`` there is an
error, since it cannot mean anything but N unconnected single-process runs. ``ACCELERATE_USE_CPU`` (set by
``accelerate launch --cpu``) already forces ``cpu=True`` inside Accelerate, so it needs nothing from here.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import torch
from accelerate import utils as accelerate_utils

from .._settings import env_flag

__all__ = ["before_init", "launch_world_size", "is_multi_process_launch", "usable_accelerator"]

logger = logging.getLogger(__name__)

# The variables Accelerate reads for the number of processes (``_prepare_backend``), in its order.
WORLD_SIZE_VARIABLES = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "WORLD_SIZE")
_logged = False


def launch_world_size(environ: Mapping[str, str]) -> tuple[int, str] | None:
    """(number of processes, variable it came from) as the launcher exported it, or None."""
    for name in WORLD_SIZE_VARIABLES:
        text = environ.get(name, "").strip()
        if text:
            try:
                return int(text), name
            except ValueError:
                raise ValueError(f"{name}={text!r}: must be an integer number of processes") from None
    return None


def is_multi_process_launch(environ: Mapping[str, str]) -> bool:
    """A launcher started several processes: a world size > 1, or ``LOCAL_RANK`` without any world size."""
    world = launch_world_size(environ)
    if world is not None:
        return world[0] > 1
    return environ.get("LOCAL_RANK", "").strip() not in ("", "-1")


def usable_accelerator() -> str | None:
    """The device family Accelerate would run a multi-process launch on, or None (then it would say NO)."""
    checks = (
        ("xla", accelerate_utils.is_torch_xla_available),
        ("mlu", accelerate_utils.is_mlu_available),
        ("sdaa", accelerate_utils.is_sdaa_available),
        ("musa", accelerate_utils.is_musa_available),
        ("npu", accelerate_utils.is_npu_available),
        ("hpu", accelerate_utils.is_hpu_available),
        ("cuda", torch.cuda.is_available),
        ("xpu", lambda: accelerate_utils.is_xpu_available() and accelerate_utils.is_xccl_available()),
        ("neuron", accelerate_utils.is_neuron_available),
    )
    for name, available in checks:
        if available():
            return name
    return None


def _forced_cpu(environ: Mapping[str, str]) -> bool:
    return env_flag("ACCELERATE_USE_CPU", environ)


def before_init(kwargs: dict[str, Any], environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Return ``Accelerator.__init__`` keyword arguments with ``cpu=True`` added on a multi-process CPU launch.

    ``cpu=None`` counts as not given (so a script can pass ``cpu=args.cpu or None``).

    Raises:
        ValueError: ``cpu=False`` was passed on a multi-process launch that has no usable accelerator.
    """
    environ = os.environ if environ is None else environ
    if "cpu" in kwargs and kwargs["cpu"] is None:
        kwargs = {key: value for key, value in kwargs.items() if key != "cpu"}
    if kwargs.get("cpu") or _forced_cpu(environ) or not is_multi_process_launch(environ):
        return kwargs
    if usable_accelerator() is not None:
        return kwargs
    world = launch_world_size(environ)
    launch = f"{world[1]}={world[0]}" if world is not None else f"LOCAL_RANK={environ.get('LOCAL_RANK')}"
    if "cpu" in kwargs:
        raise ValueError(
            f"qaccel.Accelerator(cpu=False): this is a multi-process launch ({launch}) on a machine without a "
            "usable GPU or other accelerator, where cpu=False would leave every process alone and each one the "
            "main process; pass cpu=True or leave cpu unset (then qaccel runs the launch on CPU over gloo)"
        )
    global _logged
    if not _logged and environ.get("RANK", "0").strip() in ("", "0"):
        logger.info(
            "qaccel.Accelerator: multi-process CPU launch detected (%s, no usable GPU or other accelerator): "
            "running with cpu=True (gloo), as Accelerate would otherwise treat every process as alone",
            launch,
        )
    _logged = True
    return {**kwargs, "cpu": True}
