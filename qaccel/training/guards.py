"""Per-step guards of a training run: non-finite values and replica consistency, agreed by all ranks.

**Non-finite values.** A NaN or inf in one rank's gradient does not always reach the others: under
0/1 Adam's local steps, or when a QSDP reduce-scatter hands each rank only its shard, one rank can
hold it alone. So the check is local, then shared with one all-reduce of one integer per rank, and
every rank acts on the same answer before the optimizer applies anything:

- without a loss scaler the run stops on every rank with :class:`NonFiniteError`, naming the step,
  the ranks and the first offending parameter (gradient or weight);
- with an fp16 loss scaler an overflowing gradient is the scaler's business (it skips the step and
  lowers the scale); the guard only makes sure that every rank's scaler sees it, so all skip together
  and the scales stay equal. A non-finite *weight* is still an error: no scaler repairs it.

``--allow_nonfinite`` switches the check (and its all-reduce) off.

**Replica consistency** (opt-in, ``QACCEL_CHECK_REPLICAS=N``): every N optimizer steps the ranks
all-gather one SHA-256 digest per item that must agree and stop with :class:`ReplicaMismatchError`
naming the step, the ranks and the first item that differs:

- DDP (stock, 0/1 Adam, 1-bit Adam): each parameter after the step. 0/1 Adam replicas legitimately
  differ during phase-2 local steps, so the check runs only where the optimizer's schedule says the
  replicas are synced (``schedule.steps_since_sync == 0``: after every sync and every step of phase 1);
  a due step that is a local step is checked at the next synced step instead.
- FSDP2 (QSDP or stock): the shards differ by design; what must agree is each unit's *gathered*
  weights, which every rank decodes from the same bytes. A forward pre-hook on each unit (it runs
  after FSDP2's own, so the parameters are unsharded) digests them during the step's first forward.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .._torch_internals import all_gather_single, foreach_norm

__all__ = [
    "ENV_CHECK_REPLICAS",
    "NonFiniteError",
    "ReplicaMismatchError",
    "NonFiniteGuard",
    "ReplicaGuard",
    "TrainingGuards",
    "replica_check_interval",
    "tensor_digest",
]

ENV_CHECK_REPLICAS = "QACCEL_CHECK_REPLICAS"


class NonFiniteError(RuntimeError):
    """A gradient or weight holds NaN or inf on some rank; raised on every rank at the same step."""


class ReplicaMismatchError(RuntimeError):
    """Something that must be identical on every rank is not; raised on every rank at the same step."""


def replica_check_interval(environ: Mapping[str, str] | None = None) -> int:
    """``QACCEL_CHECK_REPLICAS``: check every N optimizer steps (unset or 0: never).

    Raises:
        ValueError: a value that is not an integer >= 0, naming the variable.
    """
    text = (os.environ if environ is None else environ).get(ENV_CHECK_REPLICAS, "").strip()
    if not text:
        return 0
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{ENV_CHECK_REPLICAS}={text!r}: must be an integer >= 0 (check every N optimizer steps; 0 or unset: never)")
    return value


def tensor_digest(tensor: torch.Tensor) -> int:
    """SHA-256 of the tensor's bytes as a signed 64-bit integer: equal iff bit-identical (up to 2^-64)."""
    # A copy: numpy sharing a CPU tensor's storage would make it non-resizable, and FSDP2 frees the
    # unsharded parameters by resizing their storage to 0 after the forward.
    data = tensor.detach().reshape(-1).view(torch.uint8).to("cpu", copy=True).numpy()
    return int.from_bytes(hashlib.sha256(data.tobytes()).digest()[:8], "little", signed=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (an FSDP2 shard), else the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor


def _world(group: Any) -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _first_nonfinite(tensors: list[torch.Tensor]) -> int:
    """Index of the first tensor holding NaN or inf, or -1 (one host sync for the whole list)."""
    live = [(i, t) for i, t in enumerate(tensors) if t.numel()]
    if not live:
        return -1
    # The max-abs norm is inf or NaN iff some element is; unlike the 2-norm it cannot overflow.
    norms = torch.stack([n.float() for n in foreach_norm([t for _, t in live], float("inf"))])
    bad = (~torch.isfinite(norms)).nonzero()
    return live[int(bad[0])][0] if bad.numel() else -1


class NonFiniteGuard:
    """Checks gradients and weights before each optimizer step; see the module docstring.

    Args:
        model: the prepared model (DDP-wrapped or FSDP2-sharded); its named parameters are checked.
        scaler: the run's loss scaler (``accelerator.scaler``), or None.
        group: the process group the ranks agree over (default: the world).
    """

    def __init__(self, model: nn.Module, *, scaler: Any = None, group: Any = None) -> None:
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        self.names = [name for name, _ in named]
        self.params = [p for _, p in named]
        self.scaler = scaler
        self.group = group

    def check(self, step: int) -> bool:
        """Run before ``optimizer.step()``; returns True when the scaler will skip this step on every rank.

        Raises:
            NonFiniteError: on every rank, when some rank holds a non-finite weight, or a non-finite
                gradient and there is no scaler.
        """
        grads = [_local(p.grad) if p.grad is not None else p.new_empty(0) for p in self.params]
        weights = [_local(p.detach()) for p in self.params]
        n = len(self.params)
        code = 0
        bad_weight = _first_nonfinite(weights)
        if bad_weight >= 0:
            code = 1 + n + bad_weight  # a weight outranks a gradient: no scaler repairs it
        else:
            bad_grad = _first_nonfinite(grads)
            code = 1 + bad_grad if bad_grad >= 0 else 0
        rank, world_size = _world(self.group)
        device = self.params[0].device if self.params else torch.device("cpu")
        codes = torch.zeros(world_size, dtype=torch.int64, device=device)
        codes[rank] = code
        if world_size > 1:
            dist.all_reduce(codes, group=self.group)  # each rank fills its own slot: a sum is a gather
        found = {r: int(c) for r, c in enumerate(codes.tolist()) if c}
        if not found:
            return False
        weights_bad = {r: c for r, c in found.items() if c > n}
        if self.scaler is not None and not weights_bad:
            if code == 0:
                # Another rank overflowed: make this rank's scaler see it too, so every rank skips.
                first = next((g for g in grads if g.numel()), None)
                if first is not None:
                    first.view(-1)[0] = float("inf")
            return True
        ranks = sorted(weights_bad or found)
        first_rank = ranks[0]
        first_code = found[first_rank]
        kind, index = ("weight", first_code - 1 - n) if first_code > n else ("gradient", first_code - 1)
        raise NonFiniteError(
            f"step {step}: non-finite {kind} on rank(s) {ranks} of {world_size}, first {self.names[index]!r} "
            f"(rank {first_rank}); stopped before the optimizer applies it. Lower the learning rate, enable "
            "gradient clipping or fp16 loss scaling, check the data, or pass --allow_nonfinite to train on"
        )


class ReplicaGuard:
    """Every ``interval`` steps, all-gathers digests of what must agree across ranks; see the module docstring.

    Args:
        model: the prepared model.
        optimizer: the prepared optimizer (for the 1-bit optimizers' schedule), or None.
        interval: check every this many optimizer steps (0: never; then nothing is hooked).
        first_step: the first optimizer step this run will take (``resumed step + 1``).
        group: the process group (default: the world).
    """

    def __init__(self, model: nn.Module, optimizer: Any, interval: int, *, first_step: int = 1, group: Any = None) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.interval = interval
        self.group = group
        self.model = model
        inner = getattr(optimizer, "optimizer", optimizer)
        self.schedule = getattr(inner, "schedule", None)  # 0/1 Adam / 1-bit Adam only
        self.units = [(name or "<root>", m) for name, m in model.named_modules() if isinstance(m, FSDPModule)]
        self._gathered: dict[str, int] = {}
        self._capturing = False
        self._pending = False  # a check fell due on a step whose replicas were not synced
        self._hooks = []
        if interval and self.units:
            for name, module in self.units:
                self._hooks.append(module.register_forward_pre_hook(self._make_hook(name)))
        self._arm(first_step)

    def _make_hook(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            if self._capturing and name not in self._gathered:
                tensors = [p for p in module.parameters() if not hasattr(p, "to_local")]  # nested units: still sharded
                self._gathered[name] = _combine(tensor_digest(t) for t in tensors)

        return hook

    def _arm(self, step: int) -> None:
        self._capturing = bool(self.interval and self.units and step % self.interval == 0)
        self._gathered = {}

    def _local_digests(self) -> tuple[list[str], list[int]]:
        if self.units:
            names = [name for name, _ in self.units]
            return names, [self._gathered.get(name, 0) for name in names]
        named = [(name, p) for name, p in self.model.named_parameters()]
        return [name for name, _ in named], [tensor_digest(_local(p)) for _, p in named]

    def after_step(self, step: int) -> None:
        """Run after optimizer step ``step`` on every rank; checks when due and arms the next capture.

        Raises:
            ReplicaMismatchError: on every rank, naming the step, the differing ranks and the first item.
        """
        if not self.interval:
            return
        due = self._pending or step % self.interval == 0
        synced = self.units or self.schedule is None or self.schedule.steps_since_sync == 0
        if due and not synced:
            self._pending = True
        elif due:
            self._pending = False
            self._compare(step)
        self._arm(step + 1)

    def _compare(self, step: int) -> None:
        names, digests = self._local_digests()
        rank, world_size = _world(self.group)
        if world_size == 1:
            return
        mine = torch.tensor(digests, dtype=torch.int64)
        device = next(self.model.parameters()).device
        rows = torch.empty(world_size * mine.numel(), dtype=torch.int64, device=device)
        all_gather_single(rows, mine.to(device), self.group)
        rows = rows.view(world_size, -1).cpu()
        differ = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
        if differ:
            column = int((rows[differ[0]] != rows[0]).nonzero()[0])
            what = "gathered weights of FSDP unit" if self.units else "parameter"
            raise ReplicaMismatchError(
                f"step {step}: ranks {differ} of {world_size} differ from rank 0 in the {what} {names[column]!r} "
                f"({ENV_CHECK_REPLICAS} check, raised on rank {rank})"
            )

    def remove(self) -> None:
        """Detach the forward hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []


def _combine(digests: Iterable[int]) -> int:
    """One signed 64-bit digest of several, order-sensitive."""
    h = hashlib.sha256()
    for d in digests:
        h.update(d.to_bytes(8, "little", signed=True))
    return int.from_bytes(h.digest()[:8], "little", signed=True)


class TrainingGuards:
    """Both guards behind the two calls the training loop makes.

    Args:
        accelerator: the run's Accelerator (its ``scaler`` decides how non-finite gradients are handled).
        model, optimizer: as prepared.
        allow_nonfinite: switch the non-finite check off.
        replica_interval: ``QACCEL_CHECK_REPLICAS`` (see :func:`replica_check_interval`).
        first_step: the first optimizer step of this run.
    """

    def __init__(
        self,
        accelerator: Any,
        model: nn.Module,
        optimizer: Any,
        *,
        allow_nonfinite: bool,
        replica_interval: int,
        first_step: int = 1,
    ) -> None:
        self.nonfinite = None if allow_nonfinite else NonFiniteGuard(model, scaler=getattr(accelerator, "scaler", None))
        self.replicas = ReplicaGuard(model, optimizer, replica_interval, first_step=first_step)

    def before_step(self, step: int) -> None:
        """After the last backward of optimizer step ``step``, before ``optimizer.step()``."""
        if self.nonfinite is not None:
            self.nonfinite.check(step)

    def after_step(self, step: int) -> None:
        """After optimizer step ``step`` completed."""
        self.replicas.after_step(step)
