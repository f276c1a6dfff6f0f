"""``plan_auto_wrap``: no FSDP2 unit nests around a module Accelerate shards on its own afterwards.

Accelerate 1.15's ``fsdp2_prepare_model`` shards the auto-wrap units, then the input embedding,
then [final norm, output embedding]. The expectations below are written from the model's module
tree (which class contains the input embedding), not from the code under test. The 2-process runs
that crashed before the rule are in ``tests/e2e/test_qsdp_bert_wrap.py``.
"""

from __future__ import annotations

import pytest
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2LMHeadModel

from qaccel import QSDPPlugin
from qaccel.integration._qsdp import plan_auto_wrap

BERT = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 32, "max_position_embeddings": 16}
GPT2 = {"vocab_size": 64, "n_embd": 16, "n_layer": 2, "n_head": 2, "n_positions": 16}


@pytest.fixture(autouse=True)
def _no_fsdp_env(monkeypatch):
    for name in ("FSDP_TRANSFORMER_CLS_TO_WRAP", "FSDP_AUTO_WRAP_POLICY", "FSDP_MIN_NUM_PARAMS", "FSDP_VERSION"):
        monkeypatch.delenv(name, raising=False)


def bert():
    return BertForSequenceClassification(BertConfig(**BERT, num_labels=2))


def gpt2():
    return GPT2LMHeadModel(GPT2Config(**GPT2))


@pytest.mark.parametrize("plugin_cls", [QSDPPlugin, FullyShardedDataParallelPlugin], ids=["qsdp", "stock"])
def test_default_list_drops_the_class_around_the_input_embedding(plugin_cls):
    model = bert()
    assert set(model._no_split_modules) == {"BertEmbeddings", "BertLayer"}
    assert model.get_input_embeddings() is model.bert.embeddings.word_embeddings  # inside BertEmbeddings
    plugin = plugin_cls(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    dropped = plan_auto_wrap(plugin, model)
    assert dropped == {"BertEmbeddings": "bert.embeddings.word_embeddings"}
    assert plugin.transformer_cls_names_to_wrap == ["BertLayer"]
    # What Accelerate then resolves from the plugin: BertLayer units only.
    plugin.set_auto_wrap_policy(model)
    assert {cls.__name__ for cls in plugin.auto_wrap_policy.keywords["transformer_layer_cls"]} == {"BertLayer"}


@pytest.mark.parametrize(("build", "names"), [(bert, ["BertLayer"]), (gpt2, ["GPT2Block"]), (gpt2, None)], ids=["bert-named", "gpt2-named", "gpt2-default"])
def test_block_wraps_stay_as_they_are(build, names):
    plugin = QSDPPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=names)
    assert plan_auto_wrap(plugin, build()) == {}
    assert plugin.transformer_cls_names_to_wrap == names  # untouched, also when left to Accelerate's default


def test_explicit_class_around_the_input_embedding_is_refused(monkeypatch):
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "BertEmbeddings,BertLayer")
    plugin = QSDPPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap")
    with pytest.raises(ValueError, match=r"from FSDP_TRANSFORMER_CLS_TO_WRAP\): BertEmbeddings \(bert.embeddings\) contains bert.embeddings.word_embeddings"):
        plan_auto_wrap(plugin, bert())


def test_explicit_class_around_the_tied_gpt2_tail_is_refused():
    # GPT2Model holds ln_f (the final norm) and wte, which is tied to lm_head: both are carved out.
    plugin = QSDPPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Model"])
    with pytest.raises(ValueError, match=r"from the FSDP plugin\): GPT2Model \(transformer\) contains transformer\.(wte|ln_f)"):
        plan_auto_wrap(plugin, gpt2())


def test_size_based_unit_around_the_input_embedding_is_refused():
    model = bert()
    embedding = model.bert.embeddings.word_embeddings.weight.numel()
    plugin = QSDPPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=embedding)  # the embedding stays below
    with pytest.raises(ValueError, match=r"min_num_params=\d+ \(size-based auto-wrap\): bert \(\d+ parameters\) would be a unit around bert.embeddings.word_embeddings"):
        plan_auto_wrap(plugin, model)
    # Below the embedding's size the embedding is a unit itself, which Accelerate then skips: allowed.
    small = QSDPPlugin(fsdp_version=2, auto_wrap_policy="size_based_wrap", min_num_params=1)
    assert plan_auto_wrap(small, model) == {}
