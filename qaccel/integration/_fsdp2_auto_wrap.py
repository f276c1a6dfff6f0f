"""FSDP2 auto-wrap for Accelerate's preparation: no unit may nest around a module Accelerate shards on its own.

Used by :func:`qaccel.integration._qsdp.before_prepare` for any FSDP2 plugin, QSDP or stock.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from accelerate.utils import FullyShardedDataParallelPlugin
from torch import nn
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

from ._accelerate_internals import fsdp2_carved_out_modules

__all__ = ["plan_auto_wrap"]


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
