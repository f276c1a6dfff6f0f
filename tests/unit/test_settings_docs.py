"""docs/train.md's tables of `--qsdp_*` / `--zoadam_*` / `--diloco_*` flags are the config fields' own help, as the CLI shows it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qaccel._settings import field_help, field_names, flags_markdown
from qaccel.fsdp import QSDPConfig
from qaccel.optim.config import OneBitAdamConfig, ZeroOneAdamConfig
from qaccel.optim.diloco_config import DiLoCoConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "train.md"
TABLES = {
    "qsdp": ("qsdp_", (QSDPConfig,)),
    "zoadam": ("zoadam_", (ZeroOneAdamConfig, OneBitAdamConfig)),
    "diloco": ("diloco_", (DiLoCoConfig,)),
}


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_documented_flags_are_the_generated_ones(name):
    prefix, classes = TABLES[name]
    match = re.search(rf"<!-- flags:{name} -->\n(.*?)<!-- /flags:{name} -->", DOC.read_text(), re.S)
    assert match, f"docs/train.md lacks the <!-- flags:{name} --> block"
    assert match.group(1) == flags_markdown(prefix, *classes), f"regenerate with qaccel._settings.flags_markdown({prefix!r}, ...)"


@pytest.mark.parametrize("name", sorted(TABLES))
def test_every_field_is_a_row_with_its_help(name):
    # independent of flags_markdown: read the rows back and compare with the dataclass fields
    prefix, classes = TABLES[name]
    rows = dict(re.findall(rf"^\| `--{prefix}(\w+)` \| `[^`]+` \| (.+) \|$", flags_markdown(prefix, *classes), re.M))
    assert list(rows) == list(field_names(*classes))
    for field in rows:
        owner = next(cls for cls in classes if field in field_names(cls))
        assert rows[field].startswith(field_help(owner, field).replace("|", "/")) and field_help(owner, field)
