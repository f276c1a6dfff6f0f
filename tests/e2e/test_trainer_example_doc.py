"""The ``qaccel.Trainer`` example users copy from ``docs/trainer.md`` (no script ships for it): every command
the page shows for it parses, and its first command trains under ``torchrun`` on 2 CPU processes.

The script is taken from the page's "A runnable example" section and written to a temporary folder
under the name the page gives it, so the test runs exactly what a reader copies. References, never
the script's own claims: torch's own ``torchrun`` parser for the commands, and for the run the
data's two bounds (a uniform guess over the 64 tokens has loss ln 64 = 4.16; the bigram chain's best
is ln 4 = 1.39).
"""

from __future__ import annotations

import importlib.util
import math
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests._launch import REPO, free_port, run_job

DOC = REPO / "docs" / "trainer.md"
SCRIPT_NAME = "trainer_example.py"
SECTION = "### A runnable example"


def _section() -> str:
    text = DOC.read_text(encoding="utf-8")
    assert SECTION in text, f"docs/trainer.md has no {SECTION!r} section"
    body = text.split(SECTION, 1)[1]
    return re.split(r"^#{2,3} ", body, maxsplit=1, flags=re.M)[0]


def _script() -> str:
    blocks = re.findall(r"^```python\n(.*?)^```", _section(), flags=re.M | re.S)
    assert len(blocks) == 1, f"{SECTION}: expected one python block, found {len(blocks)}"
    return blocks[0]


def _commands() -> list[str]:
    """Every ``torchrun ... trainer_example.py ...`` line of the section: its bash block and the script's docstring."""
    lines = [line.strip() for line in _section().splitlines()]
    return list(dict.fromkeys(line for line in lines if line.startswith("torchrun ") and SCRIPT_NAME in line))


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("example") / SCRIPT_NAME
    path.write_text(_script(), encoding="utf-8")
    return path


def test_the_section_shows_the_runs_and_the_methods():
    commands = _commands()
    assert len(commands) >= 4, commands  # the bash block's and the docstring's
    methods = {shlex.split(c)[shlex.split(c).index("--method") + 1] for c in commands}
    assert {"qsdp", "zoadam"} <= methods


@pytest.mark.parametrize("command", _commands())
def test_every_command_parses(command, example):
    from torch.distributed.run import get_args_parser

    spec = importlib.util.spec_from_file_location("doc_trainer_example", example)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # its imports resolve against the installed qaccel
    launch = get_args_parser().parse_args(shlex.split(command)[1:])
    assert launch.training_script == SCRIPT_NAME and launch.nproc_per_node == "2"
    options = module.parse_args(launch.training_script_args)  # argparse exits 2 on a flag the script lacks
    assert options.method in ("qsdp", "zoadam", "onebit", "adamw")


def test_the_first_command_trains_with_qsdp(example):
    command = _commands()[0]
    words = shlex.split(command)
    assert words[:3] == ["torchrun", "--nproc_per_node", "2"] and "qsdp" in words, command
    # the page's command with torch's launcher module and a free port, run where the reader saved the file
    cmd = [sys.executable, "-m", "torch.distributed.run", "--master_port", str(free_port()), *words[1:]]
    proc = run_job(cmd, cwd=example.parent, TRANSFORMERS_OFFLINE="1")
    steps = int(words[words.index("--steps") + 1])
    match = re.search(r"^qsdp: loss ([\d.]+) at step (\d+); this rank sent ([\d,]+) bytes", proc.stdout, flags=re.M)
    assert match, proc.stdout[-3000:]
    loss, step, sent = float(match.group(1)), int(match.group(2)), int(match.group(3).replace(",", ""))
    assert step == steps
    assert math.log(4) < loss < math.log(64) - 1.0, loss  # learnt well past a uniform guess, never below the data's floor
    assert sent > 0  # QSDP's collectives ran and were counted
