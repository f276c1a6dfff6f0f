"""The settings core (``qaccel._settings._values`` / ``._kinds``): truth words, the structured error, field readers.

References: Accelerate's own ``str_to_bool`` (the core lists its words instead of importing it), the
standard library's module list, and messages written out by hand here.
"""

from __future__ import annotations

import ast
import dataclasses
import pickle
import sys
from pathlib import Path

import pytest
from accelerate.utils import str_to_bool

from qaccel._settings import (
    BOOL_WORDS,
    SettingError,
    SettingProblem,
    SettingTypeError,
    UnsupportedSetting,
    parse_bool,
)
from qaccel.fsdp import QSDPConfig
from qaccel.optim import ZeroOneAdamConfig

CORE = Path(__file__).resolve().parents[2] / "qaccel" / "_settings"
# Not truth words for Accelerate either; "none" and "" are words other fields of ours read.
BAD_WORDS = ["maybe", "2", "yess", "none", "", "oui", "ture", "10", "-1", "nope"]


def _accelerate(word: str) -> bool | None:
    try:
        return bool(str_to_bool(word, to_bool=True))
    except ValueError:
        return None


def _ours(word: str) -> bool | None:
    try:
        return parse_bool(word, key="K")
    except ValueError:
        return None


@pytest.mark.parametrize("word", [*BOOL_WORDS, *(w.upper() for w in BOOL_WORDS), "On", "tRuE"])
def test_every_truth_word_reads_as_accelerate_reads_it(word):
    expected = _accelerate(word)
    assert expected is not None, f"{word!r} is no truth word for Accelerate"
    assert parse_bool(word, key="K") is expected


@pytest.mark.parametrize("word", BAD_WORDS)
def test_a_bad_word_is_refused_by_both(word):
    assert _accelerate(word) is None
    with pytest.raises(ValueError, match=rf"^K={word!r}: not a boolean; must be "):
        parse_bool(word, key="K")


def test_the_core_accepts_no_word_beyond_accelerates():
    # Every one- to five-letter spelling made of the letters in the words, plus digits: the two agree on all.
    letters = sorted(set("".join(BOOL_WORDS)))
    candidates = {*letters, *(a + b for a in letters for b in letters), *BOOL_WORDS, *BAD_WORDS, "fals", "truee"}
    disagree = [w for w in sorted(candidates) if _ours(w) != _accelerate(w)]
    assert disagree == []


def _imports(path: Path) -> list[tuple[int, str]]:
    """(relative level, module) of every import in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(0, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.level, node.module or ""))
    return found


@pytest.mark.parametrize("name", ["_values.py", "_kinds.py"])
def test_the_core_imports_the_standard_library_and_itself_only(name):
    for level, module in _imports(CORE / name):
        if level:
            assert level == 1 and module in ("_values", "_kinds"), (name, module)
        else:
            assert module.split(".")[0] in sys.stdlib_module_names | {"__future__"}, (name, module)


# -- the structured error ------------------------------------------------------------------------


def test_a_source_known_when_the_text_was_read_follows_the_value():
    err = SettingError("seed", "abc", "not an int", owner="Demo", source="QACCEL_DEMO_SEED")
    assert str(err) == "Demo.seed='abc' (from QACCEL_DEMO_SEED): not an int"


def test_a_source_added_afterwards_ends_the_message_and_keeps_the_fields():
    err = SettingError("seed", -1, "must be an int >= 0", owner="Demo")
    assert str(err) == "Demo.seed=-1: must be an int >= 0"
    sourced = err.with_source("recipe r.yaml, key demo.seed")
    assert str(sourced) == "Demo.seed=-1: must be an int >= 0 (from recipe r.yaml, key demo.seed)"
    assert (sourced.owner, sourced.key, sourced.value, sourced.allowed) == ("Demo", "seed", -1, "must be an int >= 0")
    assert type(sourced) is SettingError and err.source is None


def test_rules_about_several_settings_read_as_before():
    together = SettingError("a", "x", "no", owner="C", together_with="b='y'")
    assert str(together) == "C.a='x' with b='y': no"
    assert str(SettingError("a", allowed="needs b", owner="C")) == "C.a: needs b"


@pytest.mark.parametrize(
    ("cls", "builtin", "not_builtin"),
    [(SettingError, ValueError, TypeError), (SettingTypeError, TypeError, ValueError), (UnsupportedSetting, NotImplementedError, ValueError)],
)
def test_each_error_is_the_builtin_the_house_rules_name(cls, builtin, not_builtin):
    err = cls("k", 1, "bad", owner="C").with_source("ENV_K")
    assert isinstance(err, builtin) and isinstance(err, SettingProblem) and not isinstance(err, not_builtin)
    copy = pickle.loads(pickle.dumps(err))  # errors cross process boundaries in the distributed tests
    assert type(copy) is cls and str(copy) == str(err) == "C.k=1: bad (from ENV_K)"


# -- sources are added by key, not by reading messages --------------------------------------------


def test_a_cross_field_error_names_the_source_of_its_key():
    with pytest.raises(ValueError) as err:
        QSDPConfig.from_env({"QACCEL_QSDP_MASTER_WEIGHTS": "quantized"}, weight_rotation="hadamard")
    assert str(err.value).startswith("QSDPConfig.master_weights='quantized' with weight_rotation='hadamard': ")
    assert str(err.value).endswith(" (from QACCEL_QSDP_MASTER_WEIGHTS)")
    assert (err.value.key, err.value.source) == ("master_weights", "QACCEL_QSDP_MASTER_WEIGHTS")


def test_an_optimizer_config_error_keeps_its_type_and_names_the_variable():
    with pytest.raises(NotImplementedError, match=r"^ZeroOneAdamConfig\.amsgrad=True: must be False: AMSGrad is not supported \(from QACCEL_ZERO_ONE_ADAM_AMSGRAD\)$"):
        ZeroOneAdamConfig.from_env({"QACCEL_ZERO_ONE_ADAM_AMSGRAD": "yes"})
    with pytest.raises(TypeError, match=r"^ZeroOneAdamConfig\.overlap_comm=1: must be true or false \(from argument\)$"):
        ZeroOneAdamConfig.from_env({}, overlap_comm=1)


# -- values are read once, where they enter --------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "given", "stored"),
    [
        ("weight_bits", " 4 ", 4),
        ("grad_bits", "OFF", None),
        ("grad_bucket_size", "auto", None),
        ("grad_meta_dtype", "BFloat16", "bfloat16"),
        ("seed", "0x10", 16),
        ("rounding", " Nearest", "nearest"),
        ("grad_error_feedback", "on", "float32"),
        ("prefetch", "no", False),
    ],
)
def test_keyword_replace_dict_and_environment_store_the_same_value(field, given, stored):
    built = [
        QSDPConfig(**{field: given}),
        dataclasses.replace(QSDPConfig(), **{field: given}),
        QSDPConfig.from_dict({field: given}),
        QSDPConfig.from_env({f"QACCEL_QSDP_{field.upper()}": given}),
    ]
    for config in built:
        assert getattr(config, field) == stored and type(getattr(config, field)) is type(stored)
    assert built[0] == built[1] == built[2] == built[3]
