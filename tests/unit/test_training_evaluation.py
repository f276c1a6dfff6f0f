"""evaluate_model against transformers' own losses on the whole eval set in one batch."""

import math

import torch
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertTokenizerFast,
    DataCollatorForLanguageModeling,
    GPT2Config,
    GPT2LMHeadModel,
)

from qaccel.training import evaluate_model


class SingleProcess:
    def gather_for_metrics(self, values):
        return values


class Accuracy:
    """A hand-count accuracy with evaluate's add_batch/compute interface."""

    def __init__(self):
        self.right = self.total = 0

    def add_batch(self, predictions, references):
        self.right += int((predictions == references).sum())
        self.total += len(references)

    def compute(self):
        return {"accuracy": self.right / self.total}


def test_causal_lm_loss_equals_the_token_mean_over_the_set():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=16)).eval()
    tokens = torch.randint(0, 64, (10, 16))
    loader = DataLoader([{"input_ids": t, "labels": t} for t in tokens], batch_size=3, collate_fn=lambda rows: {k: torch.stack([r[k] for r in rows]) for k in rows[0]})
    result = evaluate_model(SingleProcess(), model, loader, "causal-lm", seed=0)
    with torch.no_grad():
        reference = model(input_ids=tokens, labels=tokens).loss.item()
    assert math.isclose(result["eval_loss"], reference, rel_tol=1e-5)
    assert math.isclose(result["eval_perplexity"], math.exp(reference), rel_tol=1e-5)


def test_classification_accuracy_and_loss():
    torch.manual_seed(1)
    model = BertForSequenceClassification(BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, num_labels=3)).eval()
    ids = torch.randint(1, 50, (11, 8))
    labels = torch.randint(0, 3, (11,))
    rows = [{"input_ids": i, "attention_mask": torch.ones(8, dtype=torch.long), "labels": y} for i, y in zip(ids, labels, strict=True)]
    loader = DataLoader(rows, batch_size=4, collate_fn=lambda rs: {k: torch.stack([r[k] for r in rs]) for k in rs[0]})
    result = evaluate_model(SingleProcess(), model, loader, "sequence-classification", seed=0, metric=Accuracy())
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    assert result["eval_accuracy"] == int((logits.argmax(-1) == labels).sum()) / len(labels)
    assert math.isclose(result["eval_loss"], torch.nn.functional.cross_entropy(logits, labels).item(), rel_tol=1e-5)


def _wordpiece_tokenizer(tmp_path):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    return BertTokenizerFast(vocab_file=str(tmp_path / "vocab.txt"))


def test_masked_lm_evaluation_is_repeatable_and_leaves_the_training_rng_alone(tmp_path):
    torch.manual_seed(2)
    model = BertForMaskedLM(BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)).eval()
    rows = [{"input_ids": torch.randint(5, 40, (12,))} for _ in range(9)]
    collator = DataCollatorForLanguageModeling(_wordpiece_tokenizer(tmp_path), mlm=True, mlm_probability=0.3, return_tensors="pt")
    loader = DataLoader(rows, batch_size=4, collate_fn=collator)
    torch.manual_seed(123)
    before = torch.get_rng_state()
    first = evaluate_model(SingleProcess(), model, loader, "masked-lm", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    second = evaluate_model(SingleProcess(), model, loader, "masked-lm", seed=7)
    other_masks = evaluate_model(SingleProcess(), model, loader, "masked-lm", seed=8)
    assert first == second
    assert first != other_masks
