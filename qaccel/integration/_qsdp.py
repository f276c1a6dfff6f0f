"""QSDP wiring into Accelerate: ``QSDPPlugin`` and the hooks ``qaccel.Accelerator`` calls.

Order (``docs/qsdp.md``, "Accelerate"):

1. ``before_init``: pick the plugin (a ``QSDPPlugin``, or one built from ``QACCEL_*`` settings
   when ``accelerate launch`` asked for FSDP2) and hand Accelerate a *copy* of it, given
   ``param_dtype=bf16, reduce_dtype=fp32`` under bf16 mixed precision (the wire format is ours, so
   an fp32 reduce costs no bandwidth); ask for the CPU backend when a distributed run has no GPU,
   and hold back Accelerate's check of a ``ParallelismConfig`` (it refuses 2-D meshes on CPU runs).
   The caller's plugin object is never changed.
2. ``after_init``: on a multi-process CPU run, switch Accelerate to its FSDP2 path
   (:func:`qaccel.integration.cpu_fsdp.enable_fsdp2_on_cpu`), then run that check.
3. ``before_prepare``: for any FSDP2 plugin, settle the auto-wrap so that no unit nests around a
   module Accelerate shards on its own afterwards (:func:`plan_auto_wrap`); then refuse what QSDP
   cannot do, before any collective.
4. ``preparing``: around Accelerate's ``prepare``; under hierarchical QSDP (``dp_replicate_size``
   R > 1) Accelerate shards on the intra-node ``dp_shard_cp`` mesh instead of the 2-D one.
5. ``after_prepare``: install the comms on every FSDP2 unit of the prepared model (with the
   ``dp_replicate`` group as replica group under hierarchical QSDP, unless a 1-bit optimizer owns
   the replicas) and the step hook on the prepared optimizer(s); register the seed state for
   ``save_state``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import os
from dataclasses import KW_ONLY, InitVar, dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from .._settings import env_flag
from ..checkpoint import QSDP_STATE_FILE, atomic_open, atomic_write_json, qsdp_error_rank_path, read_json
from ..fsdp import QSDPConfig, QSDPHandle, install_qsdp
from ..optim import OneBitOptimizerBase
from ._accelerate_internals import (
    REPLICATE_DIM,
    defer_parallelism_check,
    fsdp2_carved_out_modules,
    fsdp2_shards_within_nodes,
    run_deferred_parallelism_check,
)
from .cpu_fsdp import enable_fsdp2_on_cpu

__all__ = ["QSDPPlugin", "before_init", "after_init", "plan_auto_wrap", "before_prepare", "preparing", "after_prepare", "is_hierarchical"]

logger = logging.getLogger(__name__)

_MP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class _NotGiven:
    """Default of the QSDP keyword shortcuts: tells "not given" apart from ``None`` ("off")."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()
# The keyword shortcuts of QSDPPlugin, in the order of its InitVars below (a unit test checks
# that they are exactly QSDPConfig's fields, in this order).
QSDP_KEYWORDS = (
    "weight_bits",
    "grad_bits",
    "replica_grad_bits",
    "weight_bucket_size",
    "grad_bucket_size",
    "weight_meta_dtype",
    "grad_meta_dtype",
    "rounding",
    "seed",
    "master_weights",
    "param_min_numel",
    "unit_min_numel",
    "weight_rotation",
    "grad_rotation",
    "grad_error_feedback",
    "prefetch",
    "overlap_reduce_scatter",
)


