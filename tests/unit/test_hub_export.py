"""``export_checkpoint`` on single-process checkpoints: the layouts the 2-rank tests do not produce.

The multi-process tests (``tests/dist/test_export_checkpoints.py``) cover FSDP2's sharded DCP and
DDP's ``model.safetensors``; here a tiny GPT-2 is written the way Accelerate writes an FSDP2 full
state dict (``pytorch_model_fsdp.bin``) or a non-safe DDP checkpoint (``pytorch_model.bin``), and in
bf16. The oracle is the original model: its state dict and its logits.
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from qaccel._extras import MissingExtraError
from qaccel.checkpoint import CheckpointError, build_run_state, save_checkpoint_metadata, write_manifest
from qaccel.hub import export_checkpoint

TINY = {"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 16}


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**TINY)).eval()


def _checkpoint(folder, model, weights_file: str | None, dtype=torch.float32):
    folder.mkdir()
    state = {k: v.to(dtype) for k, v in model.state_dict().items()}
    if weights_file == "model.safetensors":
        state.pop("lm_head.weight")  # tied to the embedding; Accelerate leaves it out of safetensors too
        save_file(state, str(folder / weights_file), metadata={"format": "pt"})
    elif weights_file is not None:
        torch.save(state, folder / weights_file)
    run_state = build_run_state(method="none", method_config={"parallelism": "fsdp2"}, recipe=None, task="causal-lm",
                                step=5, world_size=1, wire_bytes_total=0)  # fmt: skip
    save_checkpoint_metadata(folder, run_state=run_state, model_config=model.config)
    write_manifest(folder)  # complete, as save_checkpoint leaves it
    return folder


def _relist(ckpt):
    """Rewrite the manifest after damage done on purpose.

    The manifest check would name the damaged file first (tested below); rewriting it reaches the
    checks behind it, which also hold when the writer itself manifested a bad file.
    """
    write_manifest(ckpt)


def _logits(model) -> torch.Tensor:
    tokens = torch.randint(0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


@pytest.mark.parametrize("weights_file", ["pytorch_model_fsdp.bin", "pytorch_model.bin"])
def test_torch_save_layouts_export_exactly(weights_file, model, tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoint-5", model, weights_file)
    loaded = AutoModelForCausalLM.from_pretrained(str(export_checkpoint(ckpt, tmp_path / "out")))
    for key, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], tensor), key
    torch.testing.assert_close(_logits(loaded), _logits(model), rtol=0, atol=0)


def test_bf16_weights_stay_bf16(model, tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoint-5", model, "model.safetensors", dtype=torch.bfloat16)
    out = export_checkpoint(ckpt, tmp_path / "out")
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        dtypes = {fh.get_tensor(key).dtype for key in fh.keys()}
        assert fh.metadata()["qaccel_method"] == "none"
    assert dtypes == {torch.bfloat16}
    loaded = AutoModelForCausalLM.from_pretrained(str(out))
    assert torch.equal(loaded.transformer.wte.weight, model.transformer.wte.weight.to(torch.bfloat16))
    assert "Full precision (bfloat16)" in (out / "README.md").read_text()


def _no_partial(out):
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_unreadable_or_missing_weights_are_named(model, tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoint-5", model, "pytorch_model.bin")
    path = ckpt / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:1000])
    _relist(ckpt)
    with pytest.raises(ValueError, match=r"pytorch_model.bin: unreadable .* truncated or corrupted"):
        export_checkpoint(ckpt, tmp_path / "out")
    _no_partial(tmp_path / "out")
    path.unlink()
    _relist(ckpt)
    with pytest.raises(FileNotFoundError, match=r"no model weights found \(looked for pytorch_model_fsdp_0/, pytorch_model_fsdp.bin"):
        export_checkpoint(ckpt, tmp_path / "out")
    (ckpt / "pytorch_model_fsdp_0_rank0.bin").write_bytes(b"x")
    _relist(ckpt)
    with pytest.raises(NotImplementedError, match="saved without DCP"):
        export_checkpoint(ckpt, tmp_path / "out")
    _no_partial(tmp_path / "out")


def test_missing_model_config_and_bad_out_dir(model, tmp_path):
    ckpt = _checkpoint(tmp_path / "checkpoint-5", model, "pytorch_model.bin")
    with pytest.raises(ValueError, match="lies inside the checkpoint"):
        export_checkpoint(ckpt, ckpt / "export")
    with pytest.raises(ValueError, match="is, contains or lies inside the checkpoint"):
        export_checkpoint(ckpt, tmp_path, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not a folder"):
        export_checkpoint(ckpt, tmp_path / "file")
    for item in (ckpt / "hf_model").iterdir():
        item.unlink()
    (ckpt / "hf_model").rmdir()
    _relist(ckpt)
    with pytest.raises(FileNotFoundError, match=r"hf_model: not found; the checkpoint lacks the model config"):
        export_checkpoint(ckpt, tmp_path / "out")
    _no_partial(tmp_path / "out")


def test_bnb_without_bitsandbytes_is_a_clear_error(model, tmp_path, monkeypatch):
    ckpt = _checkpoint(tmp_path / "checkpoint-5", model, "pytorch_model.bin")
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # import fails as if it were not installed
    with pytest.raises(MissingExtraError, match=r"--bnb nf4 needs bitsandbytes, from the 'bnb' extra: pip install 'bitsandbytes>=[0-9.]+'"):
        export_checkpoint(ckpt, tmp_path / "out", bnb="nf4")
    _no_partial(tmp_path / "out")


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01  # same size, other content
    path.write_bytes(bytes(data))


# The manifest check export shares with resume: same function, same errors, before anything is read.
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda c: (c / "pytorch_model.bin").write_bytes((c / "pytorch_model.bin").read_bytes()[:-7]),
         r"file pytorch_model\.bin has \d+ bytes, the manifest says \d+ \(truncated or replaced\)"),
        (lambda c: _flip_last_byte(c / "hf_model" / "config.json"),
         r"file hf_model/config\.json does not match its SHA-256 in the manifest"),
        (lambda c: (c / "qaccel_state.json").unlink(), r"file qaccel_state\.json is listed in the manifest but missing"),
        (lambda c: (c / "extra.pt").write_bytes(b"x"), r"files not in the manifest: extra\.pt"),
        (lambda c: (c / "manifest.json").unlink(), r"no manifest\.json; not a complete qaccel checkpoint"),
    ],
    ids=["truncated", "altered", "missing", "unlisted", "no-manifest"],
)
def test_export_refuses_what_resume_refuses_naming_the_file(damage, message, model, tmp_path, capsys):
    import re

    from qaccel.checkpoint import verify_checkpoint
    from qaccel.cli import main

    ckpt = _checkpoint(tmp_path / "checkpoint-5", model, "pytorch_model.bin")
    damage(ckpt)
    with pytest.raises(CheckpointError, match=message) as resumed:
        verify_checkpoint(ckpt)  # what resume calls
    with pytest.raises(CheckpointError, match=message) as exported:
        export_checkpoint(ckpt, tmp_path / "out")
    assert str(exported.value) == str(resumed.value)
    _no_partial(tmp_path / "out")
    capsys.readouterr()
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 1  # the CLI reports it and creates nothing
    assert re.search(message, capsys.readouterr().err)
    _no_partial(tmp_path / "out")
