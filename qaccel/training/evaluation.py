"""Evaluation for the three recipe tasks: loss and perplexity, or accuracy (and F1).

Every rank evaluates its share of the eval set (FSDP2 needs all ranks in every forward);
per-example sums are gathered with ``gather_for_metrics``, which drops the samples the
dataloader repeated to even out the last batch, so the result equals a single-process pass.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["evaluate_model"]


def _per_example_loss(logits: torch.Tensor, labels: torch.Tensor, *, shift: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed token cross-entropy and token count per example; labels of -100 are ignored."""
    if shift:  # causal LM: position t predicts token t+1
        logits, labels = logits[:, :-1], labels[:, 1:]
    losses = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")  # (B, T)
    counted = (labels != -100).sum(dim=1)
    return losses.sum(dim=1), counted


@torch.no_grad()
def evaluate_model(accelerator: Any, model: torch.nn.Module, loader: Any, task: str, *, seed: int, metric: Any = None) -> dict[str, float]:
    """Evaluate on every rank; returns the same dict on every rank.

    Args:
        task: ``causal-lm`` -> ``eval_loss``, ``eval_perplexity``; ``masked-lm`` -> the same over
            masked tokens; ``sequence-classification`` -> ``eval_loss`` and ``eval_<name>`` for each
            result of ``metric`` (an ``evaluate`` module: accuracy, or accuracy and F1 combined).
        seed: masked-LM masking draws from torch's RNG; a fixed seed makes every evaluation see the
            same masks, and forking the RNG leaves the training stream untouched (exact resumes).
    """
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64)
    token_count = 0
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for batch in loader:
            outputs = model(**batch)
            if task == "sequence-classification":
                labels = batch["labels"]
                per_example = F.cross_entropy(outputs.logits.float(), labels, reduction="none")
                preds, labels, per_example = accelerator.gather_for_metrics((outputs.logits.argmax(dim=-1), labels, per_example))
                metric.add_batch(predictions=preds.cpu(), references=labels.cpu())
                loss_sum += per_example.double().sum().cpu()
                token_count += per_example.numel()
            else:
                sums, counts = _per_example_loss(outputs.logits, batch["labels"], shift=task == "causal-lm")
                sums, counts = accelerator.gather_for_metrics((sums, counts))
                loss_sum += sums.double().sum().cpu()
                token_count += int(counts.sum())
    if was_training:
        model.train()
    loss = float(loss_sum) / max(token_count, 1)
    results = {"eval_loss": loss}
    if task == "sequence-classification":
        results.update({f"eval_{name}": float(value) for name, value in metric.compute().items()})
    else:
        results["eval_perplexity"] = math.exp(min(loss, 50.0))
    return results
