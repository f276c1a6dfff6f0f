"""Independent pure-torch transcription of DeepSpeed 0.19.6 ``ZeroOneAdam`` as its engine drives it (fp32).

Written for the parity tests from the DeepSpeed sources, not from qaccel:

- ``deepspeed/runtime/fp16/onebit/zoadam.py`` ``ZeroOneAdam.step``: per-parameter state, the
  initialization step that discards the gradient (and runs C(0) on the momentum accumulator), the
  error buffers popped from the last parameter of each group at initialization, per-tensor zero padding
  to a multiple of ``N * 8N/gcd(N, 8)``, the variance / local-step schedules, the freeze test on the first
  parameter's step counter, and the one-time error reset at the freeze.
- ``deepspeed/runtime/comm/nccl.py`` ``NcclBackend.compressed_allreduce``: worker and server error
  feedback, ``sign().add_(1).bool()`` signs, RMS scales over the padded length, server average
  ``sum_i (+-1) * (s_i * (1/N))``.
- ``deepspeed/runtime/engine.py``: with ``enable_backward_allreduce`` the gradients are summed over the
  ranks and multiplied by ``1/N`` (``allreduce_bucket``, post-scaling); otherwise each rank keeps its own.

All N ranks are simulated in one process in lockstep, parameter by parameter, which is equivalent
because DeepSpeed's per-parameter work only couples ranks through the compressed all-reduce. DeepSpeed's
``p - u`` undo of the local steps is kept; ``restart_from_synced=True`` switches to qaccel's one deliberate
numeric deviation (restart each sync from stored synced weights, which keeps replicas bit-identical), so
that a test can show that nothing else differs.

``flat=True`` treats each param group as one flat fp32 tensor, as DeepSpeed's ``FP16_Optimizer`` hands
the optimizer one flat master tensor per group (the layout behind qaccel's ``granularity="group"``).
"""

from __future__ import annotations

import math

import numpy as np
import torch


def ds_sign(x: torch.Tensor) -> torch.Tensor:
    """DeepSpeed's +-1 of ``x``: ``x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)``."""
    return x.sign().add_(1).bool().float().add_(-0.5).mul_(2.0)


def simulated_compressed_allreduce(buffers, worker_errors, server_errors):
    """DeepSpeed's 1-bit all-reduce for N ranks at once; returns the (common) output, updates errors in place."""
    n = len(buffers)
    shape = buffers[0].shape
    original_size = buffers[0].numel()
    padded = worker_errors[0].numel()
    signs, scales = [], []
    for i in range(n):
        buf = buffers[i].reshape(-1).float()
        if padded != original_size:
            buf = torch.cat([buf, torch.zeros(padded - original_size)])
        buf = buf + worker_errors[i]
        scale = torch.norm(buf) / np.sqrt(buf.numel())
        sign = ds_sign(buf)
        worker_errors[i].copy_(buf - scale * sign)
        signs.append(sign)
        scales.append(scale.reshape(1))
    chunk = padded // n
    stacked_scales = torch.stack(scales).mul_(1 / n)  # (n, 1)
    server_signs, server_scales = [], []
    for j in range(n):
        received = torch.stack([signs[i][j * chunk : (j + 1) * chunk] for i in range(n)])  # (n, chunk)
        compensated = received.mul_(stacked_scales).sum(0)
        compensated.add_(server_errors[j])
        server_scale = torch.norm(compensated) / np.sqrt(compensated.numel())
        server_sign = ds_sign(compensated)
        server_errors[j].copy_(compensated - server_scale * server_sign)
        server_signs.append(server_sign)
        server_scales.append(server_scale)
    out = torch.cat([server_signs[j] * server_scales[j] for j in range(n)])
    return out[:original_size].reshape(shape)