@dataclass
class QSDPPlugin(FullyShardedDataParallelPlugin):
    """Accelerate's FSDP2 plugin plus a :class:`qaccel.QSDPConfig`, as a dataclass like Accelerate's own.

    ``qsdp_config`` is a real field, so ``repr``, ``dataclasses.fields`` and
    ``dataclasses.replace`` keep it. The QSDP settings may be given as a ready ``qsdp_config`` or
    as keywords named after ``QSDPConfig`` fields (``weight_bits=4``, ...); keywords not given come
    from ``QACCEL_QSDP_*`` variables, then the ``qsdp`` section of the config file (``recipe`` or
    ``QACCEL_CONFIG_FILE``), then the defaults, and ``__post_init__`` turns them into ``qsdp_config``.
    All other fields are ``FullyShardedDataParallelPlugin``'s (auto-wrap, ``reshard_after_forward``,
    mixed precision, state-dict type, ...), which still read Accelerate's ``FSDP_*`` variables.
    ``fsdp_version`` defaults to 2 (``FSDP_VERSION`` if set); anything else is refused.

    Args:
        qsdp_config: a ready config (then no QSDP keyword and no recipe may be given).
        recipe: a YAML/JSON config file with a ``qsdp`` section, or a zoo recipe such as
            ``model_cards/gpt2-tiny.md`` (its ``method.qsdp``).
        weight_bits, grad_bits, ...: ``QSDPConfig`` fields (init-only).

    Raises:
        NotImplementedError: ``fsdp_version`` (or ``FSDP_VERSION``) is not 2.
        ValueError: a bad QSDP value (naming the key, the value and where it came from), or both
            ``qsdp_config`` and QSDP keywords / a recipe.

    Example::

        accelerator = Accelerator(fsdp_plugin=QSDPPlugin(weight_bits=8, grad_bits=8))
        accelerator = Accelerator(fsdp_plugin=QSDPPlugin(qsdp_config=QSDPConfig(grad_bits="off")))
    """

    _: KW_ONLY
    qsdp_config: QSDPConfig | None = field(default=None, metadata={"help": "the QSDP settings (qaccel.QSDPConfig)"})
    recipe: InitVar[str | os.PathLike | None] = None
    weight_bits: InitVar[Any] = _NOT_GIVEN
    grad_bits: InitVar[Any] = _NOT_GIVEN
    replica_grad_bits: InitVar[Any] = _NOT_GIVEN
    weight_bucket_size: InitVar[Any] = _NOT_GIVEN
    grad_bucket_size: InitVar[Any] = _NOT_GIVEN
    weight_meta_dtype: InitVar[Any] = _NOT_GIVEN
    grad_meta_dtype: InitVar[Any] = _NOT_GIVEN
    rounding: InitVar[Any] = _NOT_GIVEN
    seed: InitVar[Any] = _NOT_GIVEN
    master_weights: InitVar[Any] = _NOT_GIVEN
    param_min_numel: InitVar[Any] = _NOT_GIVEN
    unit_min_numel: InitVar[Any] = _NOT_GIVEN
    weight_rotation: InitVar[Any] = _NOT_GIVEN
    grad_rotation: InitVar[Any] = _NOT_GIVEN
    grad_error_feedback: InitVar[Any] = _NOT_GIVEN
    prefetch: InitVar[Any] = _NOT_GIVEN
    overlap_reduce_scatter: InitVar[Any] = _NOT_GIVEN

    def __post_init__(self, recipe: str | os.PathLike | None, *qsdp_values: Any) -> None:
        given = {name: value for name, value in zip(QSDP_KEYWORDS, qsdp_values, strict=True) if value is not _NOT_GIVEN}
        if self.qsdp_config is not None:
            if given or recipe is not None:
                raise ValueError(f"QSDPPlugin: give either qsdp_config or QSDP keywords/recipe, not both (got {sorted(given)}, recipe={recipe!r})")
            if not isinstance(self.qsdp_config, QSDPConfig):
                raise TypeError(f"QSDPPlugin.qsdp_config: expected a QSDPConfig, got {type(self.qsdp_config).__name__}")
        else:
            self.qsdp_config = QSDPConfig.from_env(recipe=recipe, **given)
        version, source = self.fsdp_version, "argument"
        if version is None:
            version, source = os.environ.get("FSDP_VERSION", "2"), "FSDP_VERSION"
        if str(version) != "2":
            raise NotImplementedError(
                f"QSDPPlugin.fsdp_version={version} (from {source}): QSDP runs on FSDP2 only; use fsdp_version=2 "
                "(fsdp_config: {fsdp_version: 2} in the Accelerate config)"
            )
        self.fsdp_version = 2
        # reshard_after_forward=<int> is refused by Accelerate's FSDP2 plugin itself; install_qsdp
        # refuses it too for models sharded by hand.
        super().__post_init__()


