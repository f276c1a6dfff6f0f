"""Package layout that pyproject.toml cannot express: the recipes (``model_cards/``) and launch configs
(``launch_configs/``) stay at the top of the repository, and the wheel carries them as the data packages
``qaccel.model_cards`` and ``qaccel.launch_configs`` (an editable install maps the same names to the same
folders), so ``qaccel recipes``, ``qaccel train`` and ``qaccel configs`` work from an installed wheel.
"""

from setuptools import find_packages, setup

DATA_PACKAGES = {"qaccel.model_cards": "model_cards", "qaccel.launch_configs": "launch_configs"}

setup(
    packages=[*find_packages(include=["qaccel", "qaccel.*"]), "qaccel.csrc", *DATA_PACKAGES],
    package_dir=DATA_PACKAGES,
    package_data={
        "qaccel.csrc": ["*.cpp", "*.cu", "*.h", "*.cuh"],
        "qaccel.model_cards": ["*.md"],
        "qaccel.launch_configs": ["*.yaml"],
    },
)