class DeepSpeedZeroOneAdamPort:
    """N simulated ranks of DeepSpeed ZeroOneAdam + engine, fp32, no clipping.

    Args:
        params: ``params[i][g]`` is the list of rank ``i``'s tensors of param group ``g`` (updated in place).
        lr, betas, eps: hyperparameters (one set for all groups).
        weight_decay: one value per param group.
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper: F, kappa, alpha, H.
        masks: optional ``{group: mask}`` (``exp_avg_mask``, broadcast like DeepSpeed's ``mul_``).
        restart_from_synced: replace DeepSpeed's ``p - u`` at a sync by the weights of the previous sync.
    """

    def __init__(self, params, *, lr, betas, eps, weight_decay, var_freeze_step, var_update_scaler,
                 local_step_scaler, local_step_clipper, masks=None, restart_from_synced=False):  # fmt: skip
        self.restart_from_synced = restart_from_synced
        self.params = params
        self.size = len(params)
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.var_freeze_step = var_freeze_step
        self.var_update_scaler = var_update_scaler
        self.local_step_scaler = local_step_scaler
        self.local_step_clipper = local_step_clipper
        self.masks = masks or {}
        self.divider = int(self.size * 8 / np.gcd(self.size, 8))
        self.initialize = False
        self.freeze_key = False
        self.reinitial_error_buffer = False
        self.enable_backward_allreduce = True  # the engine's flag, True until the optimizer turns it off
        self.state = [[[{} for _ in group] for group in rank_params] for rank_params in params]

    def engine_grads(self, local_grads, allreduced=None):
        """What the optimizer sees: the averaged gradient when the engine all-reduced, else the local one.

        ``allreduced`` (``[g][k]``) replaces the simulated all-reduce by a real one's result: a 4-rank
        all-reduce may sum in another order than the simulation, which is not the optimizer's business.
        """
        if not self.enable_backward_allreduce:
            return local_grads
        if allreduced is not None:
            return [allreduced for _ in range(self.size)]
        averaged = []
        for g, group in enumerate(local_grads[0]):
            per_param = []
            for k in range(len(group)):
                total = local_grads[0][g][k].clone()
                for i in range(1, self.size):
                    total = total + local_grads[i][g][k]
                per_param.append(total.mul_(1.0 / self.size))
            averaged.append(per_param)
        return [averaged for _ in range(self.size)]

    def _compress(self, tensors, g, k, mask):
        states = [self.state[i][g][k] for i in range(self.size)]
        out = simulated_compressed_allreduce(
            tensors, [s["worker_error"] for s in states], [s["server_error"] for s in states]
        )
        if mask is not None:
            out = out * mask
        return out

    @property
    def next_step_allreduces(self) -> bool:
        return self.enable_backward_allreduce

    def step(self, local_grads, allreduced=None):
        """One optimizer step; ``local_grads[i][g][k]`` is rank ``i``'s gradient of param ``k`` of group ``g``."""
        grads = self.engine_grads(local_grads, allreduced)
        n = self.size
        beta1, beta2 = self.betas
        lr, eps = self.lr, self.eps
        for g in range(len(self.params[0])):
            mask = self.masks.get(g)
            wd = self.weight_decay[g]
            for k in range(len(self.params[0][g])):
                states = [self.state[i][g][k] for i in range(n)]
                ps = [self.params[i][g][k] for i in range(n)]
                for i in range(n):
                    state, p = states[i], ps[i]
                    if len(state) == 0:
                        state["step"] = 0
                        state["exp_avg"] = torch.zeros_like(p)
                        state["exp_avg_sq"] = torch.zeros_like(p)
                    if not self.initialize or "worker_error" not in state:
                        state["var_interval"] = 1
                        state["var_counter"] = 0
                        state["local_step_interval"] = 1
                        state["local_step_counter"] = 0
                        state["lrs"] = 0
                        size = p.numel()
                        corrected = size
                        if size % (n * self.divider) != 0:
                            corrected += (n * self.divider) - (size % (n * self.divider))
                        state["worker_error"] = torch.zeros(corrected)
                        state["server_error"] = torch.zeros(corrected // n)
                        state["momentum_accumulator"] = torch.zeros_like(p)
                    state["step"] += 1
                if self.initialize:
                    if not self.freeze_key:
                        if states[0]["step"] % states[0]["var_interval"] == 0:
                            for i in range(n):
                                states[i]["exp_avg_sq"].mul_(beta2).addcmul_(grads[i][g][k], grads[i][g][k], value=1 - beta2)
                                states[i]["exp_avg"].mul_(beta1).add_(grads[i][g][k], alpha=1 - beta1)
                        elif n > 1:
                            onebit = self._compress([grads[i][g][k] for i in range(n)], g, k, mask)
                            for i in range(n):
                                states[i]["exp_avg"].mul_(beta1).add_(onebit, alpha=1 - beta1)
                    else:
                        for i in range(n):
                            states[i]["exp_avg"].mul_(beta1).add_(grads[i][g][k], alpha=1 - beta1)
                            states[i]["lrs"] += lr
                if not self.initialize and n > 1:
                    zeros = self._compress([s["momentum_accumulator"] for s in states], g, k, mask)
                    for i in range(n):
                        states[i]["momentum_accumulator"].copy_(zeros)
                if self.initialize:
                    for i in range(n):
                        state, p = states[i], ps[i]
                        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + eps)
                        if wd > 0.0:
                            update += wd * p
                        p.add_(-lr * update)
                        if self.freeze_key:
                            state["momentum_accumulator"].add_(-lr * update)
                    if states[0]["step"] % states[0]["local_step_interval"] == 0 and self.freeze_key:
                        for i in range(n):
                            state = states[i]
                            if self.restart_from_synced:
                                ps[i].copy_(state.setdefault("synced", state["frozen_at"]))
                            else:
                                ps[i].add_(-1 * state["momentum_accumulator"])
                            state["momentum_accumulator"].mul_(state["exp_avg_sq"].sqrt() + eps)
                        if n > 1:
                            synced = self._compress([s["momentum_accumulator"] for s in states], g, k, mask)
                            for i in range(n):
                                states[i]["momentum_accumulator"].copy_(synced)
                        for i in range(n):
                            state = states[i]
                            buffer = state["momentum_accumulator"]
                            state["exp_avg"].zero_().add_(buffer / state["lrs"], alpha=-1)
                            ps[i].add_(buffer / (state["exp_avg_sq"].sqrt() + eps))
                            buffer.zero_()
                            state["lrs"] = 0
                            state["synced"] = ps[i].detach().clone()
                    for i in range(n):
                        state = states[i]
                        if not self.freeze_key:
                            if state["step"] % state["var_interval"] == 0:
                                state["var_counter"] += 1
                                if state["var_counter"] == self.var_update_scaler:
                                    state["var_counter"] = 0
                                    state["var_interval"] *= 2
                            self.enable_backward_allreduce = (state["step"] + 1) % state["var_interval"] == 0
                        else:
                            state["local_step_counter"] += 1
                            if state["local_step_counter"] == self.local_step_scaler:
                                state["local_step_counter"] = 0
                                state["local_step_interval"] = min(self.local_step_clipper, state["local_step_interval"] * 2)
            if not self.initialize:
                # DeepSpeed pops the error buffers of the loop's last parameter (``state`` leaks out of the loop)
                self.freeze_key = False
                for i in range(n):
                    self.state[i][g][-1].pop("worker_error")
                    self.state[i][g][-1].pop("server_error")
        if not self.initialize:
            self.initialize = True
            return
        if self.state[0][0][0]["step"] > self.var_freeze_step:
            if not self.freeze_key:  # the weights every replica shares when the local steps begin
                for i in range(n):
                    for group_state, group_params in zip(self.state[i], self.params[i], strict=True):
                        for state, p in zip(group_state, group_params, strict=True):
                            state["frozen_at"] = p.detach().clone()
            self.freeze_key = True
            self.enable_backward_allreduce = False
        if self.freeze_key and not self.reinitial_error_buffer:
            for i in range(n):
                for group in self.state[i]:
                    for state in group:
                        state["worker_error"].zero_()
                        state["server_error"].zero_()
            self.reinitial_error_buffer = True


