"""Find the shell commands a document shows and check each against the parser that would run it.

Shared by ``tests/unit/test_readme.py`` (README.md) and ``tests/unit/test_docs_commands.py``
(``docs/*.md`` and the comments of ``launch_configs/*.yaml``). Nothing is run or trained: each
command goes through ``qaccel``'s own parser, the training loop's, ``accelerate launch``'s or
``torchrun``'s, the Makefile's targets and pyproject's extras.

What counts as a command:

- every line of a ``bash`` block (``\\`` continuations joined; comment lines skipped) whose first
  word, after ``VAR=value`` prefixes, is one of the launchers asked for;
- an inline code span that starts with a launcher and carries arguments (``qaccel bench e2e --nodes
  2``, ``make demo``), unless it is a synopsis (a span holding ``...``, ``|``, ``<``, a ``[`` that
  opens a word as in ``[--overwrite]``, or an all-caps placeholder word such as ``NAME``, ``N``,
  ``ORG/NAME``: it describes a form, not a command to copy) or only names a command (``qaccel
  recipes``, ``torchrun --nproc_per_node 2``, ``python -m qaccel.train``: ``named_commands``);
- in a YAML file, a comment line that starts with a launcher (``#   accelerate launch ...``, ``\\``
  continuations joined), and the inline spans of its comments.

``$(qaccel ...)`` substitutions are checked and replaced by what they print; ``$VAR`` references get
a sample value from ``SAMPLE_ENV`` (an unknown one fails the check).

Paths a wheel user has (the rule behind ``checkout``): an installed wheel carries the package and,
inside it, ``model_cards/`` and ``launch_configs/``, but no repository files. So a command that runs a
script from the repository (``scripts/train.py``) or names a launch config by its repository path
(``launch_configs/x.yaml``; a wheel user writes ``"$(qaccel configs --path x)"`` or
``--launch_config x``) is accepted only where the text says it is about a checkout: the paragraph
that holds the command (an inline span), the paragraph right before its code block, or the
document's opening paragraph contains the word "checkout" or "clone". Launch config comments never
do (they ship in the wheel). ``make`` targets need a checkout by nature (the Makefile is one) and are
not held to this rule. A script named by a bare file name (``train.py``) is the reader's own file; a
document lists the ones it shows (``own_scripts``: name to source, the ``python`` block that names the
file, see ``shown_script``; a source that defines ``parse_args`` at the top level is executed, not
as ``__main__``, and that function checks the arguments; any other source is never executed), and
any other script must exist in the repository.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.util
import io
import re
import shlex
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib

__all__ = [
    "REPO",
    "ALL_LAUNCHERS",
    "QACCEL_LAUNCHERS",
    "SAMPLE_ENV",
    "Command",
    "markdown_commands",
    "yaml_comment_commands",
    "named_commands",
    "check_named",
    "shown_script",
    "check_command",
]

REPO = Path(__file__).resolve().parents[1]
ALL_LAUNCHERS = ("qaccel", "make", "python", "torchrun", "accelerate", "pip")
QACCEL_LAUNCHERS = ("qaccel", "python", "torchrun", "accelerate")  # what starts qaccel code
SAMPLE_ENV = {"RANK": "0", "MAIN_IP": "10.0.0.1", "PATH": "/usr/bin"}  # values for $VAR in commands
_CHECKOUT_WORDS = re.compile(r"\b(checkout|clone)\b", re.I)
_PLACEHOLDER = re.compile(r"^(?:--\w+=)?[A-Z][A-Z0-9_]*(?:/[A-Z][A-Z0-9_]*)?$")
_ENV_PREFIX = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")
_PIP_OPTIONS = {"-e", "--editable", "-U", "--upgrade", "--force-reinstall", "--no-deps", "--no-build-isolation", "--user"}


@dataclass(frozen=True)
class Command:
    """A command as a document shows it, and whether its text says it is about a checkout."""

    text: str
    checkout: bool


def _paragraphs(prose: str) -> list[str]:
    return [p for p in re.split(r"\n\s*\n", prose) if p.strip()]


def _opening_paragraph(text: str) -> str:
    """The first paragraph that is not a heading (the page's introduction)."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    return next((p for p in _paragraphs(prose) if not p.lstrip().startswith("#")), "")


def _strip_prefixes(words: list[str]) -> list[str]:
    """The command without ``sudo -E env`` and ``VAR=value`` prefixes."""
    if words[:3] == ["sudo", "-E", "env"]:
        words = words[3:]
    while words and _ENV_PREFIX.fullmatch(words[0]):
        words = words[1:]
    return words


def _launcher(words: list[str]) -> str | None:
    rest = _strip_prefixes(words)
    return rest[0] if rest else None


def _names_only(words: list[str]) -> bool:
    """A span that names a launcher, its flags or an entry point without showing a whole command."""
    if len(words) == 2 and words[0] in ("qaccel", "accelerate"):
        return True
    if words[:2] == ["python", "-m"] and len(words) == 3:
        return True
    launches = words[:1] == ["torchrun"] or words[:2] == ["accelerate", "launch"]
    return launches and not any(w.endswith(".py") or w in ("-m", "--module") for w in words)


def _span_commands(paragraph: str, launchers: Collection[str], checkout: bool) -> list[Command]:
    found = []
    for span in re.findall(r"`([^`\n]+)`", paragraph):
        words = span.split()
        if not words or words[0] not in launchers:
            continue
        if len(words) < 2 or _names_only(words) or (len(words) < 3 and words[0] not in ("make", "pip", "python")):
            continue  # `qaccel recipes`, `torchrun --nproc_per_node 2`: names a command (named_commands)
        if re.search(r"\.\.\.|[|<]|(?:^|\s)\[", span) or any(_PLACEHOLDER.match(w) for w in words[1:]):
            continue  # a synopsis
        found.append(Command(span, checkout or bool(_CHECKOUT_WORDS.search(paragraph))))
    return found


def _block_lines(block: str) -> list[str]:
    joined = re.sub(r"[ \t]*\\\n\s*", " ", block)  # a `\` continuation joins the next line with one space
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def markdown_commands(text: str, launchers: Collection[str] = ALL_LAUNCHERS) -> list[Command]:
    """The commands a Markdown text shows (see the module docstring), in order, without repeats."""
    doc_checkout = bool(_CHECKOUT_WORDS.search(_opening_paragraph(text)))
    commands: list[Command] = []
    pieces = re.split(r"^```(\w*)[^\n]*\n(.*?)^```[^\n]*$", text, flags=re.M | re.S)
    before = ""  # the paragraph right before the next code block
    for i in range(0, len(pieces), 3):
        for paragraph in _paragraphs(pieces[i]):
            commands += _span_commands(paragraph, launchers, doc_checkout)
            before = paragraph
        if i + 2 < len(pieces) and pieces[i + 1] == "bash":
            checkout = doc_checkout or bool(_CHECKOUT_WORDS.search(before))
            for line in _block_lines(pieces[i + 2]):
                if _launcher(shlex.split(line, comments=True)) in launchers:
                    commands.append(Command(line, checkout))
        if i + 2 < len(pieces):
            before = ""
    return list(dict.fromkeys(commands))


def yaml_comment_commands(text: str, launchers: Collection[str] = QACCEL_LAUNCHERS) -> list[Command]:
    """The commands in a YAML file's comments: whole comment lines that start with a launcher, and inline spans."""
    comments = "\n".join(line.split("#", 1)[1].strip() for line in text.splitlines() if line.lstrip().startswith("#"))
    commands = [Command(line, False) for line in _block_lines(comments) if _launcher(line.split()) in launchers]
    return list(dict.fromkeys(commands + _span_commands(comments.replace("\n", " "), launchers, False)))


def shown_script(text: str, name: str) -> str:
    """The source of the script ``name`` a Markdown text shows: its ``python`` block that names the file
    (a docstring that shows its own command line); empty when no block does (the script is described)."""
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    return next((block for block in blocks if name in block), "")


def named_commands(text: str) -> list[str]:
    """Inline spans that name a command without showing one: ``qaccel <sub>``, ``accelerate launch --cpu``,
    ``torchrun --nproc_per_node 2``, ``python -m qaccel.train``."""
    prose = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    spans = re.findall(r"`([^`\n]+)`", prose)
    named = [span for span in spans if re.fullmatch(r"(qaccel|accelerate) [a-z_]+", span)]
    named += [span for span in spans if span.split()[:1] in (["torchrun"], ["python"], ["accelerate"]) and _names_only(span.split())]
    return list(dict.fromkeys(named))


def check_named(name: str) -> None:
    """Fail when a named command does not exist: the subcommand, each launcher flag, the module."""
    words = name.split()
    if words[0] == "qaccel":
        from qaccel.cli import build_parser

        subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        assert words[1] in subparsers.choices, f"`{name}`: qaccel has {sorted(subparsers.choices)}"
        return
    if words[0] == "python":
        assert importlib.util.find_spec(words[2]) is not None, f"`{name}`: no module {words[2]}"
        return
    if words[0] == "torchrun":
        from torch.distributed.run import get_args_parser as parser
    else:
        from accelerate.commands.launch import launch_command_parser as parser

        assert words[1] == "launch", f"`{name}`: only `accelerate launch` is known"
    known = {option for action in parser()._actions for option in action.option_strings}
    unknown = [w for w in words if w.startswith("-") and w.split("=")[0] not in known]
    assert not unknown, f"`{name}`: {words[0]} has no {unknown}"


@dataclass(frozen=True)
class _Context:
    command: str
    checkout: bool
    own_scripts: Mapping[str, str]


def _parse(parse: Callable[[list[str]], object], argv: list[str], ctx: _Context) -> object:
    """Run an argparse entry point; a usage error fails the test with argparse's own message."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parse(argv)
    except SystemExit as exc:  # a stock argparse parser prints its message and exits
        pytest.fail(f"command `{ctx.command}`: {' '.join(argv)!r} is refused (exit {exc.code}): {err.getvalue().strip()}")
    except ValueError as exc:  # qaccel's parsers raise UsageError (a ValueError) instead
        pytest.fail(f"command `{ctx.command}`: {' '.join(argv)!r} is refused: {exc}")


def _needs_checkout(path: str, ctx: _Context) -> None:
    assert (REPO / path).is_file(), f"`{ctx.command}`: {path} does not exist in the repository"
    if not ctx.checkout:
        pytest.fail(
            f"`{ctx.command}`: {path} is a repository file a wheel user does not have; use the installed "
            "`-m qaccel.train` / `qaccel ...` and `\"$(qaccel configs --path NAME)\"`, or say the text is about a checkout"
        )


def _train_args(argv: list[str], ctx: _Context) -> None:
    from qaccel.train import parse_args
    from qaccel.zoo import load_recipe

    args = _parse(parse_args, argv, ctx)
    if args.recipe is not None:  # without one: your model + your data (parse_args checks that all are given)
        load_recipe(args.recipe)  # raises, naming the recipe, when the text names one that does not exist


def _check_launch_config_name(name: str, ctx: _Context) -> None:
    from qaccel._resources import launch_config_names

    if "/" in name or name.endswith((".yaml", ".yml")):
        _needs_checkout(name, ctx)
    else:
        assert name in launch_config_names(), f"`{ctx.command}`: no launch config {name!r} (shipped: {launch_config_names()})"


def _check_qaccel(argv: list[str], ctx: _Context) -> None:
    from qaccel.cli import build_parser

    args, extra = _parse(build_parser().parse_known_args, argv, ctx)
    if args.command == "configs" and args.path is not None:
        _check_launch_config_name(args.path, ctx)
    if extra and not getattr(args, "accepts_extra_args", False):
        pytest.fail(f"command `{ctx.command}`: qaccel {args.command} does not accept {extra}")
    if args.command == "train":  # its other flags go to the training loop
        if args.launch_config is not None:
            _check_launch_config_name(args.launch_config, ctx)
        _train_args([*(["--recipe", args.recipe] if args.recipe else []), *extra], ctx)


def _load_script(path: Path):
    spec = importlib.util.spec_from_file_location(f"doc_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _parse_with_script(namespace: dict, script_args: list[str], ctx: _Context) -> None:
    if callable(namespace.get("parse_args")):
        _parse(namespace["parse_args"], script_args, ctx)


def _check_script(script: str, script_args: list[str], is_module: bool, ctx: _Context) -> None:
    if is_module:
        assert script == "qaccel.train", f"`{ctx.command}`: unexpected module {script}"
        _train_args(script_args, ctx)
    elif script in ctx.own_scripts:  # the reader's own file, shown by the document
        source = ctx.own_scripts[script]
        if any(isinstance(node, ast.FunctionDef) and node.name == "parse_args" for node in ast.parse(source).body):
            namespace = {"__name__": f"doc_script_{Path(script).stem}"}  # not __main__: defines, does not train
            exec(compile(source, script, "exec"), namespace)
            _parse_with_script(namespace, script_args, ctx)
    else:
        assert "/" in script, f"`{ctx.command}`: {script} is neither a repository script nor one the document shows ({sorted(ctx.own_scripts)})"
        _needs_checkout(script, ctx)
        _parse_with_script(vars(_load_script(REPO / script)), script_args, ctx)


def _resolve_substitutions(ctx: _Context) -> str:
    """Check each ``$(qaccel ...)`` and replace it by what it prints; give each ``$VAR`` its sample value."""

    def substitute(match: re.Match) -> str:
        inner = match.group(1)
        words = shlex.split(inner)
        _check_qaccel(words[1:], ctx)
        if words[1:3] == ["configs", "--path"]:
            from qaccel._resources import launch_config_path

            return shlex.quote(str(launch_config_path(words[3])))
        pytest.fail(f"`{ctx.command}`: no check for the substitution $({inner})")

    def variable(match: re.Match) -> str:
        name = match.group(1)
        assert name in SAMPLE_ENV, f"`{ctx.command}`: no sample value for ${name} (known: {sorted(SAMPLE_ENV)})"
        return SAMPLE_ENV[name]

    command = re.sub(r'"?\$\((qaccel [^)]*)\)"?', substitute, ctx.command)
    return re.sub(r"\$\{?([A-Za-z_]\w*)\}?", variable, command)


def _check_pip(argv: list[str], ctx: _Context) -> None:
    """``pip install`` of qaccel from a clone, a wheel or a VCS URL, with extras pyproject.toml defines."""
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert argv[:1] == ["install"], f"`{ctx.command}`: only `pip install` is checked"
    for requirement in [w for w in argv[1:] if w not in _PIP_OPTIONS]:
        name, _, url = (part.strip() for part in requirement.partition(" @ "))
        match = re.fullmatch(r"(.+?)(?:\[([\w,]+)\])?", name)
        base, wanted = match.group(1), set((match.group(2) or "").split(",")) - {""}
        if base == "qaccel" and not url:
            pytest.fail(f"`{ctx.command}`: qaccel is on no package index; install from a clone (`pip install '.[zoo]'`), a wheel or a VCS URL")
        local = base in (".", "./") or (base.endswith(".whl") and "qaccel" in Path(base).name)
        remote = base == "qaccel" or (base.startswith("git+") and "qaccel" in base)
        assert local or remote, f"`{ctx.command}`: installs {requirement!r}, not qaccel"
        unknown = wanted - set(extras)
        assert not unknown, f"`{ctx.command}`: no extra {sorted(unknown)} in pyproject.toml (extras: {sorted(extras)})"


def _check_make(argv: list[str], ctx: _Context) -> None:
    targets = set(re.findall(r"^([A-Za-z][\w-]*):", (REPO / "Makefile").read_text(), flags=re.M))
    missing = [t for t in argv if t not in targets]
    assert not missing, f"`{ctx.command}`: no Makefile target {missing} (targets: {sorted(targets)})"


def _check_accelerate(argv: list[str], ctx: _Context) -> None:
    from accelerate.commands.launch import launch_command_parser

    assert argv[:1] == ["launch"], f"`{ctx.command}`: only `accelerate launch` is checked"
    args = _parse(launch_command_parser().parse_args, argv[1:], ctx)
    if args.config_file is not None:
        if Path(args.config_file).is_absolute():  # what $(qaccel configs --path NAME) printed
            assert Path(args.config_file).is_file(), f"`{ctx.command}`: launch config {args.config_file} does not exist"
        else:
            _needs_checkout(args.config_file, ctx)
    _check_script(args.training_script, args.training_script_args, args.module, ctx)


def check_command(command: str, *, checkout: bool = False, own_scripts: Mapping[str, str] | None = None) -> None:
    """Fail the calling test when ``command`` would be refused, or names a file its reader does not have.

    Args:
        command: one shell command as the document shows it.
        checkout: the text says the command is run from a checkout (repository paths allowed).
        own_scripts: the scripts the document itself shows (the reader's own files): bare name to source.
    """
    ctx = _Context(command, checkout, dict(own_scripts or {}))
    words = _strip_prefixes(shlex.split(_resolve_substitutions(ctx), comments=True))
    head, argv = words[0], words[1:]
    if head == "qaccel":
        _check_qaccel(argv, ctx)
    elif head == "make":
        _check_make(argv, ctx)
    elif head == "pip":
        _check_pip(argv, ctx)
    elif head == "python":
        if argv[0] == "-m":
            _check_script(argv[1], argv[2:], True, ctx)
        else:
            _check_script(argv[0], argv[1:], False, ctx)
    elif head == "torchrun":
        from torch.distributed.run import get_args_parser

        args = _parse(get_args_parser().parse_args, argv, ctx)
        _check_script(args.training_script, args.training_script_args, args.module, ctx)
    elif head == "accelerate":
        _check_accelerate(argv, ctx)
    else:
        pytest.fail(f"command `{command}`: no check for {head!r}")
