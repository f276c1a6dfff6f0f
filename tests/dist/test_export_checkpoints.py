"""``qaccel export`` on real training checkpoints from 2 gloo ranks.

Three runs, a few optimizer steps each, saved as training saves them: ``save_checkpoint`` (which
calls ``accelerator.save_state``) with ``save_checkpoint_metadata`` and a manifest:

- ``qsdp``: tiny GPT-2 under QSDP (FSDP2, ``SHARDED_STATE_DICT``: a torch DCP folder of two shards);
- ``zoadam``: tiny GPT-2 under DDP with ``ZeroOneAdam`` (``model.safetensors`` from the main process,
  without the tied ``lm_head.weight``);
- ``onebit``: tiny BERT for sequence classification under DDP with ``OneBitAdam``, with a tokenizer
  and a ``base_model`` (covers ``AutoModelForSequenceClassification`` and the card's ``base_model``).

The oracle is computed in the workers, independently of the export: rank 0's full-precision state
dict (``accelerator.get_state_dict``) loaded into a plain, unsharded transformers model, and that
model's logits on a fixed batch. (Under QSDP the sharded model's own forward sees 8-bit weights, so
the reference is the plain model, not the training forward.)
"""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests._dist import run_ranks

GPT2 = {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32}
BERT = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128,
        "max_position_embeddings": 32, "num_labels": 3}  # fmt: skip
BERT_BASE = "google/bert_uncased_L-2_H-128_A-2"  # recorded as the base model; nothing is downloaded
STEPS = 4
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def _tokenizer():
    """A word-level BERT-style tokenizer built offline (vocabulary: specials + w0..w90)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + [f"w{i}" for i in range(BERT["vocab_size"] - len(SPECIAL))])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")  # fmt: skip


def gpt2_batch() -> torch.Tensor:
    return torch.randint(0, GPT2["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1234))


def bert_batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(len(SPECIAL), BERT["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(4321))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _env(rank, world):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # fmt: skip


def _reference(model_cls, config, state: dict, inputs) -> torch.Tensor:
    model = model_cls(config)
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits if isinstance(inputs, dict) else model(input_ids=inputs).logits


def _finish(accelerator, model, ckpt, run_state, model_cls, inputs, tokenizer=None):
    """Save the checkpoint like training does and return rank 0's oracle (state dict and logits)."""
    from qaccel.checkpoint import save_checkpoint, save_checkpoint_metadata

    unwrapped = accelerator.unwrap_model(model)

    def write_extra(folder: Path) -> None:
        save_checkpoint_metadata(folder, run_state=run_state, model_config=unwrapped.config, tokenizer=tokenizer,
                                 generation_config=getattr(unwrapped, "generation_config", None))  # fmt: skip

    assert save_checkpoint(accelerator, Path(ckpt).parent, STEPS, write_extra) == Path(ckpt)
    written = {name: os.stat(Path(ckpt) / name).st_ino for name in ("qaccel_state.json", "hf_model")}
    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        write_extra(Path(ckpt))  # ranks other than 0 must return without writing (an atomic write makes a new inode)
    full = accelerator.get_state_dict(model)
    accelerator.wait_for_everyone()
    assert {name: os.stat(Path(ckpt) / name).st_ino for name in written} == written
    if not accelerator.is_main_process:
        return None
    state = {k: v.detach().clone() for k, v in full.items()}
    logits = _reference(model_cls, unwrapped.config, state, inputs)
    buffer = io.BytesIO()
    torch.save({"state": state, "logits": logits, "run_state": run_state}, buffer)
    return buffer.getvalue()


def _wire_bytes(accelerator) -> int:
    return int(accelerator.comm_stats()["total_sent_bytes"])


