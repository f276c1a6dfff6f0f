"""Files qaccel publishes get the mode the user's umask gives a new file, whoever wrote them.

safetensors >= 0.8 writes ``model.safetensors`` through a temporary file of mode 0600
(safetensors/safetensors#782); before the fix an export or checkpoint held a 0600
``model.safetensors`` next to 0644 files. The oracle is ``0o666 & ~umask``, with the umask set by the
test itself (and restored afterwards).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from qaccel.checkpoint import (
    atomic_write_json,
    build_run_state,
    current_umask,
    install_dir,
    save_checkpoint,
    save_checkpoint_metadata,
    staging_dir,
)
from qaccel.hub import export_checkpoint
from qaccel.training import MetricsLog

pytestmark = pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16, "bos_token_id": 0, "eos_token_id": 0}


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request):
    previous = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(previous)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()}


def _checkpoint(output_dir: Path) -> Path:
    from qaccel.integration import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = GPT2LMHeadModel(GPT2Config(**TINY))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    run_state = build_run_state(method="none", method_config={"parallelism": "ddp"}, recipe=None, task="causal-lm",
                                step=1, world_size=1, wire_bytes_total=0)  # fmt: skip

    def write_extra(folder: Path) -> None:
        save_checkpoint_metadata(folder, run_state=run_state, model_config=accelerator.unwrap_model(model).config)

    return save_checkpoint(accelerator, output_dir, 1, write_extra)


def test_the_umask_is_read_without_changing_it(umask):
    assert current_umask() == umask
    assert os.umask(umask) == umask  # still in force after reading


def test_checkpoint_metrics_and_full_precision_export(umask, tmp_path):
    expected = 0o666 & ~umask
    ckpt = _checkpoint(tmp_path / "run")
    assert "model.safetensors" in _modes(ckpt)  # Accelerate's save_state, written by safetensors
    log = MetricsLog(tmp_path / "run" / "metrics.jsonl", enabled=True)
    log.write({"step": 1, "loss": 1.0})
    out = export_checkpoint(ckpt, tmp_path / "export")
    for root in (ckpt, out):
        modes = _modes(root)
        assert modes and {name: mode for name, mode in modes.items() if mode != expected} == {}, oct(expected)
    assert stat.S_IMODE((tmp_path / "run" / "metrics.jsonl").stat().st_mode) == expected


@pytest.mark.parametrize("bnb", ["int8", "nf4"])
def test_bitsandbytes_exports(bnb, umask, tmp_path):
    pytest.importorskip("bitsandbytes")
    expected = 0o666 & ~umask
    out = export_checkpoint(_checkpoint(tmp_path / "run"), tmp_path / f"export-{bnb}", bnb=bnb)
    modes = _modes(out)
    assert "model.safetensors" in modes and {name: mode for name, mode in modes.items() if mode != expected} == {}


def test_a_private_file_in_a_staged_folder_is_published_with_the_umask_mode(umask, tmp_path):
    staged = staging_dir(tmp_path / "folder", "test")
    private = staged / "weights.bin"
    private.write_bytes(b"x")
    private.chmod(0o600)  # as safetensors' temporary file leaves it
    atomic_write_json(staged / "meta.json", {"a": 1})
    install_dir(staged, tmp_path / "folder")
    assert _modes(tmp_path / "folder") == {"weights.bin": 0o666 & ~umask, "meta.json": 0o666 & ~umask}
