"""A training run's set-up: the accelerator of the method, the data and the model, the optimizer and its schedule.

What a user's Accelerate script does before its loop (``run_clm_no_trainer.py``), for the run that
:class:`qaccel.training.run_settings.RunInputs` describes.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import torch
from transformers import get_scheduler

from ..zoo import load_data, load_model, load_tokenizer
from ..zoo.lora import apply_lora
from ..zoo.recipes import DEFAULT_MLM_PROBABILITY
from ..zoo.user_data import load_user_data
from .methods import MethodPlan, build_accelerator, build_optimizer
from .run_settings import RunInputs, TrainingSettings

if TYPE_CHECKING:
    from ..integration import Accelerator

__all__ = ["build_optimizer_and_scheduler", "build_run_accelerator", "load_data_and_model"]


def load_data_and_model(accelerator: Accelerator, inputs: RunInputs) -> tuple[Any, Any, torch.nn.Module]:
    """The tokenizer, the data splits and the model (with its LoRA adapters when asked), as a user's script builds them."""
    recipe, model_source = inputs.recipe, inputs.model_source
    # Data and tokenizer are built (and cached on disk) by the main process first.
    with accelerator.main_process_first():
        tokenizer = load_tokenizer(recipe, model_source)
        if inputs.data_source is None:
            data = load_data(recipe, tokenizer)
        else:
            mlm_probability = recipe.training.mlm_probability or DEFAULT_MLM_PROBABILITY
            data = load_user_data(inputs.data_source, recipe.task, tokenizer, seed=inputs.settings.seed, mlm_probability=mlm_probability)
    model = load_model(recipe, tokenizer, model_source, label_names=data.label_names)  # id2label reaches the checkpoint's config
    if inputs.lora is not None:  # frozen base, trainable adapters (and head), before prepare as in a user's script
        model = apply_lora(model, inputs.lora, recipe.task, seed=recipe.training.seed)
    return tokenizer, data, model


def build_run_accelerator(args: argparse.Namespace, inputs: RunInputs) -> Accelerator:
    """The ``qaccel.Accelerator`` of the method's parallelism, with the run's precision, accumulation and trackers."""
    return build_accelerator(
        inputs.plan,
        layer_cls=inputs.recipe.model.transformer_layer_cls,
        mixed_precision=inputs.settings.mixed_precision,
        gradient_accumulation_steps=inputs.settings.gradient_accumulation_steps,
        report_to=None if args.report_to == "none" else args.report_to,
        project_dir=str(inputs.output_dir),
        collective_timeout_s=args.collective_timeout_s,
    )


def build_optimizer_and_scheduler(accelerator: Accelerator, plan: MethodPlan, model: torch.nn.Module, settings: TrainingSettings) -> tuple[Any, Any]:
    """The method's optimizer (AdamW, or a 1-bit Adam) and the learning-rate schedule."""
    optimizer = build_optimizer(plan, model, learning_rate=settings.learning_rate, weight_decay=settings.weight_decay)
    # Accelerate steps a prepared scheduler once per process per optimizer step, hence the factor.
    scheduler = get_scheduler(
        settings.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=settings.warmup_steps * accelerator.num_processes,
        num_training_steps=settings.max_steps * accelerator.num_processes,
    )
    return optimizer, scheduler
