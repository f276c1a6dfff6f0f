"""Train or fine-tune a qaccel recipe with quantized communication (QSDP or 0/1 Adam).

A recipe (``qaccel recipes`` lists them) names the model, tokenizer, data, hyperparameters and
method; flags override it. The method decides the parallelism: QSDP runs on FSDP2, 0/1 Adam and
1-bit Adam on DDP, ``none`` runs the recipe's parallelism uncompressed (the baseline).

    # 2 CPU processes (no GPU needed)
    accelerate launch --config_file launch_configs/cpu_2proc_qsdp.yaml scripts/train.py --recipe gpt2-tiny --output_dir runs/gpt2-tiny
    accelerate launch --config_file launch_configs/cpu_2proc_ddp.yaml scripts/train.py --recipe bert-tiny --output_dir runs/bert-tiny
    torchrun --nproc_per_node 2 scripts/train.py --recipe minilm-finetune --output_dir runs/minilm
    qaccel train --recipe gpt2-tiny --output_dir runs/gpt2-tiny          # same job, the recipe's launch config

    # one node with 8 GPUs
    accelerate launch --config_file launch_configs/gpu_1node_8_qsdp.yaml scripts/train.py --recipe gpt2-124m --output_dir runs/gpt2-124m

Writes ``OUTPUT_DIR/metrics.jsonl`` (one line per optimizer step: loss, learning rate, bytes this
rank sent, step time; eval results on eval steps), ``OUTPUT_DIR/checkpoint-STEP/`` every
``--save_steps`` and at the end, and tensorboard logs with ``--report_to tensorboard``.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import fields
from pathlib import Path

import torch
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from qaccel.fsdp import QSDPConfig
from qaccel.hub.run_state import build_run_state, check_resume, read_run_state, save_checkpoint_metadata
from qaccel.optim.config import OneBitAdamConfig, ZeroOneAdamConfig
from qaccel.training import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    METHODS,
    BatchSeededCollator,
    FaultReporter,
    MetricsLog,
    TrainingGuards,
    build_accelerator,
    build_optimizer,
    evaluate_model,
    meter_stock_ddp,
    plan_method,
    replica_check_interval,
    resolve_resume,
    save_checkpoint,
    verify_checkpoint,
)
from qaccel.zoo import load_accuracy_metric, load_data, load_model, load_recipe, load_tokenizer

QSDP_FIELDS = [f.name for f in fields(QSDPConfig)]
ZOADAM_FIELDS = sorted({f.name for f in fields(ZeroOneAdamConfig)} | {f.name for f in fields(OneBitAdamConfig)})
TRAINING_FLAGS = (
    "max_steps", "per_device_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
    "warmup_steps", "lr_scheduler", "seed", "save_steps", "eval_steps", "mixed_precision",
)  # fmt: skip


def parse_value(text: str) -> int | float | bool | str | None:
    """A ``--qsdp_*`` / ``--zoadam_*`` value: int, float, bool, ``none``, or the string itself."""
    lowered = text.strip().lower()
    if lowered in ("none", "null"):
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="a recipe name (`qaccel recipes`) or a recipe file")
    parser.add_argument("--model_name_or_path", help="pretrained model: a local folder or a Hub id (overrides the recipe)")
    parser.add_argument("--method", choices=METHODS, help="communication method (default: the recipe's)")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, help="optimizer steps")
    parser.add_argument("--per_device_batch_size", type=int)
    parser.add_argument("--gradient_accumulation_steps", type=int)
    parser.add_argument("--learning_rate", type=float)
    parser.add_argument("--weight_decay", type=float)
    parser.add_argument("--warmup_steps", type=int)
    parser.add_argument("--lr_scheduler", help="a transformers scheduler name (linear, cosine, constant, ...)")
    parser.add_argument("--seed", type=int, help="model init, data order and quantization noise")
    parser.add_argument("--save_steps", type=int, help="checkpoint every N optimizer steps (0: only at the end)")
    parser.add_argument("--eval_steps", type=int, help="evaluate every N optimizer steps (0: only at the end)")
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"])
    parser.add_argument("--resume_from_checkpoint", help="a checkpoint folder, or `latest` (the newest complete one in --output_dir)")
    parser.add_argument("--report_to", default="none", help="Accelerate trackers: tensorboard, wandb, all, or none")
    parser.add_argument("--logging_steps", type=int, default=1, help="write metrics.jsonl every N optimizer steps")
    parser.add_argument("--push_to_hub", action="store_true", help="export the final checkpoint and push it to the Hub")
    parser.add_argument("--hub_model_id", help="ORG/NAME for --push_to_hub")
    parser.add_argument("--collective_timeout_s", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help="a collective waiting longer than this (a hung or lost rank) stops the run")  # fmt: skip
    parser.add_argument("--allow_nonfinite", action="store_true", help="train on through NaN/inf gradients or weights (default: stop)")
    for name in QSDP_FIELDS:
        parser.add_argument(f"--qsdp_{name}", type=parse_value, help=f"QSDPConfig.{name}")
    for name in ZOADAM_FIELDS:
        parser.add_argument(f"--zoadam_{name}", type=parse_value, help=f"ZeroOneAdam/OneBitAdam setting {name}")
    args = parser.parse_args(argv)
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id ORG/NAME")
    return args


def flag_section(args: argparse.Namespace, prefix: str, names: list[str]) -> dict:
    values = {name: getattr(args, prefix + name) for name in names}
    return {name: value for name, value in values.items() if value is not None}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    recipe = load_recipe(args.recipe)
    # Recipe values are the defaults; flags given on the command line win.
    cfg = {name: getattr(recipe.training, name) for name in TRAINING_FLAGS}
    cfg.update({name: getattr(args, name) for name in TRAINING_FLAGS if getattr(args, name) is not None})
    method = args.method or recipe.method.name
    model_source = args.model_name_or_path or recipe.model.name_or_path
    onebit_recipe = recipe.method.onebit_adam if method == "onebit_adam" else recipe.method.zero_one_adam
    plan = plan_method(
        method,
        recipe_method=recipe.method.name,
        recipe_qsdp=recipe.method.qsdp,
        flag_qsdp=flag_section(args, "qsdp_", QSDP_FIELDS),
        recipe_onebit=onebit_recipe if method in ("zero_one_adam", "onebit_adam") else {},
        flag_onebit=flag_section(args, "zoadam_", ZOADAM_FIELDS) if method in ("zero_one_adam", "onebit_adam") else {},
        learning_rate=cfg["learning_rate"],
        weight_decay=cfg["weight_decay"],
    )
    output_dir = Path(args.output_dir)
    resume_from = resolve_resume(args.resume_from_checkpoint, output_dir)
    replica_interval = replica_check_interval()  # QACCEL_CHECK_REPLICAS
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # what the Accelerator will see, known before it exists

    def run_state(step: int, wire_total: int, metrics: dict | None) -> dict:
        return build_run_state(
            method=plan.method,
            method_config=plan.config_dict(),
            recipe=recipe.name,
            task=recipe.task,
            step=step,
            world_size=world_size,
            wire_bytes_total=wire_total,
            metrics=metrics,
            base_model=model_source,
            dataset=recipe.dataset.name,
            extra={"training": cfg, "parallelism": plan.parallelism},
        )

    saved = None
    if resume_from is not None:  # a damaged checkpoint, or one of another model or method, is refused before any collective
        verify_checkpoint(resume_from)  # names a missing, truncated or altered file before anything loads
        saved = read_run_state(resume_from)
        resume_warnings = check_resume(saved, run_state(saved["step"], 0, None))

    accelerator = build_accelerator(
        plan,
        layer_cls=recipe.model.transformer_layer_cls,
        mixed_precision=cfg["mixed_precision"],
        gradient_accumulation_steps=cfg["gradient_accumulation_steps"],
        report_to=None if args.report_to == "none" else args.report_to,
        project_dir=str(output_dir),
        collective_timeout_s=args.collective_timeout_s,
    )
    faults = FaultReporter(output_dir, accelerator.process_index, accelerator.num_processes)  # a lost rank: one clear line
    set_seed(cfg["seed"])

    # Data and tokenizer are built (and cached on disk) by the main process first.
    with accelerator.main_process_first():
        tokenizer = load_tokenizer(recipe, model_source)
        data = load_data(recipe, tokenizer)
    model = load_model(recipe, tokenizer, model_source)
    # The loader gets its own generator: creating an iterator then draws its base seed from it, not
    # from the global RNG that dropout uses, so a resumed run's new iterator cannot shift dropout.
    train_loader = DataLoader(
        data.train, batch_size=cfg["per_device_batch_size"], shuffle=True, drop_last=True,
        # Masked-LM masks drawn per batch (not from the global RNG's position): exact resumes.
        collate_fn=BatchSeededCollator(data.collator, cfg["seed"]),
        generator=torch.Generator().manual_seed(cfg["seed"]),
    )  # fmt: skip
    eval_loader = DataLoader(data.eval, batch_size=cfg["per_device_batch_size"], collate_fn=data.collator)

    optimizer = build_optimizer(plan, model, learning_rate=cfg["learning_rate"], weight_decay=cfg["weight_decay"])
    # Accelerate steps a prepared scheduler once per process per optimizer step, hence the factor.
    scheduler = get_scheduler(
        cfg["lr_scheduler"],
        optimizer=optimizer,
        num_warmup_steps=cfg["warmup_steps"] * accelerator.num_processes,
        num_training_steps=cfg["max_steps"] * accelerator.num_processes,
    )
    # FSDP2 needs the model and its optimizer in one prepare call.
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, eval_loader, scheduler)
    meter_stock_ddp(accelerator, model, plan)  # a stock DDP baseline's bytes are counted too
    metric = load_accuracy_metric() if recipe.task == "sequence-classification" else None

    completed_steps, wire_total, last_eval = 0, 0, None
    if saved is not None:
        for warning in resume_warnings:
            accelerator.print(f"resume: {warning}")
        accelerator.load_state(str(resume_from))
        completed_steps, wire_total = saved["step"], saved["wire_bytes_total"]
        last_eval = saved.get("metrics")
        accelerator.print(f"resumed from {resume_from} at step {completed_steps}")

    accelerator.init_trackers("qaccel", config={"recipe": recipe.name, "method": plan.method, **cfg})
    log = MetricsLog(output_dir / "metrics.jsonl", enabled=accelerator.is_main_process, resume_step=completed_steps if resume_from else None)
    unwrapped = accelerator.unwrap_model(model)
    guards = TrainingGuards(  # non-finite values every step, replica hashes every QACCEL_CHECK_REPLICAS steps
        accelerator, model, optimizer, allow_nonfinite=args.allow_nonfinite, replica_interval=replica_interval, first_step=completed_steps + 1
    )

    def save(step: int) -> None:
        def write_extra(folder: Path) -> None:
            save_checkpoint_metadata(
                folder,
                run_state=run_state(step, wire_total, last_eval),
                model_config=unwrapped.config,
                tokenizer=tokenizer,
                generation_config=getattr(unwrapped, "generation_config", None),
            )

        path = save_checkpoint(accelerator, output_dir, step, write_extra)
        accelerator.print(f"saved {path}")

    accelerator.print(
        f"recipe {recipe.name}: {recipe.task}, method {plan.method} on {plan.parallelism}, {accelerator.num_processes} processes, "
        f"{sum(p.numel() for p in unwrapped.parameters()):,} parameters (local), {cfg['max_steps']} steps of "
        f"{cfg['per_device_batch_size']} x {cfg['gradient_accumulation_steps']} x {accelerator.num_processes} sequences"
    )
    # The data order is a function of (seed, epoch): a resumed run skips the batches already seen.
    batches_per_epoch = len(train_loader)
    micro_done = completed_steps * cfg["gradient_accumulation_steps"]
    epoch, skip = divmod(micro_done, batches_per_epoch)
    progress = tqdm(total=cfg["max_steps"], initial=completed_steps, disable=not accelerator.is_main_process, desc="train")
    accelerator.wire_meter.end_step()  # bytes of set-up collectives do not belong to step 1
    model.train()
    step_losses, step_start = [], time.perf_counter()
    while completed_steps < cfg["max_steps"]:
        train_loader.set_epoch(epoch)
        loader = accelerator.skip_first_batches(train_loader, skip) if skip else train_loader
        skip = 0
        for batch in loader:
            faults.step = completed_steps + 1
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    guards.before_step(completed_steps + 1)  # non-finite values: stop, or skip with a scaler
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step_losses.append(loss.detach().float())
            if not accelerator.sync_gradients:
                continue
            # One optimizer step is complete.
            completed_steps += 1
            guards.after_step(completed_steps)  # QACCEL_CHECK_REPLICAS
            step_loss = accelerator.reduce(torch.stack(step_losses).mean(), reduction="mean").item()  # host sync, once per step
            step_seconds = time.perf_counter() - step_start
            sent = sum(t.sent_bytes for t in accelerator.wire_meter.end_step().values())
            wire_total += sent
            row = {
                "step": completed_steps,
                "loss": step_loss,
                "learning_rate": scheduler.get_last_lr()[0],
                "wire_bytes": sent,
                "wire_bytes_total": wire_total,
                "step_seconds": step_seconds,
            }
            last_step = completed_steps == cfg["max_steps"]
            if last_step or (cfg["eval_steps"] and completed_steps % cfg["eval_steps"] == 0):
                last_eval = evaluate_model(accelerator, model, eval_loader, recipe.task, seed=cfg["seed"], metric=metric)
                # Evaluation gathers weights too (FSDP2); keep its bytes out of the next training step.
                eval_sent = sum(t.sent_bytes for t in accelerator.wire_meter.end_step().values())
                row.update(last_eval, eval_wire_bytes=eval_sent)
                accelerator.print(f"step {completed_steps}: " + ", ".join(f"{k} {v:.4g}" for k, v in last_eval.items()))
            if last_step or completed_steps % args.logging_steps == 0:
                log.write(row)
                accelerator.log({k: v for k, v in row.items() if k != "step"}, step=completed_steps)
            progress.update(1)
            progress.set_postfix(loss=f"{step_loss:.3f}", sent=f"{sent / 1e6:.1f}MB")
            if last_step or (cfg["save_steps"] and completed_steps % cfg["save_steps"] == 0):
                save(completed_steps)
            if last_step:
                break
            step_losses, step_start = [], time.perf_counter()
        epoch += 1
    progress.close()

    if args.push_to_hub:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            from qaccel.hub.export import export_checkpoint
            from qaccel.hub.push import push_folder

            final = output_dir / f"checkpoint-{completed_steps}"
            exported = export_checkpoint(final, output_dir / "export", overwrite=True, model_name=args.hub_model_id)
            push_folder(exported, args.hub_model_id)
    accelerator.end_training()
    faults.close()
    summary = {"step": completed_steps, "wire_bytes_total": wire_total, **(last_eval or {})}
    accelerator.print(f"done: {summary}")
    return summary


if __name__ == "__main__":
    main()
