"""Flags are spelled in full (no argparse prefix matching), with ``_`` or ``-``; messages name their command once.

Covers every parser the project builds: ``qaccel`` and each subcommand (nested ``qaccel bench <kind>``
too), ``qaccel.train``'s (which also reads what ``qaccel train`` forwards), and the scripts'.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import pytest

from qaccel._errors import FlagParser, UsageError, prefixed
from qaccel.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


class _Built(Exception):
    """Carries the parser ``qaccel.train.parse_args`` built, caught before it parses anything."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser built")
        self.parser = parser


def _train_parser(monkeypatch) -> argparse.ArgumentParser:
    from qaccel import _errors, train

    def capture(self, *args, **kwargs):
        raise _Built(self)

    monkeypatch.setattr(_errors.ArgumentParser, "parse_args", capture)
    with pytest.raises(_Built) as built:
        train.parse_args([])
    return built.value.parser


def _all_parsers(parser: argparse.ArgumentParser, name: str = "qaccel"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{name} {sub_name}")


def test_every_qaccel_parser_refuses_prefixes(monkeypatch):
    parsers = dict(_all_parsers(build_parser()))
    assert {"qaccel push", "qaccel train", "qaccel bench comm", "qaccel bench e2e"} <= set(parsers)
    parsers["qaccel.train"] = _train_parser(monkeypatch)
    for name, parser in parsers.items():
        assert isinstance(parser, FlagParser), name
        assert parser.allow_abbrev is False, name


@pytest.mark.parametrize(
    "script", ["gpu_check.py", "qsdp_example.py", "repro_powersgd_gloo.py", "zoadam_example.py"]
)
def test_every_script_parser_refuses_prefixes(script):
    # read the source: importing the scripts would need a GPU build (gpu_check) or start ranks
    tree = ast.parse((REPO / "scripts" / script).read_text())
    calls = [
        node for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("ArgumentParser", "FlagParser")
    ]  # fmt: skip
    assert calls, f"scripts/{script} builds no parser"
    for call in calls:
        is_flag_parser = getattr(call.func, "id", None) == "FlagParser"
        no_abbrev = any(k.arg == "allow_abbrev" and k.value.value is False for k in call.keywords)
        assert is_flag_parser or no_abbrev, f"scripts/{script}:{call.lineno}: a parser that matches prefixes"


def test_a_prefix_is_an_unknown_flag_in_the_cli(tmp_path, capsys):
    # --dry is a prefix of push's --dry_run only: argparse's default would have taken it as --dry_run
    assert main(["push", str(tmp_path), "--repo_id", "org/x", "--dry"]) == 2
    captured = capsys.readouterr()
    assert "unrecognized arguments: --dry" in captured.err
    assert captured.out == ""  # nothing was planned or pushed


def test_a_prefix_is_an_unknown_flag_in_a_nested_bench_command(capsys):
    # --qsdp_world is a prefix of `qaccel bench comm --qsdp_world_size` only
    assert main(["bench", "comm", "--qsdp_world", "4"]) == 2
    assert "unrecognized arguments: --qsdp_world 4" in capsys.readouterr().err


def test_a_prefix_is_a_usage_error_in_the_training_entry(tmp_path):
    from qaccel.train import parse_args

    with pytest.raises(UsageError, match=r"unrecognized arguments: --max_step 5$"):
        parse_args(["--recipe", "gpt2-tiny", "--output_dir", str(tmp_path), "--max_step", "5"])


@pytest.mark.parametrize(
    "typo",
    [["--max_step", "5"], ["--num_proc", "2"]],  # a training flag, and a prefix of qaccel train's own --num_processes
    ids=["training-flag", "train-command-flag"],
)
def test_a_prefix_forwarded_by_qaccel_train_is_refused(typo, tmp_path, capsys):
    argv = ["train", "--recipe", "gpt2-tiny", "--output_dir", str(tmp_path / "run"), *typo, "--dry_run"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"qaccel train: unrecognized arguments: {' '.join(typo)}"
    assert not (tmp_path / "run").exists()


def test_dashed_flags_parse_as_the_underscore_ones():
    parser = build_parser()
    dashed = parser.parse_known_args(["push", "out", "--repo-id", "org/x", "--dry-run", "--commit-message=a-b --c"])
    underscored = parser.parse_known_args(["push", "out", "--repo_id", "org/x", "--dry_run", "--commit_message", "a-b --c"])
    assert dashed == underscored
    assert (dashed[0].repo_id, dashed[0].dry_run, dashed[0].commit_message, dashed[1]) == ("org/x", True, "a-b --c", [])


def test_dashed_flags_forwarded_by_qaccel_train_parse_as_the_underscore_ones(tmp_path):
    from qaccel.train import parse_args

    def as_qaccel_train_reads_them(argv):
        args, extra = build_parser().parse_known_args(["train", *argv])
        return args, parse_args(["--recipe", args.recipe, *extra])

    out = str(tmp_path / "run")
    dashed = as_qaccel_train_reads_them(
        ["--recipe", "gpt2-tiny", "--dry-run", "--num-processes", "1", "--output-dir", out, "--max-steps=5", "--qsdp-grad-bits", "4"]
    )
    underscored = as_qaccel_train_reads_them(
        ["--recipe", "gpt2-tiny", "--dry_run", "--num_processes", "1", "--output_dir", out, "--max_steps", "5", "--qsdp_grad_bits", "4"]
    )
    assert dashed == underscored
    command, entry = dashed
    assert (command.dry_run, command.num_processes, entry.output_dir, entry.max_steps, entry.qsdp_grad_bits) == (True, 1, out, 5, "4")


def test_help_shows_the_underscore_spelling(capsys, monkeypatch):
    assert main(["push", "--help"]) == 0
    text = capsys.readouterr().out
    assert "--dry_run" in text and "--repo_id" in text
    assert "--dry-run" not in text and "--repo-id" not in text
    from qaccel.train import parse_args

    monkeypatch.setattr("sys.argv", ["qaccel.train"])
    with pytest.raises(SystemExit) as exited:
        parse_args(["--help"])
    text = capsys.readouterr().out
    assert exited.value.code == 0
    assert "--max_steps" in text and "--qsdp_grad_bits" in text
    assert "--max-steps" not in text and "--qsdp-grad-bits" not in text


def test_end_of_options_and_dashed_options_of_its_own_are_left_alone():
    parser = FlagParser(prog="t")
    parser.add_argument("--dry_run", action="store_true")
    parser.add_argument("--from-raw", dest="dashed")  # an option spelled with a dash stays itself
    parser.add_argument("--from_raw", dest="underscored")
    parser.add_argument("rest", nargs="*")
    args = parser.parse_args(["--from-raw", "a", "--from_raw", "b", "--", "--dry-run"])
    assert (args.dashed, args.underscored, args.dry_run, args.rest) == ("a", "b", False, ["--dry-run"])


# -- one prefix per message ---------------------------------------------------------------------


def _export_folder(path: Path) -> Path:
    path.mkdir()
    (path / "README.md").write_text("---\nlicense: mit\n---\n# a model\n")
    (path / "config.json").write_text("{}\n")
    return path


def test_push_offline_names_the_command_once(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _export_folder(tmp_path / "export")
    assert main(["push", str(folder), "--repo_id", "org/tiny"]) == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("qaccel push: ") and lines[0].count("push") == 1, lines[0]
    assert "offline" in lines[0]


def test_push_and_export_errors_of_the_library_name_the_command_once(tmp_path, capsys):
    assert main(["push", str(tmp_path / "missing"), "--repo_id", "org/tiny", "--dry_run"]) == 1
    assert capsys.readouterr().err.strip() == f"qaccel push: {tmp_path / 'missing'}: no such folder"
    busy = _export_folder(tmp_path / "busy")
    assert main(["export", str(tmp_path / "missing"), str(busy)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qaccel export out_dir={busy}: exists and is not empty"), err
    assert "export: export" not in err


def test_bench_e2e_without_root_names_the_command_once(monkeypatch, capsys):
    from qaccel.bench import _e2e_netns, e2e

    monkeypatch.setattr(e2e, "check_prerequisites", lambda: _e2e_netns.check_prerequisites(euid=1000))
    assert main(["bench", "e2e", "--bandwidth", "none"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("qaccel bench e2e needs root (effective uid 1000)"), err
    assert err.count("qaccel bench e2e") == 2  # the message, and the sudo line it suggests


@pytest.mark.parametrize(
    ("program", "message", "expected"),
    [
        ("qaccel push", "push: offline", "qaccel push: offline"),
        ("qaccel export", "export out_dir=/x: exists", "qaccel export out_dir=/x: exists"),
        ("qaccel bench quant", "qaccel bench quant (its PNG) needs matplotlib", "qaccel bench quant (its PNG) needs matplotlib"),
        ("qaccel push", "pushed nothing", "qaccel push: pushed nothing"),  # a word that starts alike is no prefix
        ("qaccel.train", "--max_steps=-1: must be >= 1", "qaccel.train: --max_steps=-1: must be >= 1"),
    ],
)
def test_prefixed_names_the_program_once(program, message, expected):
    assert prefixed(program, message) == expected