def _launched_with_fsdp2() -> bool:
    return env_flag("ACCELERATE_USE_FSDP") and os.environ.get("FSDP_VERSION", "1") == "2"


def _world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def before_init(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Adjust ``Accelerator.__init__`` keyword arguments for QSDP; returns a new dict."""
    kwargs = dict(kwargs)
    plugin = kwargs.get("fsdp_plugin")
    if plugin is None and _launched_with_fsdp2():
        # `accelerate launch` with an FSDP2 config and qaccel's Accelerator: QSDP from QACCEL_* settings.
        plugin = kwargs["fsdp_plugin"] = QSDPPlugin()
    if not isinstance(plugin, FullyShardedDataParallelPlugin) or plugin.fsdp_version != 2:
        return kwargs
    if isinstance(plugin, QSDPPlugin):
        # Accelerate (and enable_fsdp2_on_cpu) set attributes on the plugin they are given: give
        # them a copy, so the caller's object stays as the caller built it.
        plugin = kwargs["fsdp_plugin"] = copy.copy(plugin)
    if isinstance(plugin, QSDPPlugin) and plugin.mixed_precision_policy is None and plugin.qsdp_config.grad_bits is not None:
        mixed_precision = kwargs.get("mixed_precision") or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        mixed_precision = getattr(mixed_precision, "value", mixed_precision)
        if mixed_precision in _MP_DTYPES:
            dtype = _MP_DTYPES[mixed_precision]
            # Quantized gradients travel as our codes whatever reduce_dtype is, so reduce in fp32:
            # the codec then sees exact gradients, and FSDP2 divides the sum in fp32, at no
            # bandwidth cost (docs/qsdp.md, "Mixed precision").
            plugin.mixed_precision_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, output_dtype=dtype)
    if "cpu" not in kwargs and not torch.cuda.is_available() and _world_size_from_env() > 1:
        # Without a GPU Accelerate would run each process alone; the CPU backend gives gloo.
        kwargs["cpu"] = True
    if kwargs.get("cpu") and _world_size_from_env() > 1:
        parallelism = kwargs.get("parallelism_config")
        if parallelism is None and env_flag("ACCELERATE_USE_PARALLELISM_CONFIG"):
            parallelism = ParallelismConfig()  # what Accelerator.__init__ would build from PARALLELISM_CONFIG_*
        if parallelism is not None:
            # Accelerate checks the mesh against the run type inside __init__, where a CPU run is still
            # MULTI_CPU (refused); after_init checks it once the run is FSDP2.
            kwargs["parallelism_config"] = defer_parallelism_check(parallelism)
    return kwargs


def after_init(accelerator: Any, fsdp_plugin: Any = None) -> None:
    """On a multi-process CPU run with an FSDP2 plugin, switch Accelerate to its FSDP2 path."""
    plugin = fsdp_plugin
    if not isinstance(plugin, FullyShardedDataParallelPlugin) or plugin.fsdp_version != 2:
        return
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        enable_fsdp2_on_cpu(accelerator, plugin)
        run_deferred_parallelism_check(accelerator)
    elif accelerator.distributed_type == DistributedType.NO and isinstance(plugin, QSDPPlugin):
        logger.warning("QSDP: single process, nothing to communicate; QSDP is inactive")



def _nested_carve_outs(model: nn.Module, is_unit: Any) -> list[tuple[str, str]]:
    """(unit name, carved-out name) for every auto-wrap unit that would contain a carved-out module.

    A carved-out module that is a unit itself is fine: Accelerate skips it.
    """
    names = {id(module): name for name, module in model.named_modules()}
    carved = [module for module in fsdp2_carved_out_modules(model) if not is_unit(module)]
    nested = []
    for name, module in model.named_modules():
        if module is model or not is_unit(module):  # Accelerate always wraps the root last
            continue
        inside = {id(sub) for sub in module.modules() if sub is not module}
        nested.extend((name, names[id(c)]) for c in carved if id(c) in inside)
    return nested


def plan_auto_wrap(plugin: FullyShardedDataParallelPlugin, model: nn.Module) -> dict[str, str]:
    """Settle ``plugin``'s auto-wrap for ``model`` so that no unit nests around a carved-out module.

    Accelerate's FSDP2 preparation shards the auto-wrap units first and then, as units of their
    own, the input embedding and the [final norm, output embedding] tail (``fsdp2_carved_out_modules``).
    ``fully_shard`` on a module whose parameters an enclosing unit already sharded fails
    (``TypeError: Invariant encountered: value was None``). The transformer-based wrap without a
    class list takes the model's ``_no_split_modules``, which for BERT-like models names the
    embeddings block (``BertEmbeddings``) around the input embedding: such classes are dropped
    from the default list (the transformer blocks stay units; the embedding becomes Accelerate's
    own unit, as for GPT-2). Classes named explicitly are kept as named, or refused.

    Args:
        plugin: an FSDP2 plugin (``auto_wrap_policy`` as ``__post_init__`` resolved it).
        model: the model about to be prepared.

    Returns:
        The classes left out of the default list, each with the carved-out module it contains
        (empty when nothing changed).

    Raises:
        ValueError: an explicitly named transformer class, or a size-based unit
            (``min_num_params``), would contain a carved-out module.
    """
    policy = plugin.auto_wrap_policy
    policy = policy.func if isinstance(policy, functools.partial) else policy
    if policy is transformer_auto_wrap_policy:
        explicit = plugin.transformer_cls_names_to_wrap is not None
        listed = list(plugin.transformer_cls_names_to_wrap if explicit else getattr(model, "_no_split_modules", None) or [])

        def inner(module: nn.Module) -> nn.Module:
            # Accelerate's policy looks through activation checkpointing's wrapper, so does this.
            return getattr(module, "_checkpoint_wrapped_module", module)

        # Accelerate matches with isinstance against the classes found by name in the model.
        classes = tuple({type(inner(m)) for m in model.modules() if type(inner(m)).__name__ in listed})
        nested = _nested_carve_outs(model, lambda module: isinstance(inner(module), classes))
        if not nested:
            return {}
        blocked = {
            next(c.__name__ for c in type(inner(model.get_submodule(unit))).__mro__ if c in classes): (unit, carved)
            for unit, carved in nested
        }
        if explicit:
            name, (unit, carved) = next(iter(blocked.items()))
            from_env = os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") == listed
            source = "FSDP_TRANSFORMER_CLS_TO_WRAP" if from_env else "the FSDP plugin"
            raise ValueError(
                f"FSDP transformer_cls_names_to_wrap={listed} (from {source}): {name} ({unit}) contains {carved}, which "
                "Accelerate's FSDP2 preparation shards as a unit of its own afterwards; fully_shard cannot nest it "
                f"inside an already sharded unit. Name the transformer block classes only (not {name})"
            )
        plugin.transformer_cls_names_to_wrap = [name for name in listed if name not in blocked]
        return {name: carved for name, (_, carved) in blocked.items()}
    elif policy is size_based_auto_wrap_policy and plugin.min_num_params > 0:
        numel = {id(module): sum(p.numel() for p in module.parameters()) for module in model.modules()}
        nested = _nested_carve_outs(model, lambda module: numel[id(module)] > plugin.min_num_params)
        if nested:
            unit, carved = nested[0]
            raise ValueError(
                f"FSDP min_num_params={plugin.min_num_params} (size-based auto-wrap): {unit} "
                f"({numel[id(model.get_submodule(unit))]} parameters) would be a unit around {carved}, which Accelerate's "
                "FSDP2 preparation shards as a unit of its own afterwards; fully_shard cannot nest it. Use "
                "auto_wrap_policy='transformer_based_wrap' (FSDP_AUTO_WRAP_POLICY=TRANSFORMER_BASED_WRAP)"
            )
    return {}


def _fsdp2_plugin(accelerator: Any) -> FullyShardedDataParallelPlugin | None:
    if accelerator.distributed_type != DistributedType.FSDP:
        return None
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    return plugin if isinstance(plugin, FullyShardedDataParallelPlugin) and str(plugin.fsdp_version) == "2" else None


def _qsdp_plugin(accelerator: Any) -> QSDPPlugin | None:
    plugin = _fsdp2_plugin(accelerator)
    return plugin if isinstance(plugin, QSDPPlugin) else None


def before_prepare(accelerator: Any, args: tuple) -> None:
    """Settle the FSDP2 auto-wrap (any FSDP2 plugin); refuse unsupported QSDP set-ups before anything is sharded."""
    fsdp2_plugin = _fsdp2_plugin(accelerator)
    if fsdp2_plugin is not None:
        for model in args:
            if not isinstance(model, nn.Module) or isinstance(model, FSDPModule):
                continue
            dropped = plan_auto_wrap(fsdp2_plugin, model)
            if dropped and accelerator.is_main_process:
                logger.info(
                    "FSDP auto-wrap: left %s out of %s's _no_split_modules (each contains a module Accelerate shards "
                    "as its own unit: %s); units: %s", sorted(dropped), type(model).__name__, dropped,
                    fsdp2_plugin.transformer_cls_names_to_wrap,
                )  # fmt: skip
    plugin = _qsdp_plugin(accelerator)
    if plugin is None:
        return
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None:
        others = {name: getattr(parallelism, name, 1) or 1 for name in ("tp_size", "cp_size", "sp_size")}
        if any(size > 1 for size in others.values()):
            listed = ", ".join(f"{name}={size}" for name, size in others.items() if size > 1)
            raise NotImplementedError(
                f"QSDP: parallelism_config {listed}: QSDP shards data-parallel meshes only, 1-D (dp_shard_size) or "
                "hierarchical 2-D (dp_replicate_size x dp_shard_size: sharded within a node, replicated across "
                "nodes); tensor, context and sequence parallelism are not supported. Set them to 1"
            )
    has_model = any(isinstance(obj, torch.nn.Module) for obj in args)
    has_optimizer = any(isinstance(obj, torch.optim.Optimizer) for obj in args)
    if has_model and not has_optimizer:
        raise ValueError("QSDP: pass the model and its optimizer to the same accelerator.prepare call (FSDP2 requires it)")


def is_hierarchical(accelerator: Any) -> bool:
    """QSDP with ``ParallelismConfig(dp_replicate_size=R > 1, dp_shard_size=S)``: hierarchical QSDP."""
    parallelism = getattr(accelerator, "parallelism_config", None)
    return _qsdp_plugin(accelerator) is not None and parallelism is not None and (parallelism.dp_replicate_size or 1) > 1


def preparing(accelerator: Any) -> contextlib.AbstractContextManager:
    """Context for Accelerate's ``prepare``: hierarchical QSDP shards on the intra-node mesh only."""
    return fsdp2_shards_within_nodes(accelerator) if is_hierarchical(accelerator) else contextlib.nullcontext()


def after_prepare(accelerator: Any, objects: list) -> None:
    """Install QSDP comms on the prepared FSDP2 model and hook the prepared optimizer(s)."""
    plugin = _qsdp_plugin(accelerator)
    if plugin is None:
        return
    models = [obj for obj in objects if isinstance(obj, FSDPModule)]
    if not models:
        return
    if len(models) > 1:
        raise NotImplementedError(f"QSDP: {len(models)} FSDP models in one prepare call; Accelerate's FSDP2 path takes one")
    optimizers = [obj.optimizer if isinstance(obj, AcceleratedOptimizer) else obj for obj in objects if isinstance(obj, (AcceleratedOptimizer, torch.optim.Optimizer))]
    # A 1-bit optimizer owns the traffic across replicas (qaccel.integration._zero_one_adam): QSDP then
    # runs inside the node only, and replica_grad_bits is not used.
    onebit = any(isinstance(opt, OneBitOptimizerBase) for opt in optimizers)
    replica_group = accelerator.torch_device_mesh[REPLICATE_DIM].get_group() if is_hierarchical(accelerator) and not onebit else None
    handle: QSDPHandle = install_qsdp(models[0], plugin.qsdp_config, optimizers=optimizers, meter=accelerator.wire_meter, replica_group=replica_group)
    accelerator.qsdp = handle
    # The seed counters drive the rounding noise; save_state/load_state carry them for exact
    # resumes. As JSON through the state hooks rather than register_for_checkpointing, whose
    # pickle Accelerate loads with weights_only=False: nothing is unpickled unsafely on resume.
    rank = accelerator.process_index
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: write_qsdp_state(handle, output_dir, rank, accelerator.is_main_process))
    accelerator.register_load_state_pre_hook(lambda models, input_dir: read_qsdp_state(handle, input_dir, rank))
    if accelerator.is_main_process:
        logger.info("QSDP config: %s; units: %s", plugin.qsdp_config.to_dict(), handle.describe())


