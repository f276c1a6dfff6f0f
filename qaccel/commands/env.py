"""``qaccel env``: versions, kernel backends and toolchain, for bug reports."""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import shutil
import subprocess

import torch

from .._version import __version__
from ..quant import _backend
from ._output import emit


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("env", help="print versions, kernel backends and CUDA/nvcc status")
    parser.add_argument("--build", action="store_true", help="build the native kernels first (may take a minute)")
    parser.set_defaults(func=run)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvcc_version() -> str | None:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        return None
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=False).stdout
    return out.strip().splitlines()[-1] if out.strip() else nvcc


def collect(build: bool = False) -> dict:
    return {
        "qaccel": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: _version(name) for name in ("torch", "accelerate", "transformers", "safetensors", "huggingface_hub")},
        "cuda": {
            "available": torch.cuda.is_available(),
            "torch_cuda": torch.version.cuda,
            "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "nvcc": _nvcc_version(),
        },
        "compiler": shutil.which("c++") or shutil.which("g++"),
        "kernels": _backend.status(build=build),
    }


def run(args: argparse.Namespace) -> int:
    emit({"env": collect(build=args.build)})
    return 0
