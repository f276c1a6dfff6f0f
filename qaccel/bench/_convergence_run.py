"""One rank's share of the convergence study: train a (task, method) for several seeds, in one process.

The ranks are started once for the whole study (``run_on_cpu_ranks``); model, optimizer and comms
are rebuilt per seed, so the seeds of a method cost no process start. The set-up follows
``scripts/train.py`` (the same ``plan_method``/``build_optimizer``, the same scheduler and
sharding), without Accelerate's singleton state, which cannot be rebuilt inside one process:

- FSDP2 methods: ``fully_shard`` on every transformer block, then the root (Accelerate's
  transformer-based wrap), and ``install_qsdp`` (both paths off for the baseline, whose comms then
  forward FSDP2's own collectives unchanged and only count them).
- DDP methods: ``DistributedDataParallel`` with the metered stock all-reduce (AdamW) or the 1-bit
  optimizers' own comm hook.

The seed sets the data order, the dropout and masked-LM masks, and QSDP's rounding noise; the model
initialisation is the recipe's (the same for every seed and method), and the eval set and its masks
are fixed, so the methods are compared on identical terms seed by seed.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ._convergence_tasks import Method, task_by_name

__all__ = ["train_seeds"]

_EVAL_MASK_SEED = 12345  # masked-LM eval masks: one fixed draw for every run
_DATA: dict[str, Any] = {}  # task -> (recipe, tokenizer, data), loaded once per process


def _task_data(task_name: str, rank: int) -> tuple[Any, Any, Any]:
    """Recipe, tokenizer and splits; rank 0 builds the caches first, the others then read them."""
    if task_name not in _DATA:
        from ..zoo import load_data, load_recipe, load_tokenizer

        recipe = load_recipe(task_name)
        seq_len = task_by_name(task_name).seq_len
        if seq_len is not None:  # a shorter sequence than the recipe's: cheaper steps, same data
            recipe = dataclasses.replace(recipe, dataset=dataclasses.replace(recipe.dataset, seq_len=seq_len))
        for turn in (0, 1):
            if (rank == 0) == (turn == 0):
                tokenizer = load_tokenizer(recipe)
                data = load_data(recipe, tokenizer)
            dist.barrier()
        _DATA[task_name] = (recipe, tokenizer, data)
    return _DATA[task_name]


def _plan(recipe: Any, method: Method, seed: int) -> Any:
    from ..training import plan_method

    onebit_section = recipe.method.onebit_adam if method.train_method == "onebit_adam" else recipe.method.zero_one_adam
    return plan_method(
        method.train_method,
        recipe_method=recipe.method.name,
        recipe_qsdp=recipe.method.qsdp if recipe.method.name == "qsdp" else {},
        flag_qsdp={**method.qsdp, "seed": seed} if recipe.method.name == "qsdp" else {},
        recipe_onebit=onebit_section if method.train_method in ("zero_one_adam", "onebit_adam") else {},
        flag_onebit={},
        learning_rate=recipe.training.learning_rate,
        weight_decay=recipe.training.weight_decay,
    )


def _wrap(model: torch.nn.Module, plan: Any, make_optimizer: Any, layer_cls: str, meter: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """Shard (FSDP2 + QSDP comms) or replicate (DDP + the method's comm hook) ``model``; build its optimizer.

    Under FSDP2 the optimizer is built after ``fully_shard``, which replaces the parameters by
    sharded ones (Accelerate's ``prepare`` does the same re-pointing).
    """
    if plan.parallelism == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        from ..fsdp import install_qsdp

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for module in model.modules():
            if type(module).__name__ == layer_cls:
                fully_shard(module, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = make_optimizer(model)
        install_qsdp(model, plan.qsdp, optimizers=[optimizer], meter=meter)
        return model, optimizer
    from torch.nn.parallel import DistributedDataParallel

    from ..comm import metered_allreduce_hook
    from ..optim import register_ddp_comm_hook

    optimizer = make_optimizer(model)
    ddp = DistributedDataParallel(model)
    if plan.onebit is None:
        ddp.register_comm_hook(None, metered_allreduce_hook(meter))
    else:
        register_ddp_comm_hook(ddp, optimizer, wire_meter=meter)
    return ddp, optimizer


def _batches(num_examples: int, batch: int, rank: int, world: int, seed: int, steps: int):
    """Per step, this rank's example indices: a seeded permutation per epoch, cut into global batches."""
    per_epoch = num_examples // (batch * world)
    step = 0
    epoch = 0
    while True:
        order = torch.randperm(num_examples, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        for i in range(per_epoch):
            if step == steps:
                return
            start = (i * world + rank) * batch
            yield order[start : start + batch]
            step += 1
        epoch += 1


@torch.no_grad()
def _evaluate(model: torch.nn.Module, data: Any, task: str, eval_batches: list[dict]) -> dict[str, float]:
    """Mean eval loss (per token, or per example for classification) and accuracy, summed over ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, count, correct
    for batch in eval_batches:
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits.float()
        labels = batch["labels"]
        if task == "sequence-classification":
            totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
            totals[1] += labels.numel()
            totals[2] += (logits.argmax(dim=-1) == labels).sum()
            continue
        if task == "causal-lm":
            logits, labels = logits[:, :-1], labels[:, 1:]
        totals[0] += F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum").double()
        totals[1] += (labels != -100).sum()
    dist.all_reduce(totals)
    model.train()
    result = {"eval_loss": float(totals[0] / totals[1])}
    if task == "sequence-classification":
        result["eval_accuracy"] = float(totals[2] / totals[1])
    return result


def _eval_batches(data: Any, task_examples: int, batch: int, rank: int, world: int) -> list[dict]:
    """This rank's fixed share of the first ``task_examples`` eval examples, collated once."""
    from ..training import BatchSeededCollator

    collate = BatchSeededCollator(data.collator, _EVAL_MASK_SEED)
    count = min(task_examples, len(data.eval)) // (batch * world) * (batch * world)
    if count == 0:
        raise ValueError(f"eval split has {len(data.eval)} examples: fewer than one batch of {batch} per rank")
    share = count // world
    indices = list(range(rank * share, (rank + 1) * share))
    return [collate([data.eval[j] for j in indices[i : i + batch]]) for i in range(0, share, batch)]


def _one_run(rank: int, world: int, task_name: str, method: Method, seed: int, steps: int, eval_every: int, batch: int, eval_examples: int) -> dict:
    from transformers import get_scheduler

    from ..comm import WireMeter
    from ..training import BatchSeededCollator, build_optimizer
    from ..zoo import load_model

    recipe, tokenizer, data = _task_data(task_name, rank)
    plan = _plan(recipe, method, seed)
    model = load_model(recipe, tokenizer)  # the recipe's seeded initialisation: identical on every rank and seed
    torch.manual_seed(seed)  # dropout
    meter = WireMeter()

    def make_optimizer(module: torch.nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(plan, module, learning_rate=recipe.training.learning_rate, weight_decay=recipe.training.weight_decay)

    model, optimizer = _wrap(model, plan, make_optimizer, recipe.model.transformer_layer_cls, meter)
    warmup = min(recipe.training.warmup_steps, steps // 3)  # the recipe's warm-up, unless it would fill the run
    scheduler = get_scheduler(recipe.training.lr_scheduler, optimizer=optimizer, num_warmup_steps=warmup, num_training_steps=steps)
    collate = BatchSeededCollator(data.collator, seed)  # masked-LM masks drawn per batch from (seed, content)
    eval_batches = _eval_batches(data, eval_examples, batch, rank, world)
    meter.end_step()
    model.train()
    losses: list[float] = []
    sent = 0
    curve = [{"step": 0, **_evaluate(model, data, recipe.task, eval_batches)}]  # the untrained model
    meter.end_step()
    started = time.perf_counter()
    for step, indices in enumerate(_batches(len(data.train), batch, rank, world, seed, steps), start=1):
        loss = model(**collate([data.train[j] for j in indices])).loss
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        sent += _sent(meter.end_step())  # this step's training traffic (the loss reduction below is not counted)
        mean_loss = loss.detach().double().reshape(1)
        dist.all_reduce(mean_loss)
        losses.append(float(mean_loss) / world)
        if step % eval_every == 0 or step == steps:
            curve.append({"step": step, **_evaluate(model, data, recipe.task, eval_batches)})
            meter.end_step()  # eval all-gathers (FSDP2) are not training traffic
    return {
        "seed": seed,
        "train_loss": losses,
        "eval": curve,
        "seconds": time.perf_counter() - started,
        "sent_bytes": sent,
        "config": dataclasses.asdict(plan.qsdp) if plan.qsdp is not None else plan.onebit.to_dict() if plan.onebit is not None else {},
    }


def _sent(tallies: dict) -> int:
    return sum(t.sent_bytes for t in tallies.values())


def train_seeds(
    rank: int, world: int, task_name: str, method: Method, seeds: list[int], steps: int, eval_every: int, eval_examples: int | None = None
) -> dict:
    """Train ``method`` on ``task_name`` once per seed on this rank; returns per-seed curves (identical on every rank).

    ``eval_examples`` defaults to the task's.
    """
    import transformers

    transformers.logging.set_verbosity_error()  # one load report per pretrained run would flood stderr
    task = task_by_name(task_name)
    runs = []
    for seed in seeds:
        runs.append(_one_run(rank, world, task_name, method, seed, steps, eval_every, task.per_device_batch_size, eval_examples or task.eval_examples))
        if rank == 0:  # progress on stderr: a full study takes tens of minutes
            last = runs[-1]
            print(f"bench convergence: {task_name} {method.key} seed {seed}: eval loss {last['eval'][-1]['eval_loss']:.4f} "
                  f"after {steps} steps ({last['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    return {"task": task_name, "method": method.key, "runs": runs}