def padded_size(numel: int, world_size: int) -> int:
    """DeepSpeed's ``corrected_tensor_size``."""
    multiple = world_size * (8 * world_size // math.gcd(world_size, 8))
    return numel if numel % multiple == 0 else numel + multiple - numel % multiple


# --------------------------------------------------------------------------------------------------
# Harness shared by the 0/1 Adam tests: a tiny model with a partly unused table, and per-rank data.

USED_ROWS = 6  # rows 6..9 of the table never receive a gradient (what exp_avg_mask is for)


class TinyNet(torch.nn.Module):
    """A 10x4 lookup table (only rows < 6 used) feeding a 2-layer MLP; tensor sizes 40, 120, 12, 36, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(0.5 * torch.randn(10, 4))
        self.fc1 = torch.nn.Linear(10, 12)
        self.fc2 = torch.nn.Linear(12, 3)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.tanh(self.fc1(torch.cat([self.table[idx], x], dim=-1)))
        return self.fc2(hidden)


def make_net(seed: int = 0, dtype: torch.dtype = torch.float32) -> TinyNet:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return TinyNet().to(dtype)


def batch(step: int, rank: int, size: int = 16):
    """Rank ``rank``'s batch of optimizer step ``step`` (deterministic, different per rank)."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    # every used row in every batch: a row first seen after the variance froze would divide by eps
    idx = (torch.arange(size) + torch.randint(0, USED_ROWS, (1,), generator=gen)) % USED_ROWS
    x = torch.randn(size, 6, generator=gen)
    y = torch.stack([torch.sin(x[:, 0] + idx), x[:, 1] * x[:, 2], torch.cos(x[:, 3] - x[:, 4])], dim=-1)
    return idx, x, y


def loss_of(model, data) -> torch.Tensor:
    idx, x, y = data
    out = model(idx, x.to(next(model.parameters()).dtype))
    return ((out.float() - y) ** 2).mean()


def table_mask() -> torch.Tensor:
    mask = torch.zeros(10, 4)
    mask[:USED_ROWS] = 1.0
    return mask


def grouped_params(net: TinyNet) -> list[list[torch.Tensor]]:
    """Param groups used by the tests: matrices (decayed), biases, the masked table."""
    return [[net.fc1.weight, net.fc2.weight], [net.fc1.bias, net.fc2.bias], [net.table]]


def param_group_dicts(net: TinyNet, weight_decay: float, mask: bool) -> list[dict]:
    weights, biases, table = grouped_params(net)
    table_group = {"params": table, "weight_decay": 0.0}
    if mask:
        table_group["exp_avg_mask"] = table_mask()
    return [{"params": weights, "weight_decay": weight_decay}, {"params": biases, "weight_decay": 0.0}, table_group]


def run_port(
    world_size: int, steps: int, hyper: dict, *, flat: bool, mask: bool, allreduced_grads=None,
    restart_from_synced: bool = False,
) -> list[list[list[torch.Tensor]]]:
    """Simulate ``world_size`` DeepSpeed ranks; returns ``[step][rank]`` -> parameters in module order.

    ``allreduced_grads[step - 1]``, if given and not None, is the real all-reduced gradient of every
    parameter (module order) on steps where the engine all-reduces.
    """
    nets = [make_net() for _ in range(world_size)]
    groups = [grouped_params(net) for net in nets]
    if flat:
        port_params = [[torch.cat([p.detach().reshape(-1) for p in group]) for group in rank] for rank in groups]
        port_params = [[[flat_group] for flat_group in rank] for rank in port_params]
    else:
        port_params = groups
    port = DeepSpeedZeroOneAdamPort(
        port_params,
        lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"],
        weight_decay=[hyper["weight_decay"], 0.0, 0.0],
        var_freeze_step=hyper["var_freeze_step"], var_update_scaler=hyper["var_update_scaler"],
        local_step_scaler=hyper["local_step_scaler"], local_step_clipper=hyper["local_step_clipper"],
        masks={2: table_mask().reshape(-1) if flat else table_mask()} if mask else None,
        restart_from_synced=restart_from_synced,
    )  # fmt: skip
    trajectory = []
    for step in range(1, steps + 1):
        local_grads = []
        for rank, net in enumerate(nets):
            net.zero_grad(set_to_none=True)
            loss_of(net, batch(step, rank)).backward()
            grads = [[p.grad.detach().clone() for p in group] for group in groups[rank]]
            if flat:
                grads = [[torch.cat([g.reshape(-1) for g in group])] for group in grads]
            local_grads.append(grads)
        allreduced = None
        if allreduced_grads is not None and allreduced_grads[step - 1] is not None and port.next_step_allreduces:
            by_param = dict(zip((id(p) for p in nets[0].parameters()), allreduced_grads[step - 1], strict=True))
            allreduced = [[by_param[id(p)] for p in group] for group in groups[0]]
            if flat:
                allreduced = [[torch.cat([g.reshape(-1) for g in group])] for group in allreduced]
        with torch.no_grad():
            port.step(local_grads, allreduced)
            if flat:
                for rank in range(world_size):
                    for group, (flat_group,) in zip(groups[rank], port_params[rank], strict=True):
                        offset = 0
                        for p in group:
                            p.copy_(flat_group[offset : offset + p.numel()].view(p.shape))
                            offset += p.numel()
        trajectory.append([[p.detach().clone() for p in net.parameters()] for net in nets])
    return trajectory
