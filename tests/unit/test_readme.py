"""The README stays short and every command, link and import it shows is real.

Commands are checked against the parsers that would run them (``qaccel``'s own, the training
loop's, ``accelerate launch``'s and ``torchrun``'s), the Makefile's targets and pyproject's extras;
nothing is trained. The snippet that opens the README is run under torchrun by
``tests/e2e/test_readme_snippet.py``.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import io
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MAX_LINES = 300
SNIPPET_FILE = "train.py"  # the README runs its opening snippet as `torchrun ... train.py`
LAUNCHERS = ("qaccel", "make", "python", "torchrun", "accelerate", "pip")


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _fenced(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", _text(), flags=re.M | re.S)


def _prose() -> str:
    """The README without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", _text(), flags=re.M | re.S)


def readme_commands() -> list[str]:
    """Every shell command the README shows: lines of bash blocks, and inline code spans that start with a launcher
    and carry arguments (``make demo``, ``qaccel bench comm --only qsdp``)."""
    commands = []
    for block in _fenced("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                commands.append(line.strip())
    for span in re.findall(r"`([^`\n]+)`", _prose()):
        words = span.split()
        if words and words[0] in LAUNCHERS and (len(words) > 2 or (len(words) == 2 and words[0] in ("make", "pip", "python"))):
            commands.append(span)
    return list(dict.fromkeys(commands))


def readme_named_commands() -> list[str]:
    """Inline ``qaccel <sub>`` / ``accelerate launch`` spans: the prose names a command without arguments."""
    return [span for span in re.findall(r"`([^`\n]+)`", _prose()) if re.fullmatch(r"(qaccel|accelerate) [a-z_]+", span)]


def snippet(version: str) -> str:
    """The opening diff as the file before (``-`` lines) or after (``+`` lines) the switch."""
    (diff,) = _fenced("diff")
    drop = "+" if version == "before" else "-"
    return "".join(line[1:] + "\n" for line in diff.splitlines() if line[:1] in ("", " ", "+", "-") and line[:1] != drop)


def _parse(parse: Callable[[list[str]], object], argv: list[str], command: str) -> object:
    """Run an argparse entry point; a usage error fails the test with argparse's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv)
    except SystemExit as exc:  # a stock argparse parser prints its message and exits
        pytest.fail(f"README command `{command}`: {' '.join(argv)!r} is refused (exit {exc.code}): {err.getvalue().strip()}")
    except ValueError as exc:  # qaccel's parsers raise UsageError (a ValueError) instead
        pytest.fail(f"README command `{command}`: {' '.join(argv)!r} is refused: {exc}")


def _train_args(argv: list[str], command: str) -> None:
    from qaccel.train import parse_args
    from qaccel.zoo import load_recipe

    args = _parse(parse_args, argv, command)
    if args.recipe is not None:  # without one: your model + your data (parse_args checks that all are given)
        load_recipe(args.recipe)  # raises, naming the recipe, when the README names one that does not exist


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"readme_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_qaccel(argv: list[str], command: str) -> None:
    from qaccel.cli import build_parser

    args, extra = _parse(build_parser().parse_known_args, argv, command)
    if args.command == "configs" and args.path is not None:
        from qaccel._resources import launch_config_path

        assert launch_config_path(args.path).is_file(), f"`{command}`: no launch config {args.path!r}"
    if extra and not getattr(args, "accepts_extra_args", False):
        pytest.fail(f"README command `{command}`: qaccel {args.command} does not accept {extra}")
    if args.command == "train":  # its other flags go to the training loop
        _train_args([*(["--recipe", args.recipe] if args.recipe else []), *extra], command)


def _check_script(script: str, script_args: list[str], is_module: bool, command: str) -> None:
    if is_module:
        assert script == "qaccel.train", f"`{command}`: unexpected module {script}"
        _train_args(script_args, command)
    elif script == SNIPPET_FILE:
        assert snippet("after").strip(), "the README runs train.py, its opening snippet, but shows none"
    else:
        path = REPO / script
        assert path.is_file(), f"`{command}`: {script} does not exist"
        module = _load_script(path)
        if hasattr(module, "parse_args"):
            _parse(module.parse_args, script_args, command)


def _resolve_substitutions(command: str) -> str:
    """Check each ``$(qaccel ...)`` and replace it by what it prints."""

    def replace(match: re.Match) -> str:
        inner = match.group(1)
        _check_qaccel(shlex.split(inner)[1:], inner)
        words = shlex.split(inner)
        if words[1:3] == ["configs", "--path"]:
            from qaccel._resources import launch_config_path

            return shlex.quote(str(launch_config_path(words[3])))
        pytest.fail(f"`{command}`: no check for the substitution $({inner})")

    return re.sub(r'"?\$\((qaccel [^)]*)\)"?', replace, command)


def check_command(command: str) -> None:
    words = shlex.split(_resolve_substitutions(command), comments=True)
    if words[:4] == ["sudo", "-E", "env", "PATH=$PATH"]:
        words = words[4:]
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value prefixes
        words = words[1:]
    head, argv = words[0], words[1:]
    if head == "qaccel":
        _check_qaccel(argv, command)
    elif head == "make":
        targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))
        missing = [t for t in argv if t not in targets]
        assert not missing, f"`{command}`: no Makefile target {missing} (targets: {sorted(targets)})"
    elif head == "pip":
        extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        for requirement in argv[1:]:
            match = re.fullmatch(r"qaccel(?:\[([\w,]+)\])?", requirement)
            assert match, f"`{command}`: installs {requirement!r}, not qaccel"
            unknown = set((match.group(1) or "").split(",")) - set(extras) - {""}
            assert not unknown, f"`{command}`: no extra {sorted(unknown)} in pyproject.toml (extras: {sorted(extras)})"
    elif head == "python":
        if argv[0] == "-m":
            _check_script(argv[1], argv[2:], True, command)
        else:
            _check_script(argv[0], argv[1:], False, command)
    elif head == "torchrun":
        from torch.distributed.run import get_args_parser

        args = _parse(get_args_parser().parse_args, argv, command)
        _check_script(args.training_script, args.training_script_args, args.module, command)
    elif head == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        assert argv[0] == "launch", f"`{command}`: only `accelerate launch` is checked"
        args = _parse(launch_command_parser().parse_args, argv[1:], command)
        assert Path(args.config_file).is_file(), f"`{command}`: launch config {args.config_file} does not exist"
        _check_script(args.training_script, args.training_script_args, args.module, command)
    else:
        pytest.fail(f"README command `{command}`: no check for {head!r}")


def test_readme_is_under_300_lines():
    lines = _text().count("\n")
    assert lines < MAX_LINES, f"README.md has {lines} lines; keep it under {MAX_LINES} (detail goes to docs/)"


def test_readme_opens_with_the_switch_within_the_first_screen():
    head = "\n".join(_text().splitlines()[:40])
    assert "+from qaccel import Accelerator, QSDPPlugin" in head


def test_readme_shows_commands():
    commands = readme_commands()
    # the two commands, and the flag style of the issue, must be among those checked
    assert "make demo" in commands and "make test" in commands
    assert any("--dry_run" in c for c in commands)


@pytest.mark.parametrize("command", readme_commands())
def test_readme_command_is_accepted(command):
    check_command(command)


@pytest.mark.parametrize("command", readme_named_commands())
def test_readme_named_command_exists(command):
    from qaccel.cli import build_parser

    head, sub = command.split()
    if head == "accelerate":
        assert sub == "launch", f"README names `{command}`"
        return
    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sub in subparsers.choices, f"README names `{command}`; qaccel has {sorted(subparsers.choices)}"


def test_a_wrong_flag_is_caught():
    # the checker itself must fail on what the README must not show (the old dash style, a made-up target)
    with pytest.raises(pytest.fail.Exception, match="dry-run"):
        check_command("qaccel push exports/x --repo_id a/b --dry-run")
    with pytest.raises(pytest.fail.Exception, match="max-steps"):
        check_command("torchrun --nproc_per_node 2 -m qaccel.train --recipe gpt2-tiny --output_dir x --max-steps 5")
    with pytest.raises(AssertionError, match="no Makefile target"):
        check_command("make demo-please")


def _linked_paths() -> list[str]:
    text = _text()
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
    blocks = [(f"python-block-{i}", block) for i, block in enumerate(_fenced("python"))]
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

