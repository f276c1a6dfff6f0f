"""Checkpoint state of the 1-bit optimizers: global part, per-rank part, and the checks after a resume.

``docs/zero_one_adam.md``, "Checkpoints". ``state_dict()`` is this rank's complete state plus a ``"qaccel"`` entry with the
schedule, config and world size; under Accelerate it is written by the main process only
(``optimizer.bin``). What differs between ranks (momentum between syncs, the momentum accumulator, both
error buffers, master weights and, between 0/1 Adam syncs, the local parameters) is also returned by
``rank_state_dict()``, which every rank writes to its own file. ``stage_rank_state(payload)`` before
``load_state_dict(...)`` restores both, so a resume with the same world size is bit-exact.

On HSDP shards (``is_sharded``) no two ranks share any state, so the rank file carries everything:
``rank_state_dict()`` also holds ``state_dict()`` (``"optimizer_state"``), and ``load_rank_state(payload)``
restores the optimizer from it alone. A resume needs the same replicas x shards mesh.

After any load the next step checks, with one small all-gather, that every rank holds the same schedule,
variance and synced weights (raising if not). If a rank has no private state, or the world size changed,
all ranks instead reset: error buffers and the accumulator are zeroed and weights and momentum are
averaged in full precision, with a warning (error feedback cannot be remapped to another world size).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist

from .._torch_internals import all_gather_single
from ..comm import ring_all_gather_bytes, ring_all_reduce_bytes
from ._schedule import Phase
from ._units import Unit, local_tensor, unit_weights, write_back

__all__ = ["ResumeMixin", "RANK_STATE_KEYS"]

logger = logging.getLogger(__name__)

STATE_FORMAT = "qaccel.onebit_optimizer/1"
RANK_FORMAT = "qaccel.onebit_optimizer.rank/1"
RANK_STATE_KEYS = ("exp_avg", "momentum_accumulator", "worker_error", "server_error", "master_weights")
"""Per-unit state that may differ between ranks."""
_PHASE_CODES = {phase: float(i) for i, phase in enumerate(Phase)}


def _global_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _checksum(t: torch.Tensor) -> torch.Tensor:
    """Value sum and bit-pattern sum (float64, shape (2,)): equal tensors give equal pairs on every rank."""
    flat = t.reshape(-1).to(torch.float32)
    return torch.stack([flat.double().sum(), flat.view(torch.int32).sum(dtype=torch.int64).double()])


class ResumeMixin:
    """Mixed into :class:`qaccel.optim._base.OneBitOptimizerBase`."""

    def _init_resume_state(self) -> None:
        self._pending_resume: dict[str, Any] | None = None
        self._staged_rank_state: dict[str, Any] | None = None

    def _all_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    # ------------------------------------------------------------------------------ save
    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus ``"qaccel"``: schedule, comm plan, config and world size."""
        state = super().state_dict()
        state["qaccel"] = {
            "format": STATE_FORMAT,
            "optimizer": type(self).__name__,
            "schedule": self.schedule.state_dict(),
            "next_step_full_allreduce": self.comm_plan.full_allreduce_next,
            "config": self.config.to_dict(),
            "world_size": self.world_size(),
            "saved_by_rank": _global_rank(),
        }
        return state

    def rank_state_dict(self) -> dict[str, Any]:
        """This rank's private state, keyed by parameter index (as in ``state_dict()``)."""
        params = self._all_params()
        units = {}
        for index, p in enumerate(params):
            if p in self.state:
                private = {key: value for key, value in self.state[p].items() if key in RANK_STATE_KEYS}
                if private:
                    units[index] = private
        # Between 0/1 Adam syncs each replica has its own weights; the model file holds rank 0's only.
        local = self.schedule.steps_since_sync > 0
        payload = {
            "format": RANK_FORMAT,
            "optimizer": type(self).__name__,
            "rank": _global_rank(),
            "world_size": self.world_size(),
            "shard_ranks": self.shard_ranks(),
            "step": self.schedule.step,
            "units": {} if self.is_sharded else units,  # sharded: all of it is in "optimizer_state"
            "local_params": {index: local_tensor(p).detach() for index, p in enumerate(params)} if local else {},
        }
        if self.is_sharded:
            payload["optimizer_state"] = self.state_dict()
        return payload

    # ------------------------------------------------------------------------------ load
    def stage_rank_state(self, payload: dict[str, Any]) -> None:
        """Make the next ``load_state_dict`` also restore this rank's private state from ``payload``."""
        if payload.get("format") != RANK_FORMAT or payload.get("optimizer") != type(self).__name__:
            raise ValueError(
                f"{type(self).__name__}.stage_rank_state: payload format {payload.get('format')!r} / optimizer "
                f"{payload.get('optimizer')!r}: expected {RANK_FORMAT!r} / {type(self).__name__!r}"
            )
        self._staged_rank_state = payload

    def check_rank_state(self, payload: dict[str, Any]) -> None:
        """Raise ValueError unless ``payload`` can restore this sharded optimizer (see :meth:`load_rank_state`)."""
        name = type(self).__name__
        if "optimizer_state" not in payload:
            raise ValueError(f"{name}: the rank state holds no complete optimizer state (saved by a DDP run?)")
        saved = (payload.get("world_size"), payload.get("shard_ranks", 1))
        if saved != (self.world_size(), self.shard_ranks()):
            raise ValueError(
                f"{name}: the rank state was saved on {saved[0]} replicas x {saved[1]} shards, this run has "
                f"{self.world_size()} x {self.shard_ranks()}; sharded 1-bit optimizer state (per-shard error feedback) "
                "resumes on the same mesh only"
            )

    def load_rank_state(self, payload: dict[str, Any]) -> None:
        """Sharded optimizers: restore this rank's complete state from its ``rank_state_dict()`` payload.

        Raises:
            ValueError: the payload carries no complete state (it was saved by a DDP run), or was saved
                on another mesh (replicas x shards).
        """
        self.check_rank_state(payload)
        self.stage_rank_state(payload)
        self.load_state_dict(payload["optimizer_state"])

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a ``state_dict()`` (and a staged rank state); the live ``exp_avg_mask`` is kept."""
        name = type(self).__name__
        meta = state_dict.get("qaccel")
        if not isinstance(meta, dict) or meta.get("format") != STATE_FORMAT:
            raise ValueError(f"{name}.load_state_dict: not a qaccel optimizer state (missing 'qaccel' entry)")
        if meta["optimizer"] != name:
            raise ValueError(f"{name}.load_state_dict: the state was saved by {meta['optimizer']}")
        saved_granularity = meta["config"]["granularity"]
        if saved_granularity != self.config.granularity:
            raise ValueError(
                f"{name}.load_state_dict: saved with granularity={saved_granularity!r}, this optimizer uses "
                f"{self.config.granularity!r}; the state layouts differ"
            )
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
            len(saved["params"]) != len(group["params"]) for saved, group in zip(saved_groups, self.param_groups, strict=True)
        ):
            raise ValueError(f"{name}.load_state_dict: param groups do not match the saved ones (count or sizes)")
        by_saved_id = {
            saved_id: p for saved, group in zip(saved_groups, self.param_groups, strict=True) for saved_id, p in zip(saved["params"], group["params"], strict=True)
        }
        state: defaultdict[torch.Tensor, dict] = defaultdict(dict)
        for saved_id, values in state_dict["state"].items():
            p = by_saved_id[saved_id]
            # keep fp32 state fp32 (torch's loader would cast it to the parameter dtype)
            state[p] = {k: v.to(device=p.device) if isinstance(v, torch.Tensor) else v for k, v in values.items()}
        for saved, group in zip(saved_groups, self.param_groups, strict=True):
            group.update({k: v for k, v in saved.items() if k not in ("params", "exp_avg_mask")})
        self.state = state
        self.schedule.load_state_dict(meta["schedule"])
        if self.comm_plan.full_allreduce_next != meta["next_step_full_allreduce"]:
            raise RuntimeError(f"{name}.load_state_dict: the saved comm plan disagrees with the saved schedule")
        self._units = None
        applied = self._apply_staged_rank_state(meta)
        self._pending_resume = None
        if self.schedule.phase is not Phase.INIT:
            self._pending_resume = {
                "world_size": int(meta["world_size"]),
                "saved_by_rank": int(meta["saved_by_rank"]),
                "rank_state_applied": applied,
            }

    def _apply_staged_rank_state(self, meta: dict[str, Any]) -> bool:
        payload, self._staged_rank_state = self._staged_rank_state, None
        if payload is None:
            return False
        if payload["world_size"] != meta["world_size"] or payload["step"] != meta["schedule"]["step"]:
            logger.warning(
                "%s: rank state of rank %s (world %s, step %s) does not match the optimizer state (world %s, step %s); "
                "ignored",
                type(self).__name__, payload["rank"], payload["world_size"], payload["step"],
                meta["world_size"], meta["schedule"]["step"],
            )  # fmt: skip
            return False
        params = self._all_params()
        with torch.no_grad():
            for index, private in payload["units"].items():
                p = params[index]
                self.state[p].update({k: v.to(device=p.device) for k, v in private.items()})
            for index, value in payload["local_params"].items():
                local_tensor(params[index]).copy_(value)
        return True

    # -------------------------------------------------------------------- first step after load
    def _finish_resume(self, units: list[Unit], world_size: int) -> None:
        pending, self._pending_resume = self._pending_resume, None
        needs_reset = pending["world_size"] != world_size or (
            world_size > 1 and not pending["rank_state_applied"] and pending["saved_by_rank"] != _global_rank()
        )
        if world_size > 1:
            # One all-gather decides for everyone (a reset is collective) and checks the replicas.
            needs_reset = self.check_replicas(units, world_size, "after loading a checkpoint", needs_reset)
        if needs_reset:
            if _global_rank() == 0:
                logger.warning(
                    "%s: resuming with world size %d from a checkpoint of world size %d or without per-rank state: "
                    "error buffers and momentum accumulators are reset, weights and momentum averaged in full precision",
                    type(self).__name__, world_size, pending["world_size"],
                )  # fmt: skip
            self._reset_replicas(units, world_size)

    def check_replicas(self, units: list[Unit], world_size: int, when: str, skip_check: bool = False) -> bool:
        """All-gather the schedule counters and checksums of v, synced weights and (at synced points) the
        weights; raise RuntimeError on every rank if any rank differs. Returns whether any rank passed
        ``skip_check`` (then nothing is compared: the caller resets instead)."""
        flag = torch.tensor([float(skip_check)], dtype=torch.float64)
        summary = torch.cat([flag, self._replica_summary(units)]).to(units[0].anchor.device)
        rows = torch.empty(world_size * summary.numel(), dtype=torch.float64, device=summary.device)
        placement = self.placement
        all_gather_single(rows, summary, placement.process_group)
        nbytes = ring_all_gather_bytes(summary.numel() * 8, world_size)
        placement.wire_meter.record(f"{placement.kind_prefix}.replica_check", sent_bytes=nbytes, recv_bytes=nbytes)
        rows = rows.view(world_size, -1)
        if bool((rows[:, 0] > 0).any()):
            return True
        disagree = [r for r in range(world_size) if not torch.equal(rows[r], rows[0])]
        if disagree:
            raise RuntimeError(
                f"{type(self).__name__}: {when}, ranks {disagree} of {world_size} hold a schedule, variance or synced "
                f"weights different from rank 0 (raised on rank {dist.get_rank()})"
            )
        return False

    def _replica_summary(self, units: list[Unit]) -> torch.Tensor:
        """float64 vector that must be equal on every rank: schedule counters and checksums."""
        numbers = [float(v) for v in self.schedule.state_dict().values() if isinstance(v, int)]
        numbers.append(_PHASE_CODES[self.schedule.phase])
        sums = []
        in_sync = self.schedule.steps_since_sync == 0
        for unit in units:
            state = self.state[unit.anchor]
            tensors = [state["exp_avg_sq"]] + ([state["synced_weights"]] if "synced_weights" in state else [])
            if in_sync:
                tensors.append(unit_weights(unit, state))
            sums.extend(_checksum(t).cpu() for t in tensors)
        return torch.cat([torch.tensor(numbers, dtype=torch.float64)] + sums)

    def _reset_replicas(self, units: list[Unit], world_size: int) -> None:
        weights = [unit_weights(unit, self.state[unit.anchor]) for unit in units]
        momenta = [self.state[unit.anchor]["exp_avg"] for unit in units]
        if world_size > 1:
            flat = torch.cat([t.reshape(-1) for t in weights + momenta])
            placement = self.placement
            dist.all_reduce(flat, group=placement.process_group)
            flat.mul_(1.0 / world_size)
            nbytes = ring_all_reduce_bytes(flat.numel() * flat.element_size(), world_size)
            placement.wire_meter.record(f"{placement.kind_prefix}.resync_all_reduce", sent_bytes=nbytes, recv_bytes=nbytes)
            offset = 0
            for t in weights + momenta:
                t.copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
        for unit, w in zip(units, weights, strict=True):
            state = self.state[unit.anchor]
            state.pop("worker_error", None)
            state.pop("server_error", None)
            self._reset_phase_state(unit, state, w)
            write_back(unit, w)

    def _reset_phase_state(self, unit: Unit, state: dict, weights: torch.Tensor) -> None:
        """Subclass hook: reset phase-specific state after replicas were averaged."""
