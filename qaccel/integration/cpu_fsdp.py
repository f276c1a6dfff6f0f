"""Turn on Accelerate's FSDP2 path in a multi-process CPU run (tests, CI and CPU demos).

Upstream behaviour this relies on (accelerate 1.15, ``state.py`` ``AcceleratorState.__init__``):
the switch to ``DistributedType.FSDP`` is only made for MULTI_GPU/NPU/XPU/HPU/MLU/SDAA/MUSA/NEURON,
never for MULTI_CPU, so on CPU Accelerate would DDP-wrap the model. Setting what that branch would
have set (``distributed_type`` and ``fsdp_plugin``) before ``prepare`` makes ``prepare`` take its
FSDP2 path (``_prepare_fsdp2`` -> ``fsdp2_prepare_model``) over gloo. The type is also mirrored
into ``PartialState``, as the end of ``AcceleratorState.__init__`` does
(``PartialState._shared_state["distributed_type"] = ...``): every later ``AcceleratorState()``
(e.g. inside ``AcceleratedOptimizer``) copies ``PartialState``'s dict over its own. This is the
only place qaccel writes Accelerate's state; its test fails loudly if an Accelerate upgrade moves
these attributes (``docs/qsdp.md``, "Accelerate").
"""

from __future__ import annotations

from typing import Any

from accelerate.state import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

__all__ = ["enable_fsdp2_on_cpu"]


def enable_fsdp2_on_cpu(accelerator: Any, plugin: FullyShardedDataParallelPlugin) -> None:
    """Make a MULTI_CPU ``accelerator`` prepare models with FSDP2 and ``plugin``.

    Args:
        accelerator: an ``accelerate.Accelerator`` whose state is ``DistributedType.MULTI_CPU``.
        plugin: an FSDP2 plugin (``fsdp_version=2``).

    Raises:
        RuntimeError: the state is not MULTI_CPU, or Accelerate no longer has the attributes this
            relies on (then this function needs updating for the new Accelerate).
        NotImplementedError: ``plugin`` is FSDP1.
    """
    state = accelerator.state
    # `fsdp_plugin` itself only exists after the GPU branch ran; the check after the write below
    # (Accelerate's own `is_fsdp2`) proves Accelerate reads the attribute we set.
    for attr in ("distributed_type", "mixed_precision"):
        if not hasattr(state, attr):
            raise RuntimeError(
                f"enable_fsdp2_on_cpu: AcceleratorState has no {attr!r}; this Accelerate version "
                "changed the internals qaccel relies on to run FSDP2 on CPU"
            )
    if state.distributed_type != DistributedType.MULTI_CPU:
        raise RuntimeError(f"enable_fsdp2_on_cpu: needs a MULTI_CPU state, got {state.distributed_type}")
    if getattr(plugin, "fsdp_version", None) != 2:
        raise NotImplementedError(f"enable_fsdp2_on_cpu: fsdp_version={plugin.fsdp_version}; only FSDP2 runs on CPU")
    # What AcceleratorState does for GPUs: a plugin without its own policy gets the run's dtype.
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type = DistributedType.FSDP
    state.fsdp_plugin = plugin
    PartialState().distributed_type = DistributedType.FSDP
    if not (getattr(accelerator, "is_fsdp2", False) and accelerator.distributed_type == DistributedType.FSDP):
        raise RuntimeError("enable_fsdp2_on_cpu: Accelerate did not pick up the FSDP2 state; update this function")
