"""Model zoo: recipes (``model_cards/``), offline data, tokenizers, model loading, metrics.

Everything a training script needs to turn a recipe name into a model and data, with nothing
downloaded: ``load_recipe`` -> ``load_tokenizer`` -> ``load_model`` / ``load_data``. Names are
imported on first use, so ``import qaccel.zoo`` stays cheap (no torch, transformers or datasets).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Recipe",
    "ModelSpec",
    "TokenizerSpec",
    "DatasetSpec",
    "TrainingSpec",
    "MethodSpec",
    "LaunchSpec",
    "load_recipe",
    "list_recipes",
    "recipe_names",
    "model_cards_dir",
    "load_tokenizer",
    "load_model",
    "resolve_model_path",
    "load_data",
    "DataSplits",
    "load_accuracy_metric",
    "build_corpus",
    "build_topics",
    "TOPIC_FAMILIES",
    "bigram_sequences",
]

_LAZY = {
    **{name: "recipes" for name in ("Recipe", "ModelSpec", "TokenizerSpec", "DatasetSpec", "TrainingSpec", "MethodSpec", "LaunchSpec")},
    **{name: "recipes" for name in ("load_recipe", "list_recipes", "recipe_names", "model_cards_dir")},
    "load_tokenizer": "tokenizer",
    "load_model": "models",
    "resolve_model_path": "models",
    "load_data": "data",
    "DataSplits": "data",
    "load_accuracy_metric": "metrics",
    "build_corpus": "corpus",
    "build_topics": "sources",
    "TOPIC_FAMILIES": "sources",
    "bigram_sequences": "synthetic",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
