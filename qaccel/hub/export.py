"""``qaccel export``: a training checkpoint -> a Hugging Face model folder that records how it was trained.

The folder holds ``model.safetensors`` (the trained weights; bitsandbytes int8/nf4 with ``bnb``),
``config.json``, ``generation_config.json`` and the tokenizer files saved in the checkpoint's
``hf_model/``, ``qaccel_config.json`` (the run state plus the measured results) and a model card
``README.md``. Every safetensors file's ``__metadata__`` keeps ``format: pt`` (transformers refuses
other formats) and adds the ``qaccel_*`` keys of :func:`safetensors_metadata`.

The folder is built in a hidden sibling of ``out_dir`` and renamed into place at the end; on any
error the sibling is removed, so ``out_dir`` is either absent, untouched, or complete.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from .._extras import require_extra
from .._version import __version__
from ..checkpoint import MODEL_FILES_DIR, TASKS, atomic_write_json, install_dir, open_checkpoint, read_json, staging_dir
from ..zoo.lora import LoraSpec
from ._adapter import check_adapter_export, lora_card, lora_metadata, lora_of, save_lora_model, wrap_like_checkpoint
from ._weights import SavedWeights, find_weights
from .card import BNB_DESCRIPTIONS, build_model_card

__all__ = ["BNB_CHOICES", "SIDECAR_FILE", "export_checkpoint", "safetensors_metadata", "bnb_config"]

logger = logging.getLogger(__name__)

BNB_CHOICES = ("int8", "nf4")
SIDECAR_FILE = "qaccel_config.json"
SIDECAR_SCHEMA_VERSION = 1
_SAVED_BY_MODEL = "config.json"  # written by save_pretrained (with quantization_config for bnb), never copied


def _check_bnb(bnb: str | None) -> None:
    if bnb is None:
        return
    if bnb not in BNB_CHOICES:
        raise ValueError(f"export bnb={bnb!r}: must be one of {list(BNB_CHOICES)} or None (full precision)")
    require_extra("bnb", f"export --bnb {bnb}")


def bnb_config(bnb: str, compute_dtype: Any = None) -> Any:
    """The transformers ``BitsAndBytesConfig`` of a ``--bnb`` choice.

    ``int8`` is LLM.int8() (``load_in_8bit``, transformers' default outlier threshold 6.0); ``nf4``
    is 4-bit NormalFloat without double quantization, computing in ``compute_dtype`` (default: the
    dtype the weights were trained in, so CPU inference needs no half-precision kernels).
    """
    import torch
    from transformers import BitsAndBytesConfig

    if bnb == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    if bnb == "nf4":
        return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype or torch.float32)
    raise ValueError(f"bnb={bnb!r}: must be one of {list(BNB_CHOICES)}")


def safetensors_metadata(run_state: dict, bnb: str | None = None) -> dict[str, str]:
    """The ``__metadata__`` of every exported safetensors file (a str -> str map).

    Keys: ``format`` (``pt``), ``qaccel_version`` (of the exporting qaccel), ``qaccel_method``,
    ``qaccel_config`` (the method config as JSON), ``qaccel_recipe`` (empty without a recipe),
    ``qaccel_step``, ``qaccel_wire_bytes_total``, ``qaccel_task``, ``qaccel_world_size`` and
    ``qaccel_bnb`` (``none``, ``int8`` or ``nf4``).
    """
    return {
        "format": "pt",
        "qaccel_version": __version__,
        "qaccel_method": run_state["method"],
        "qaccel_config": json.dumps(run_state["method_config"], sort_keys=True),
        "qaccel_recipe": run_state.get("recipe") or "",
        "qaccel_step": str(run_state["step"]),
        "qaccel_wire_bytes_total": str(run_state["wire_bytes_total"]),
        "qaccel_task": run_state["task"],
        "qaccel_world_size": str(run_state["world_size"]),
        "qaccel_bnb": bnb or "none",
    }


def _sidecar(run_state: dict, bnb: str | None, weights_dtype: str | None, checkpoint_dir: Path) -> dict:
    sent, baseline = run_state["wire_bytes_total"], run_state.get("baseline_wire_bytes_total")
    return {
        "schema_version": SIDECAR_SCHEMA_VERSION,
        "qaccel_version": __version__,
        "qaccel_method": run_state["method"],
        "qaccel_config": run_state["method_config"],
        "qaccel_recipe": run_state.get("recipe") or "",
        "qaccel_step": run_state["step"],
        "qaccel_wire_bytes_total": sent,
        "qaccel_bnb": bnb or "none",
        "weights": BNB_DESCRIPTIONS[bnb] if bnb else f"full precision ({weights_dtype})",
        "task": run_state["task"],
        "world_size": run_state["world_size"],
        "results": {
            "metrics": run_state.get("metrics") or {},
            "wire_bytes_total": sent,
            "baseline_wire_bytes_total": baseline,
            "wire_bytes_ratio": (sent / baseline) if baseline else None,
        },
        "base_model": run_state.get("base_model"),
        "dataset": run_state.get("dataset"),
        "source_checkpoint": checkpoint_dir.name,
        "trained_with": run_state.get("versions") or {},
        "run_state": run_state,
    }


def _check_out_dir(out_dir: Path, checkpoint_dir: Path, overwrite: bool) -> None:
    out, ckpt = out_dir.resolve(), checkpoint_dir.resolve()
    if out == ckpt or out in ckpt.parents or ckpt in out.parents:
        raise ValueError(f"export out_dir={out_dir}: is, contains or lies inside the checkpoint {checkpoint_dir}; choose another folder")
    if out_dir.exists() and not out_dir.is_dir():
        raise FileExistsError(f"export out_dir={out_dir}: exists and is not a folder")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise FileExistsError(f"export out_dir={out_dir}: exists and is not empty; pass overwrite=True (qaccel export --overwrite) to replace it")


def _stamp_metadata(folder: Path, metadata: dict[str, str]) -> None:
    """Rewrite each safetensors file with ``metadata`` merged into its own (transformers writes only ``format``)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"{folder}: save_pretrained wrote no safetensors file")
    for path in files:
        with safe_open(str(path), framework="pt") as fh:
            merged = {**(fh.metadata() or {}), **metadata}
            tensors = {key: fh.get_tensor(key) for key in fh.keys()}
        save_file(tensors, str(path), metadata=merged)


