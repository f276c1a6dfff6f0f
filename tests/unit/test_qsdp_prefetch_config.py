"""``QSDPConfig.prefetch``: every accepted spelling, the environment variable, and what a resume may change."""

import pytest

from qaccel.fsdp import QSDPConfig
from qaccel.integration import QSDPPlugin


@pytest.mark.parametrize(("value", "expected"), [
    (True, True), (False, False), (1, True), (0, False),
    ("1", True), ("0", False), ("on", True), ("OFF", False), (" true ", True), ("no", False), ("yes", True),
])  # fmt: skip
def test_prefetch_spellings(value, expected):
    assert QSDPConfig(prefetch=value).prefetch is expected


def test_prefetch_is_on_by_default_and_read_from_the_environment():
    assert QSDPConfig().prefetch is True
    assert QSDPConfig.from_env({"QACCEL_QSDP_PREFETCH": "0"}).prefetch is False
    assert QSDPConfig.from_env({"QACCEL_QSDP_PREFETCH": "0"}, prefetch=True).prefetch is True  # argument wins


@pytest.mark.parametrize("value", ["maybe", 2, 0.5, None])
def test_bad_prefetch_values_name_the_field_and_the_allowed_words(value):
    with pytest.raises(ValueError, match=r"QSDPConfig.prefetch=.*must be True/False or one of 1, true, on, yes, 0, false, off, no"):
        QSDPConfig(prefetch=value)


def test_bad_prefetch_from_the_environment_names_the_variable():
    with pytest.raises(ValueError, match="QACCEL_QSDP_PREFETCH"):
        QSDPConfig.from_env({"QACCEL_QSDP_PREFETCH": "sometimes"})


def test_prefetch_is_not_a_difference_for_a_resume_but_bits_are():
    saved = QSDPConfig(prefetch=True)
    assert saved.differences(QSDPConfig(prefetch=False)) == {}
    assert set(saved.differences(QSDPConfig(prefetch=False, grad_bits=4))) == {"grad_bits"}
    assert QSDPConfig.from_dict(QSDPConfig(prefetch=False).to_dict()) == QSDPConfig(prefetch=False)


def test_plugin_keyword_reaches_the_config():
    assert QSDPPlugin(prefetch="off").qsdp_config.prefetch is False
