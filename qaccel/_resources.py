"""Where the files that ship beside the code live: the recipes (``model_cards/``) and launch configs.

In the repository both folders sit at the top, next to ``qaccel/``; a wheel carries them inside the
package as ``qaccel/model_cards`` and ``qaccel/launch_configs`` (see ``setup.py``). One lookup serves
both: the folder inside the package if it is there (an installed wheel), else the one beside it (a
source checkout, an editable install, or ``PYTHONPATH`` pointing at a checkout).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "MODEL_CARDS_ENV",
    "model_cards_dir",
    "launch_configs_dir",
    "launch_config_names",
    "launch_config_path",
]

MODEL_CARDS_ENV = "QACCEL_MODEL_CARDS"  # a folder of recipes to use instead of the shipped ones
_PACKAGE_DIR = Path(__file__).resolve().parent


def _shipped_dir(name: str) -> Path:
    for candidate in (_PACKAGE_DIR / name, _PACKAGE_DIR.parent / name):  # wheel, then checkout
        if candidate.is_dir():
            return candidate
    raise RuntimeError(
        f"the {name}/ folder that ships with qaccel is missing (looked in {_PACKAGE_DIR / name} and "
        f"{_PACKAGE_DIR.parent / name}); reinstall qaccel (pip install --force-reinstall from the wheel or clone it came from; docs/install.md)"
    )


def model_cards_dir() -> Path:
    """The recipes folder: ``$QACCEL_MODEL_CARDS`` if set, else the shipped ``model_cards/``.

    Raises:
        RuntimeError: the folder named by ``QACCEL_MODEL_CARDS``, or the shipped one, does not exist.
    """
    env = os.environ.get(MODEL_CARDS_ENV)
    if not env:
        return _shipped_dir("model_cards")
    path = Path(env).expanduser()
    if not path.is_dir():
        raise RuntimeError(f"{MODEL_CARDS_ENV}={env!r}: no such folder; unset it to use the recipes that ship with qaccel")
    return path


def launch_configs_dir() -> Path:
    """The shipped ``launch_configs/`` folder (Accelerate config files, one per set-up)."""
    return _shipped_dir("launch_configs")


def launch_config_names() -> list[str]:
    """The shipped launch configs' names (file stems), sorted."""
    return sorted(p.stem for p in launch_configs_dir().glob("*.yaml"))


def launch_config_path(name: str) -> Path:
    """A shipped launch config's path from its name: ``cpu_2proc_qsdp``, ``cpu_2proc_qsdp.yaml`` or
    ``launch_configs/cpu_2proc_qsdp.yaml`` (the form recipes use, relative to the repository root).

    Raises:
        ValueError: no shipped launch config has that name (the message lists the valid ones).
    """
    relative = Path(name)
    if relative.parts[:1] == ("launch_configs",):
        relative = Path(*relative.parts[1:])
    stem = relative.name[: -len(relative.suffix)] if relative.suffix in (".yaml", ".yml") else relative.name
    path = launch_configs_dir() / f"{stem}.yaml"
    if len(relative.parts) != 1 or not path.is_file():
        raise ValueError(f"launch config {name!r}: not one that ships with qaccel; valid: {', '.join(launch_config_names())}")
    return path
