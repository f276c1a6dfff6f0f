"""What ``qaccel bench project`` reads: measured step times, codec throughput, model shapes.

* ``qaccel bench e2e`` reports (1 node: ``docs/bench/e2e.json``; 2 nodes: ``docs/bench/e2e_2node.json``):
  every row of a sharded method with a step time becomes a :class:`Measured` configuration; rows of
  other methods (DDP, 1-bit optimizers) and failed rows are listed as skipped, with the reason.
* ``qaccel bench quant`` (``docs/bench/quant.json``): seconds per element of quantize and dequantize, from
  the C++ backend at the bench's thread count, and from the CUDA backend when the report has one.
* Model shapes: the bench's GPT-2 shapes, or a recipe's model built on the meta device.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ._project_bytes import METHODS, ModelShapes, model_shapes
from ._project_model import CodecRates

__all__ = [
    "ProjectInputError",
    "Measured",
    "read_json",
    "measured_configs",
    "codec_rates",
    "bench_model_shapes",
    "load_gpu_recipe",
    "recipe_model",
    "RecipeModel",
    "COMPUTE_DTYPES",
]

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


class ProjectInputError(ValueError):
    """An input file is missing or does not hold what the model needs (the message names it and the key)."""


def read_json(path: str, what: str, producer: str) -> dict:
    """The JSON object in ``path``; a clear error naming the file and the command that writes it."""
    file = Path(path)
    if not file.is_file():
        raise ProjectInputError(f"{what} {path!r}: no such file; write it with `{producer}` or pass another path")
    try:
        data = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProjectInputError(f"{what} {path!r}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ProjectInputError(f"{what} {path!r}: expected a JSON object, got {type(data).__name__}")
    return data


@dataclass(frozen=True)
class Measured:
    """One measured configuration of the simulated cluster.

    Attributes:
        source: ``1-node`` or ``2-node``.
        label: the bench's configuration label (method, ``+prefetch``).
        method: key of :data:`qaccel.bench._project_bytes.METHODS`.
        compute: ``fp32`` or ``bf16``.
        rate_bits: the shaped link's rate (``None``: unshaped).
        nodes / per_node: the simulated cluster.
        step_s, step_min_s, step_max_s: median and range of the measured steps.
        compute_s: the compute-only time measured in the same job.
        link_bytes: measured bytes per step by level (``link``: the one loopback of a 1-node run;
            ``inter_node`` / ``intra_node`` on two nodes), what the kernel counters saw.
    """

    source: str
    label: str
    method: str
    compute: str
    prefetch: bool
    rate_bits: float | None
    nodes: int
    per_node: int
    step_s: float
    step_min_s: float | None
    step_max_s: float | None
    compute_s: float
    link_bytes: dict[str, float]


def _base_method(name: str, row: dict) -> tuple[str | None, str]:
    """``(method key, compute)`` of a bench method name: ``qsdp-w8g8-bf16`` -> (``qsdp-w8g8``, ``bf16``)."""
    compute = str(row.get("compute") or "fp32")
    base = name
    for suffix in ("-fp32", "-bf16"):
        if name.endswith(suffix):
            base, compute = name[: -len(suffix)], suffix[1:]
    return (base if base in METHODS else None), compute


def _int_setting(report: dict, keys: tuple[str, ...], where: str) -> int:
    settings = report.get("settings") or {}
    for key in keys:
        if isinstance(settings.get(key), int) and settings[key] >= 1:
            return settings[key]
    raise ProjectInputError(f"{where}: settings has none of {', '.join(keys)} (a positive int)")


def measured_configs(report: dict, source: str, where: str) -> tuple[list[Measured], list[dict]]:
    """The sharded-method rows of an e2e report, and the rows skipped with their reason.

    ``source`` is ``1-node`` (ranks ``settings.world_size`` on one node) or ``2-node``
    (``settings.nodes`` x ``settings.nproc_per_node``).
    """
    rows = report.get("results")
    if not isinstance(rows, list):
        raise ProjectInputError(f"{where}: no 'results' list (is it a `qaccel bench e2e` report?)")
    if source == "1-node":
        nodes, per_node = 1, _int_setting(report, ("world_size",), where)
    else:
        nodes = _int_setting(report, ("nodes",), where)
        per_node = _int_setting(report, ("nproc_per_node", "per_node"), where)
    compute_only = report.get("compute_only") or {}
    measured, skipped = [], []
    for row in rows:
        found = _measured_row(row, source, nodes, per_node, compute_only)
        if isinstance(found, Measured):
            measured.append(found)
        else:
            label = str(row.get("label") or row.get("method", "?"))
            skipped.append({"source": source, "label": label, "bandwidth": row.get("bandwidth") or row.get("rate_bits_per_s"),
                            "reason": found})  # fmt: skip
    return measured, skipped


def _measured_row(row: dict, source: str, nodes: int, per_node: int, compute_only: dict) -> Measured | str:
    """One e2e row as a :class:`Measured` configuration, or the reason it is skipped."""
    name = str(row.get("method", "?"))
    method, compute = _base_method(name, row)
    if method is None:
        return "not a sharded (FSDP2/HSDP/QSDP) method: outside this model"
    if not isinstance(row.get("step_s"), (int, float)):
        return f"no step time ({row.get('error') or 'failed'})"
    compute_s = row.get("t_compute_s")
    if not isinstance(compute_s, (int, float)):
        compute_s = (compute_only.get(compute) or {}).get("median_s")
    if not isinstance(compute_s, (int, float)):
        return f"no compute-only time for {compute}"
    if METHODS[method].hierarchical and nodes < 2:
        return "hierarchical method on one node"
    link: dict[str, float] = {}
    for key, level in (
        ("link_bytes_per_step", "link"),
        ("inter_node_bytes_per_step", "inter_node"),
        ("intra_node_bytes_per_step", "intra_node"),
    ):
        if isinstance(row.get(key), (int, float)):
            link[level] = float(row[key])
    rate = row.get("rate_bits_per_s")
    return Measured(
        source=source,
        label=str(row.get("label") or name),
        method=method,
        compute=compute,
        prefetch=bool(row.get("prefetch")),
        rate_bits=float(rate) if isinstance(rate, (int, float)) else None,
        nodes=nodes,
        per_node=per_node,
        step_s=float(row["step_s"]),
        step_min_s=row.get("step_s_min"),
        step_max_s=row.get("step_s_max"),
        compute_s=float(compute_s),
        link_bytes=link,
    )


def codec_rates(report: dict, where: str, *, threads: int | None = None, cuda: bool = False) -> CodecRates | None:
    """Seconds per element from a ``qaccel bench quant`` report.

    ``cuda=False``: the C++ backend at ``threads`` threads (the nearest measured count). ``cuda=True``: the
    CUDA backend, or ``None`` when the report was written without a GPU.
    """
    settings = report.get("settings")
    if not isinstance(settings, dict):
        raise ProjectInputError(f"{where}: no 'settings' (is it a `qaccel bench quant` report?)")
    if cuda:
        key, backend = "cuda", "cuda"
        if key not in settings:
            return None
    else:
        backend = "cpu"
        counts = {
            int(k.rsplit("_", 1)[1]): k
            for k in settings
            if k.startswith("cpu_threads_") and k.rsplit("_", 1)[1].isdigit()
        }
        if not counts:
            raise ProjectInputError(f"{where}: no cpu_threads_<n> setting")
        want = threads or 1
        key = counts[min(counts, key=lambda n: (abs(n - want), n))]
    rows = (settings[key].get("backends") or {}).get(backend)
    if not rows:
        if cuda:
            return None
        raise ProjectInputError(
            f"{where}: settings.{key} has no '{backend}' backend rows (the C++ kernels did not build there)"
        )
    quantize, dequantize = {}, {}
    for row in rows:
        try:
            bits, numel = int(row["bits"]), float(row["numel"])
            quantize[bits] = float(row["quantize_s"]) / numel
            dequantize[bits] = float(row["dequantize_s"]) / numel
        except (KeyError, TypeError, ValueError, ZeroDivisionError):
            raise ProjectInputError(
                f"{where}: settings.{key}.backends.{backend}: a row lacks bits/numel/quantize_s/dequantize_s: {row!r}"
            ) from None
    return CodecRates(quantize, dequantize, source=f"{where}: settings.{key}, backend {backend}")


def _meta_model(auto_class: str, config: Any) -> torch.nn.Module:
    """``transformers.<auto_class>`` built from ``config`` on the meta device: shapes only, no memory."""
    import transformers

    cls = getattr(transformers, auto_class)
    with torch.device("meta"):
        return cls.from_config(config) if hasattr(cls, "from_config") else cls(config)


def bench_model_shapes(model: str, where: str) -> ModelShapes:
    """The GPT-2 shapes ``qaccel bench e2e`` trains (``settings.model``), on the meta device."""
    from transformers import GPT2Config

    from ._e2e_methods import MODELS

    if model not in MODELS:
        raise ProjectInputError(f"{where}: settings.model={model!r}; known: {', '.join(MODELS)}")
    return model_shapes(_meta_model("GPT2LMHeadModel", GPT2Config(**MODELS[model]["config"])), "GPT2Block", model)


@dataclass(frozen=True)
class RecipeModel:
    """A GPU recipe reduced to what the projection needs."""

    name: str
    shapes: ModelShapes
    compute: str  # fp32 | bf16 | fp16
    tokens_per_gpu_step: int  # per optimizer step: per_device_batch_size x seq_len x gradient_accumulation_steps
    micro_batches: int
    recipe_gpus: int


def load_gpu_recipe(name: str) -> Any:
    """The validated recipe ``name``; refuses one without a ``model.config`` (its shapes would need the Hub)."""
    from ..zoo import load_recipe

    try:
        recipe = load_recipe(name)
    except (FileNotFoundError, ValueError) as exc:
        raise ProjectInputError(f"--recipes: {exc}") from None
    if recipe.model.config is None:
        raise ProjectInputError(
            f"--recipes: {name!r} fine-tunes a pretrained model ({recipe.model.name_or_path}); pick a recipe with a model.config"
        )
    return recipe


def recipe_model(recipe: Any) -> RecipeModel:
    """A recipe (:func:`load_gpu_recipe`) with its model built on the meta device (sizes from ``model.config``)."""
    import transformers

    from ..zoo.models import TASK_AUTO_CLASSES

    values = dict(recipe.model.config)
    config = transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    model = _meta_model(TASK_AUTO_CLASSES[recipe.task], config)
    training = recipe.training
    return RecipeModel(
        name=recipe.name,
        shapes=model_shapes(model, recipe.model.transformer_layer_cls, recipe.name),
        compute="fp32" if training.mixed_precision == "no" else training.mixed_precision,
        tokens_per_gpu_step=training.per_device_batch_size
        * recipe.dataset.seq_len
        * training.gradient_accumulation_steps,
        micro_batches=training.gradient_accumulation_steps,
        recipe_gpus=recipe.launch.num_processes,
    )