def _label_names(hf_dir: Path) -> list[str]:
    """A classifier's label names by id, from the checkpoint's ``config.json`` (``id2label``)."""
    id2label = read_json(hf_dir / "config.json").get("id2label") or {}
    return [id2label[key] for key in sorted(id2label, key=int)]


def _copy_model_files(hf_dir: Path, folder: Path) -> None:
    """Tokenizer files and the run's own generation config next to the saved model."""
    for item in sorted(hf_dir.iterdir()):
        if item.name == _SAVED_BY_MODEL:
            continue
        if item.is_dir():
            shutil.copytree(item, folder / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, folder / item.name)


def _build_model(hf_dir: Path, task: str, dtype: Any) -> Any:
    import transformers

    config_path = hf_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path}: not found; the checkpoint lacks the model config (save_checkpoint_metadata writes it)")
    config = transformers.AutoConfig.from_pretrained(str(hf_dir))
    auto_class = getattr(transformers, TASKS[task][0])
    kwargs = {"dtype": dtype} if dtype is not None else {}
    return auto_class.from_config(config, **kwargs)


def _write_weights(hf_dir: Path, saved: SavedWeights, run_state: dict, out: Path, *, lora: LoraSpec | None, merge_adapter: bool) -> None:
    """The checkpoint's weights in a model built from its config, saved to ``out`` (a LoRA run: adapter or merged model)."""
    model = _build_model(hf_dir, run_state["task"], saved.dtype)
    if lora is not None:
        model = wrap_like_checkpoint(model, lora, run_state["task"])
    saved.load_into(model)
    model.eval()
    if lora is not None:
        save_lora_model(model, out, merge_adapter=merge_adapter, base_model=run_state.get("base_model"))
    else:
        model.save_pretrained(out)


def _write_quantized(full_precision: Path, out: Path, task: str, bnb: str, dtype: Any) -> None:
    """The full-precision folder loaded through transformers with bitsandbytes quantization (on CPU), saved to ``out``."""
    import transformers

    auto_class = getattr(transformers, TASKS[task][0])
    quantized = auto_class.from_pretrained(str(full_precision), quantization_config=bnb_config(bnb, dtype), device_map="cpu")
    quantized.save_pretrained(out)