def write_qsdp_state(handle: QSDPHandle, output_dir: str | os.PathLike, rank: int, is_main_process: bool) -> None:
    """Write ``qaccel_qsdp.json`` (seed counters, world size, config; main process) and, with gradient
    error feedback, this rank's buffers (``qaccel_qsdp_error_rank<rank>.safetensors``); call on every rank."""
    if is_main_process:
        atomic_write_json(Path(output_dir) / QSDP_STATE_FILE, handle.state_dict())
    if handle.config.grad_error_feedback is not None:
        from safetensors.torch import save

        tensors = {name: tensor.detach().cpu().contiguous() for name, tensor in handle.error_state().items()}
        with atomic_open(qsdp_error_rank_path(output_dir, rank), "wb") as stream:
            stream.write(save(tensors, metadata={"world_size": str(handle.world_size), "rank": str(rank)}))


def read_qsdp_state(handle: QSDPHandle, input_dir: str | os.PathLike, rank: int) -> bool:
    """Restore the seed counters (and this rank's error-feedback buffers) from ``input_dir``.

    Returns False (and a warning) when the folder has no QSDP state.

    Raises:
        ValueError: the checkpoint was saved with other QSDP settings (naming each one), or with
            error feedback on the same world size but without this rank's buffer file.
    """
    path = Path(input_dir) / QSDP_STATE_FILE
    if not path.exists():
        logger.warning(
            "QSDP: %s has no %s (saved without QSDP?): the rounding noise restarts from step 0; training is "
            "unaffected otherwise", input_dir, QSDP_STATE_FILE,
        )  # fmt: skip
        return False
    state = read_json(path)
    handle.load_state_dict(state)
    if handle.config.grad_error_feedback is not None:
        saved_world_size = int(state["world_size"])
        error_path = qsdp_error_rank_path(input_dir, rank)
        tensors: dict[str, torch.Tensor] = {}
        if saved_world_size == handle.world_size:
            if not error_path.exists():
                raise ValueError(
                    f"QSDP checkpoint {input_dir}: saved with grad_error_feedback on {saved_world_size} ranks but "
                    f"{error_path.name} (rank {rank}'s error buffers) is missing; the checkpoint is incomplete"
                )
            from safetensors.torch import load_file

            tensors = load_file(str(error_path))
        handle.load_error_state(tensors, saved_world_size)
    return True
