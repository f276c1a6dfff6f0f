"""Every command-line flag qaccel's messages, help and docstrings suggest (``--word_word``) exists.

A flag in a string literal of ``qaccel/**/*.py`` must be an option of a parser that would receive it:
``qaccel.train``'s, any ``qaccel`` subcommand's (``qaccel.cli.build_parser``, nested ones too),
``accelerate launch``'s or ``torchrun``'s. A failure names the file, the line and the flag.
"""

from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# --word_word, not part of a longer token (--local-dir and other dashed flags of other tools are not ours)
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+(?![\w-])")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


class _Built(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    from accelerate.commands.launch import launch_command_parser
    from torch.distributed.run import get_args_parser

    from qaccel import _errors, train
    from qaccel.cli import build_parser

    def capture(self, *args, **kwargs):
        raise _Built(self)

    with pytest.MonkeyPatch.context() as patch:  # take the parser qaccel.train.parse_args builds, unparsed
        patch.setattr(_errors.ArgumentParser, "parse_args", capture)
        with pytest.raises(_Built) as built:
            train.parse_args([])
    parsers = [built.value.parser, build_parser(), launch_command_parser(), get_args_parser()]
    return set().union(*(_options(p) for p in parsers))


def suggested_flags(source: str) -> list[tuple[int, str]]:
    """``(line, flag)`` for every ``--word_word`` in a string literal of ``source``."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            for flag in dict.fromkeys(m.group(0) for m in FLAG.finditer(node.value)):
                # the line of the literal that holds it (a string may span lines)
                span = range(node.lineno, (node.end_lineno or node.lineno) + 1)
                line = next((n for n in span if flag in lines[n - 1]), node.lineno)
                found.append((line, flag))
    return found


def test_the_scan_finds_flags_in_messages_fstrings_and_docstrings():
    source = '"""Run with --max_steps 5."""\nraise ValueError(f"pass --tokenizer_name_or_path {x} (or `hf download --local-dir D`)")\n'
    assert suggested_flags(source) == [(1, "--max_steps"), (2, "--tokenizer_name_or_path")]


def test_every_flag_a_message_suggests_exists(known_flags):
    assert {"--max_steps", "--repo_id", "--qsdp_world_size", "--config_file", "--nproc_per_node"} <= known_flags
    checked, missing = 0, []
    for path in sorted((REPO / "qaccel").rglob("*.py")):
        for line, flag in suggested_flags(path.read_text(encoding="utf-8")):
            checked += 1
            if flag not in known_flags:
                missing.append(f"{path.relative_to(REPO)}:{line}: {flag}")
    assert checked > 100  # the scan reads the package's strings, not nothing
    assert not missing, "flags that no parser has:\n" + "\n".join(missing)
