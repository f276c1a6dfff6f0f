"""A training run's evaluations: every ``eval_steps`` optimizer steps, at the last one, and at step 0 with ``--eval_on_start``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .evaluation import evaluate_model

if TYPE_CHECKING:
    from ..integration import Accelerator
    from .run_settings import RunInputs

__all__ = ["PeriodicEvaluation", "classification_metric"]


def classification_metric(inputs: RunInputs, label_names: list[str] | None) -> Any:
    """The ``evaluate`` module of a sequence-classification run (accuracy; and F1 of class 1 for two-class
    sentence pairs, as GLUE reports MRPC), or None for the language-model tasks (loss and perplexity)."""
    if inputs.recipe.task != "sequence-classification":
        return None
    from ..zoo.metrics import load_classification_metrics  # evaluate and its metric scripts: on first use

    pairs = inputs.data_source is not None and inputs.data_source.text_pair_column is not None
    return load_classification_metrics(with_f1=pairs and len(label_names) == 2)


class PeriodicEvaluation:
    """Evaluate the model on the eval loader on every rank and print one line (main process) per evaluation.

    Args:
        task: the recipe's task (what is measured: :func:`qaccel.training.evaluate_model`).
        seed: masked-LM masks of every evaluation (the same each time; the training RNG is untouched).
        metric: from :func:`classification_metric`.
        every_steps: evaluate every N optimizer steps (0: only at ``max_steps``).
    """

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module, loader: Any, task: str, *, seed: int, metric: Any, every_steps: int, max_steps: int) -> None:
        self.accelerator, self.model, self.loader, self.task = accelerator, model, loader, task
        self.seed, self.metric = seed, metric
        self.every_steps, self.max_steps = every_steps, max_steps

    @classmethod
    def for_run(cls, accelerator: Accelerator, inputs: RunInputs, model: torch.nn.Module, loader: Any, label_names: list[str] | None) -> PeriodicEvaluation:
        """The evaluations ``inputs`` asks for: its task, seed, ``eval_steps`` and ``max_steps``."""
        settings, metric = inputs.settings, classification_metric(inputs, label_names)
        return cls(accelerator, model, loader, inputs.recipe.task, seed=settings.seed, metric=metric, every_steps=settings.eval_steps, max_steps=settings.max_steps)

    def is_due(self, step: int) -> bool:
        """Optimizer step ``step`` ends with an evaluation."""
        return step == self.max_steps or bool(self.every_steps and step % self.every_steps == 0)

    def __call__(self, step: int) -> dict[str, float]:
        """Evaluate after optimizer step ``step`` (0: before the first); the same results on every rank."""
        results = evaluate_model(self.accelerator, self.model, self.loader, self.task, seed=self.seed, metric=self.metric)
        self.accelerator.print(f"step {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))
        return results