def export_checkpoint(
    checkpoint_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    bnb: str | None = None,
    overwrite: bool = False,
    model_name: str | None = None,
    merge_adapter: bool = False,
) -> Path:
    """Write a Hugging Face model folder from a qaccel training checkpoint.

    Args:
        checkpoint_dir: a complete ``checkpoint-STEP/`` folder (``qaccel.checkpoint.save_checkpoint``):
            Accelerate's ``save_state`` files (FSDP2 sharded DCP, FSDP2 full state dict, or DDP
            safetensors) plus ``qaccel_state.json``, ``hf_model/`` and ``manifest.json``.
        out_dir: the folder to create.
        bnb: ``None`` for the full-precision weights, ``"int8"`` or ``"nf4"`` for a
            bitsandbytes-quantized folder (quantized on CPU through transformers).
        overwrite: replace an existing non-empty ``out_dir`` (whole, only once the new folder is complete).
        model_name: the name in the card's title, usage snippet and ``model-index`` (the Hub repo
            id when known); default: the name of ``out_dir``.
        merge_adapter: for a LoRA checkpoint, write the merged model (``merge_and_unload``) instead
            of the adapter (``qaccel.hub._adapter``); a checkpoint without LoRA refuses it.

    Returns:
        ``out_dir``.

    Raises:
        CheckpointError: (a ValueError) no manifest, or a file that is missing, truncated, altered or
            not listed in it (named), exactly as on resume; unsafe DCP metadata.
        FileNotFoundError: no ``qaccel_state.json``, no ``hf_model/config.json`` or no weights.
        FileExistsError: ``out_dir`` exists, is not empty, and ``overwrite`` is false.
        ValueError: an unknown ``bnb``; a truncated or corrupted file (named); weights that do not
            match the model built from the config; an invalid run state.
        RuntimeError: ``bnb`` without bitsandbytes installed.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    _check_bnb(bnb)
    _check_out_dir(out_dir, checkpoint_dir, overwrite)
    # The check resume makes, with the same errors, before anything is read: every file against the
    # manifest, DCP metadata pickles vetted.
    run_state = open_checkpoint(checkpoint_dir)
    lora = lora_of(run_state)  # a LoRA run: its adapter (or, merged, a plain model) is what is exported
    check_adapter_export(lora, merge_adapter=merge_adapter, bnb=bnb)
    hf_dir = checkpoint_dir / MODEL_FILES_DIR
    if not hf_dir.is_dir():
        raise FileNotFoundError(f"{hf_dir}: not found; the checkpoint lacks the model config (save_checkpoint_metadata writes it)")
    saved = SavedWeights(find_weights(checkpoint_dir))  # checks every file against its index before any output exists
    weights_dtype = str(saved.dtype).removeprefix("torch.") if saved.dtype is not None else None
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_dir(out_dir, "export")
    full_precision = staged
    try:
        if bnb:  # the full-precision folder the quantized model is loaded from
            full_precision = staging_dir(out_dir, "export-fp")
        _write_weights(hf_dir, saved, run_state, full_precision, lora=lora, merge_adapter=merge_adapter)
        if bnb:
            _write_quantized(full_precision, staged, run_state["task"], bnb, saved.dtype)
        _copy_model_files(hf_dir, staged)
        _stamp_metadata(staged, {**safetensors_metadata(run_state, bnb), **lora_metadata(lora, merge_adapter=merge_adapter)})
        sidecar = _sidecar(run_state, bnb, weights_dtype, checkpoint_dir)
        atomic_write_json(staged / SIDECAR_FILE, sidecar)
        label_names = _label_names(hf_dir) if run_state["task"] == "sequence-classification" else None
        card = build_model_card(run_state, model_name=model_name or out_dir.name, bnb=bnb, weights_dtype=weights_dtype, label_names=label_names)
        if lora is not None:
            card = lora_card(card, lora, merge_adapter=merge_adapter, run_state=run_state, model_name=model_name or out_dir.name,
                             num_labels=len(label_names) if label_names else None)  # fmt: skip
        card.save(str(staged / "README.md"))
        install_dir(staged, out_dir)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    finally:
        if full_precision != staged:
            shutil.rmtree(full_precision, ignore_errors=True)
    logger.info("exported %s (%s, step %d) to %s", checkpoint_dir, run_state["method"], run_state["step"], out_dir)
    return out_dir
