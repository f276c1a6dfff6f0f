"""The README stays short and every command, link and import it shows is real.

Commands are checked against the parsers that would run them (``qaccel``'s own, the training
loop's, ``accelerate launch``'s and ``torchrun``'s), the Makefile's targets and pyproject's extras,
by ``tests/_commands.py`` (which also says which commands may name repository files); nothing is
trained. The snippet that opens the README is run under torchrun by
``tests/e2e/test_readme_snippet.py``.
"""

from __future__ import annotations

import ast
import importlib
import re

import pytest

from tests._commands import ALL_LAUNCHERS, REPO, Command, check_command, check_named, markdown_commands, named_commands
from tests._readme import fenced_blocks, readme_text, snippet

MAX_LINES = 300
SNIPPET_FILE = "train.py"  # the README runs its opening snippet as `torchrun ... train.py`


def readme_commands() -> list[Command]:
    """Every shell command the README shows (``tests/_commands.py`` says what counts as one)."""
    return markdown_commands(readme_text(), ALL_LAUNCHERS)


def readme_named_commands() -> list[str]:
    """Inline ``qaccel <sub>`` / ``accelerate launch`` spans: the prose names a command without arguments."""
    return named_commands(readme_text())


def check_readme_command(command: Command) -> None:
    check_command(command.text, checkout=command.checkout, own_scripts={SNIPPET_FILE: snippet("after")})


def test_readme_is_under_300_lines():
    lines = readme_text().count("\n")
    assert lines < MAX_LINES, f"README.md has {lines} lines; keep it under {MAX_LINES} (detail goes to docs/)"


def test_readme_opens_with_the_switch_within_the_first_screen():
    head = "\n".join(readme_text().splitlines()[:40])
    assert "+from qaccel import Accelerator, QSDPPlugin" in head


def test_readme_shows_commands():
    commands = [command.text for command in readme_commands()]
    # the two commands, and the flag style of the issue, must be among those checked
    assert "make demo" in commands and "make test" in commands
    assert any("--dry_run" in c for c in commands)


@pytest.mark.parametrize("command", readme_commands(), ids=lambda command: command.text)
def test_readme_command_is_accepted(command):
    check_readme_command(command)


@pytest.mark.parametrize("command", readme_named_commands())
def test_readme_named_command_exists(command):
    check_named(command)


def test_a_wrong_flag_is_caught():
    # the checker itself must fail on what the README must not show (a misspelt flag, a repository path, a made-up target)
    with pytest.raises(pytest.fail.Exception, match="dryrun"):
        check_command("qaccel push exports/x --repo_id a/b --dryrun")
    with pytest.raises(pytest.fail.Exception, match="wheel user"):  # a repository path, not said to need a checkout
        check_command("accelerate launch --config_file launch_configs/cpu_2proc_qsdp.yaml -m qaccel.train --recipe gpt2-tiny --output_dir x")
    with pytest.raises(pytest.fail.Exception, match="maxsteps"):
        check_command("torchrun --nproc_per_node 2 -m qaccel.train --recipe gpt2-tiny --output_dir x --maxsteps 5")
    with pytest.raises(AssertionError, match="no Makefile target"):
        check_command("make demo-please")


def _linked_paths() -> list[str]:
    text = readme_text()
    links = [target for target in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+://", target)]
    spans = re.findall(r"`((?:docs|scripts|model_cards|launch_configs|qaccel|tests)/[^`\s<>*]+)`", text)
    return sorted(set(links) | set(spans))


@pytest.mark.parametrize("path", _linked_paths())
def test_readme_path_exists(path):
    assert (REPO / path.split("#")[0]).exists(), f"README.md names {path}, which does not exist"


def _imports(source: str) -> list[tuple[str, list[str]]]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.module, [alias.name for alias in node.names]))
    return found


def _python_sources() -> list:
    blocks = [(f"python-block-{i}", block) for i, block in enumerate(fenced_blocks("python"))]
    sources = [("diff-before", snippet("before")), ("diff-after", snippet("after")), *blocks]
    return [pytest.param(where, source, id=where) for where, source in sources]


@pytest.mark.parametrize(("where", "source"), _python_sources())
def test_readme_python_imports_resolve(where, source):
    imports = _imports(source)
    assert imports, f"{where}: no imports found"
    for module_name, names in imports:
        module = importlib.import_module(module_name)
        for name in names:
            assert hasattr(module, name), f"README {where}: `from {module_name} import {name}`: {module_name} has no {name}"


def test_the_switch_changes_only_the_accelerator_lines():
    before, after = snippet("before").splitlines(), snippet("after").splitlines()
    changed = [(b, a) for b, a in zip(before, after, strict=True) if b != a]
    assert len(changed) == 2 and all("Accelerator" in b and "Accelerator" in a for b, a in changed), changed