def _qsdp_worker(rank, world, ckpt):
    _env(rank, world)
    from transformers import GPT2Config, GPT2LMHeadModel

    from qaccel import Accelerator, QSDPPlugin
    from qaccel.checkpoint import build_run_state

    plugin = QSDPPlugin(weight_bits=8, grad_bits=4, auto_wrap_policy="transformer_based_wrap",
                        transformer_cls_names_to_wrap=["GPT2Block"], state_dict_type="SHARDED_STATE_DICT")  # fmt: skip
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(STEPS):
        tokens = torch.randint(0, GPT2["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
    run_state = build_run_state(
        method="qsdp", method_config=plugin.qsdp_config.to_dict(), recipe=None, task="causal-lm", step=STEPS,
        world_size=world, wire_bytes_total=_wire_bytes(accelerator), metrics={"eval_loss": 6.1, "eval_perplexity": 445.9},
        dataset="synthetic-bigram",
    )  # fmt: skip
    return _finish(accelerator, model, ckpt, run_state, GPT2LMHeadModel, gpt2_batch())


def _ddp_worker(rank, world, gpt_ckpt, bert_ckpt):
    _env(rank, world)
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from qaccel import Accelerator
    from qaccel.checkpoint import build_run_state
    from qaccel.optim import OneBitAdam, ZeroOneAdam

    results = {}
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**GPT2))
    optimizer = ZeroOneAdam(model.parameters(), lr=3e-3, var_freeze_step=2, var_update_scaler=1, local_step_scaler=2, local_step_clipper=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(STEPS):
        tokens = torch.randint(0, GPT2["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(100 * step + rank))
        accelerator.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad()
    run_state = build_run_state(
        method="zero_one_adam", method_config=optimizer.optimizer.config.to_dict(), recipe=None, task="causal-lm",
        step=STEPS, world_size=world, wire_bytes_total=_wire_bytes(accelerator), baseline_wire_bytes_total=10**7,
    )  # fmt: skip
    results["zoadam"] = _finish(accelerator, model, gpt_ckpt, run_state, GPT2LMHeadModel, gpt2_batch())

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(1)
    model = BertForSequenceClassification(BertConfig(**BERT))
    optimizer = OneBitAdam(model.parameters(), lr=3e-3, freeze_step=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(len(SPECIAL), BERT["vocab_size"], (4, 12), generator=gen)
        labels = torch.randint(0, BERT["num_labels"], (4,), generator=gen)
        accelerator.backward(model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=labels).loss)
        optimizer.step()
        optimizer.zero_grad()
    run_state = build_run_state(
        method="onebit_adam", method_config=optimizer.optimizer.config.to_dict(), recipe=None,
        task="sequence-classification", step=STEPS, world_size=world, wire_bytes_total=_wire_bytes(accelerator),
        metrics={"eval_loss": 1.05, "eval_accuracy": 0.5}, base_model=BERT_BASE, dataset="glue",
    )  # fmt: skip
    results["onebit"] = _finish(accelerator, model, bert_ckpt, run_state, BertForSequenceClassification, bert_batch(), _tokenizer())
    return results


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """name -> {"ckpt": Path, "state": full state dict, "logits": reference logits, "run_state": dict}."""
    root = tmp_path_factory.mktemp("export_ckpts")
    runs = {"qsdp": root / "qsdp" / "checkpoint-4", "zoadam": root / "zoadam" / "checkpoint-4", "onebit": root / "onebit" / "checkpoint-4"}
    qsdp = run_ranks(_qsdp_worker, 2, root, str(runs["qsdp"]), timeout_s=400)[0]
    ddp = run_ranks(_ddp_worker, 2, root, str(runs["zoadam"]), str(runs["onebit"]), timeout_s=400)[0]
    payloads = {"qsdp": qsdp, "zoadam": ddp["zoadam"], "onebit": ddp["onebit"]}
    return {name: {"ckpt": runs[name], **torch.load(io.BytesIO(payloads[name]))} for name in runs}


@pytest.fixture(scope="module")
def exported(trained, tmp_path_factory):
    """Export each (run, bnb) once for the whole module."""
    from qaccel.hub import export_checkpoint

    root = tmp_path_factory.mktemp("exports")
    cache: dict[tuple[str, str | None], Path] = {}

    def get(name: str, bnb: str | None = None) -> Path:
        if (name, bnb) not in cache:
            cache[name, bnb] = export_checkpoint(trained[name]["ckpt"], root / f"{name}-{bnb or 'fp'}", bnb=bnb)
        return cache[name, bnb]

    return get


@pytest.fixture
def offline(monkeypatch):
    """Any Hub request raises: from_pretrained must work from the folder alone."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def _load(folder: Path, name: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if name == "onebit" else AutoModelForCausalLM
    return auto.from_pretrained(str(folder))


def _unrelated(name: str):
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(999)
    model = BertForSequenceClassification(BertConfig(**BERT)) if name == "onebit" else GPT2LMHeadModel(GPT2Config(**GPT2))
    return model.eval()


def _logits(model, name: str) -> torch.Tensor:
    with torch.no_grad():
        return (model(**bert_batch()) if name == "onebit" else model(input_ids=gpt2_batch())).logits.float()


def test_checkpoints_have_the_expected_layout(trained):
    ckpt = trained["qsdp"]["ckpt"]
    assert sorted(p.name for p in (ckpt / "pytorch_model_fsdp_0").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert (trained["zoadam"]["ckpt"] / "model.safetensors").is_file()
    for name in trained:
        assert (trained[name]["ckpt"] / "qaccel_state.json").is_file() and (trained[name]["ckpt"] / "hf_model" / "config.json").is_file()
        assert not [p.name for p in trained[name]["ckpt"].iterdir() if p.name.startswith(".")]  # no staging leftovers


@pytest.mark.parametrize("name", ["qsdp", "zoadam", "onebit"])
def test_full_precision_export_reproduces_the_trained_model(name, trained, exported, offline):
    model = _load(exported(name), name)
    assert not model.training
    reference = trained[name]["state"]
    exported_state = model.state_dict()
    assert set(exported_state) == set(reference)
    for key, tensor in reference.items():
        assert torch.equal(exported_state[key], tensor), key  # the exact trained weights
    torch.testing.assert_close(_logits(model, name), trained[name]["logits"], rtol=1e-5, atol=1e-6)


def test_tokenizer_and_generation_config_travel_with_the_model(exported, offline):
    from transformers import AutoTokenizer, GenerationConfig

    text = "w1 w2 w17 unknownword w90"
    tokenizer = AutoTokenizer.from_pretrained(str(exported("onebit")))
    assert tokenizer(text)["input_ids"] == _tokenizer()(text)["input_ids"] == [2, 6, 7, 22, 1, 95, 3]
    assert not (exported("qsdp") / "tokenizer.json").exists()  # GPT-2 here had no tokenizer
    assert GenerationConfig.from_pretrained(str(exported("qsdp"))).eos_token_id == 50256


@pytest.mark.parametrize("name", ["qsdp", "zoadam", "onebit"])
def test_metadata_and_sidecar_record_the_run(name, trained, exported):
    from safetensors import safe_open

    run_state = trained[name]["run_state"]
    folder = exported(name)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["format"] == "pt"
    assert meta["qaccel_method"] == {"qsdp": "qsdp", "zoadam": "zero_one_adam", "onebit": "onebit_adam"}[name]
    assert json.loads(meta["qaccel_config"]) == run_state["method_config"]
    assert (meta["qaccel_recipe"], meta["qaccel_step"], meta["qaccel_bnb"]) == ("", str(STEPS), "none")
    assert int(meta["qaccel_wire_bytes_total"]) == run_state["wire_bytes_total"] > 0
    assert meta["qaccel_version"]
    sidecar = json.loads((folder / "qaccel_config.json").read_text())
    for key in ("qaccel_version", "qaccel_method", "qaccel_recipe", "qaccel_bnb"):
        assert sidecar[key] == meta[key]
    assert sidecar["qaccel_config"] == run_state["method_config"] and sidecar["qaccel_step"] == STEPS
    assert sidecar["results"]["metrics"] == run_state["metrics"]
    assert sidecar["run_state"] == run_state


def test_model_card_parses_and_describes_the_run(trained, exported):
    from huggingface_hub import ModelCard

    card = ModelCard.load(exported("onebit") / "README.md")
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-classification"
    assert card.data.tags == ["qaccel", "1-bit-adam"] and card.data.base_model == BERT_BASE and card.data.datasets == ["glue"]
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert results == trained["onebit"]["run_state"]["metrics"]
    assert "## How it was trained" in card.text and "1-bit Adam" in card.text

    card = ModelCard.load(exported("qsdp") / "README.md")
    assert card.data.tags == ["qaccel", "qsdp"] and card.data.base_model is None
    assert "| weights on the wire | 8-bit |" in card.text and "| gradients on the wire | 4-bit |" in card.text
    assert "AutoModelForCausalLM.from_pretrained" in card.text


# bitsandbytes on CPU; the bound is on max|logits - reference| relative to max|reference|.
# int8 (LLM.int8()) rounds each weight to 127 levels of its row's absmax and, in the matmul, each
# activation row to 127 levels of its own absmax (after a cast to fp16): a relative error of up to
# ~1/254 per factor, adding up over two blocks to a few percent of the output at most. Bound 10%
# (measured: 0.4% for GPT-2; 3.8% for the BERT classifier, whose three logits are small, so the same
# absolute error weighs more). nf4 keeps 16 levels per block of 64 weights, an error up to ~1/10 of
# the block absmax per weight (activations stay fp32): bound 25% (measured: 2.8%). A model of the
# same shape with other weights is 100-150% away, so the bounds still catch a wrong scale, a
# transposed Conv1D or lost weights.
BNB_BOUNDS = {"int8": 0.10, "nf4": 0.25}


@pytest.mark.parametrize(("name", "bnb"), [("qsdp", "int8"), ("qsdp", "nf4"), ("onebit", "int8")])
def test_bitsandbytes_export_stays_close_to_the_trained_model(name, bnb, trained, exported, offline):
    import bitsandbytes as bnb_lib
    from huggingface_hub import ModelCard
    from safetensors import safe_open

    folder = exported(name, bnb)
    model = _load(folder, name)
    quant = model.config.quantization_config
    quant = quant.to_dict() if hasattr(quant, "to_dict") else quant
    assert quant["quant_method"] == "bitsandbytes" and quant["load_in_8bit" if bnb == "int8" else "load_in_4bit"]
    layer_type = bnb_lib.nn.Linear8bitLt if bnb == "int8" else bnb_lib.nn.Linear4bit
    # Every linear layer of the blocks is quantized: GPT-2 has 4 per block (c_attn, c_proj, c_fc, c_proj),
    # BERT 6 per layer (query, key, value, attention output, intermediate, output).
    blocks, per_block = ("transformer.h.", 4 * GPT2["n_layer"]) if name == "qsdp" else ("bert.encoder.", 6 * BERT["num_hidden_layers"])
    assert sum(isinstance(m, layer_type) for n, m in model.named_modules() if n.startswith(blocks)) == per_block

    reference = trained[name]["logits"]
    logits = _logits(model, name)
    scale = reference.abs().max()
    error = (logits - reference).abs().max()
    assert error <= BNB_BOUNDS[bnb] * scale, (error, scale)
    assert error > 0  # the weights really are quantized
    # A model of the same shape with other random weights is much farther away than the bound.
    assert (_logits(_unrelated(name), name) - reference).abs().max() > 2 * BNB_BOUNDS[bnb] * scale

    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        assert fh.metadata()["qaccel_bnb"] == bnb and fh.metadata()["format"] == "pt"
    card = ModelCard.load(folder / "README.md")
    assert {"bitsandbytes", "8-bit" if bnb == "int8" else "4-bit"} <= set(card.data.tags)
    assert json.loads((folder / "qaccel_config.json").read_text())["qaccel_bnb"] == bnb


def _no_partial(out: Path) -> None:
    assert not out.exists()
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _copy(ckpt: Path, dest: Path) -> Path:
    shutil.copytree(ckpt, dest)
    return dest


def _relist(ckpt: Path) -> None:
    """Rewrite the manifest after damage done on purpose.

    The manifest check would name the damaged file first (tests/unit/test_hub_export.py); rewriting it
    reaches the checks behind it, which also hold when the writer itself manifested a bad file.
    """
    from qaccel.checkpoint import write_manifest

    write_manifest(ckpt)


def test_checkpoint_without_run_state_is_refused(trained, tmp_path):
    from qaccel.hub import export_checkpoint

    ckpt = _copy(trained["zoadam"]["ckpt"], tmp_path / "checkpoint-4")
    (ckpt / "qaccel_state.json").unlink()
    _relist(ckpt)
    out = tmp_path / "out"
    with pytest.raises(FileNotFoundError, match=r"qaccel_state\.json: not found; .* is not a qaccel training checkpoint"):
        export_checkpoint(ckpt, out)
    _no_partial(out)


@pytest.mark.parametrize(("name", "victim"), [("qsdp", "pytorch_model_fsdp_0/__1_0.distcp"), ("zoadam", "model.safetensors")])
def test_truncated_weights_are_named(name, victim, trained, tmp_path):
    from qaccel.hub import export_checkpoint

    ckpt = _copy(trained[name]["ckpt"], tmp_path / "checkpoint-4")
    path = ckpt / victim
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.truncate(size - 100)
    _relist(ckpt)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=rf"{path.name}: truncated: {size - 100} bytes"):
        export_checkpoint(ckpt, out)
    _no_partial(out)


def test_weights_that_do_not_match_the_config_leave_nothing(trained, tmp_path):
    from qaccel.hub import export_checkpoint

    ckpt = _copy(trained["qsdp"]["ckpt"], tmp_path / "checkpoint-4")
    config = json.loads((ckpt / "hf_model" / "config.json").read_text())
    (ckpt / "hf_model" / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    _relist(ckpt)
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=r"do not match GPT2LMHeadModel .* missing \['transformer\.h\.2\."):
        export_checkpoint(ckpt, out)  # fails after the staging folder exists
    _no_partial(out)


def test_bad_bnb_and_existing_out_are_refused(trained, exported, tmp_path):
    from qaccel.hub import export_checkpoint

    ckpt = trained["zoadam"]["ckpt"]
    with pytest.raises(ValueError, match=r"bnb='int4': must be one of \['int8', 'nf4'\]"):
        export_checkpoint(ckpt, tmp_path / "out", bnb="int4")
    _no_partial(tmp_path / "out")

    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        export_checkpoint(ckpt, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export_checkpoint(ckpt, out, overwrite=True)
    assert not (out / "keep.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in exported("zoadam").iterdir())


def test_cli_export(trained, tmp_path, capsys):
    from qaccel.cli import main

    ckpt = trained["zoadam"]["ckpt"]
    assert main(["export", str(ckpt), str(tmp_path / "out"), "--model_name", "org/tiny-gpt2"]) == 0
    report = json.loads(capsys.readouterr().out)["export"]
    assert report["files"] == ["README.md", "config.json", "generation_config.json", "model.safetensors", "qaccel_config.json"]
    assert 'from_pretrained("org/tiny-gpt2")' in (tmp_path / "out" / "README.md").read_text()

    assert main(["export", str(ckpt), str(tmp_path / "out2"), "--bnb", "int4"]) == 2  # argparse usage error
    assert "invalid choice: 'int4'" in capsys.readouterr().err
    _no_partial(tmp_path / "out2")

    assert main(["export", str(tmp_path / "out"), str(tmp_path / "out3")]) == 1  # an export is not a checkpoint
    err = capsys.readouterr().err
    assert err.startswith("qaccel export: ") and "qaccel_state.json: not found" in err
    _no_partial(tmp_path / "out3")
