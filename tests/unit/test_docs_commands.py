"""Every qaccel, ``accelerate launch``, ``torchrun`` and ``python`` command in ``docs/*.md`` and in the
shipped launch configs' comments is one the parsers that would run it accept, and names only files its
reader has (``tests/_commands.py`` holds the rules and the checks; nothing is run or trained).
"""

from __future__ import annotations

import re

import pytest

from tests._commands import (
    QACCEL_LAUNCHERS,
    REPO,
    Command,
    check_command,
    check_named,
    markdown_commands,
    named_commands,
    shown_script,
    yaml_comment_commands,
)

DOCS = sorted((REPO / "docs").glob("*.md"))  # docs/bench/ holds generated tables, not instructions
LAUNCH_CONFIGS = sorted((REPO / "launch_configs").glob("*.yaml"))
OWN_SCRIPTS = {  # scripts a document shows the reader writing (bare names; see tests/_commands.py)
    "docs/trainer.md": ("finetune_mrpc.py", "trainer_example.py"),
}


def _bare(text: str) -> str:
    """A command without its trailing comment (the test id)."""
    return re.sub(r"\s+#\s.*$", "", text)


def _commands() -> list:
    params = []
    for path in [*DOCS, *LAUNCH_CONFIGS]:
        text = path.read_text(encoding="utf-8")
        found = yaml_comment_commands(text) if path.suffix == ".yaml" else markdown_commands(text, QACCEL_LAUNCHERS)
        where = str(path.relative_to(REPO))
        params += [pytest.param(where, command, id=f"{where}: {_bare(command.text)}") for command in found]
    return params


def _named() -> list:
    params = []
    for path in DOCS:
        where = str(path.relative_to(REPO))
        for name in dict.fromkeys(named_commands(path.read_text(encoding="utf-8"))):
            params.append(pytest.param(where, name, id=f"{where}: {name}"))
    return params


COMMANDS = _commands()


def test_commands_are_found_in_docs_and_launch_configs():
    # the extraction itself must see the places the issue names: docs' bash blocks, their inline spans,
    # and every launch config's header
    wheres = {param.values[0] for param in COMMANDS}
    assert {"docs/train.md", "docs/export.md", "docs/qsdp.md"} <= wheres
    assert {str(p.relative_to(REPO)) for p in LAUNCH_CONFIGS} <= wheres, "a launch config's comments show no command"
    texts = [param.values[1].text for param in COMMANDS]
    assert any(t.startswith("torchrun ") for t in texts) and any(t.startswith("accelerate launch ") for t in texts)


@pytest.mark.parametrize(("where", "command"), COMMANDS)
def test_docs_command_is_accepted(where: str, command: Command):
    text = (REPO / where).read_text(encoding="utf-8")
    own = {name: shown_script(text, name) for name in OWN_SCRIPTS.get(where, ())}
    check_command(command.text, checkout=command.checkout, own_scripts=own)


@pytest.mark.parametrize(("where", "name"), _named())
def test_docs_named_command_exists(where: str, name: str):
    check_named(name)


def test_checkout_rule_reads_the_text():
    # a repository path is accepted where the text says "checkout", refused elsewhere (independent inputs)
    doc = "# T\n\nAbout the package.\n\nFrom a checkout of the repository:\n\n```bash\npython scripts/demo.py\n```\n\nThen:\n\n```bash\npython scripts/demo.py\n```\n"
    assert [c.checkout for c in markdown_commands(doc)] == [True, False]
    assert markdown_commands("# T\n\nThis page needs a clone.\n\n```bash\npython scripts/demo.py\n```\n")[0].checkout
    config = "# Launch with\n#   accelerate launch --config_file x.yaml \\\n#       -m qaccel.train --recipe gpt2-tiny\nnum_processes: 2\n"
    assert yaml_comment_commands(config) == [Command("accelerate launch --config_file x.yaml -m qaccel.train --recipe gpt2-tiny", False)]
    with pytest.raises(pytest.fail.Exception, match="wheel user"):
        check_command("accelerate launch --config_file launch_configs/cpu_2proc_ddp.yaml -m qaccel.train --recipe bert-tiny --output_dir x")
    check_command("accelerate launch --config_file launch_configs/cpu_2proc_ddp.yaml -m qaccel.train --recipe bert-tiny --output_dir x", checkout=True)


def test_synopses_and_placeholders_are_not_commands():
    text = "Use `qaccel export CHECKPOINT OUT [--overwrite]`, `torchrun --nproc_per_node N x.py` or `qaccel bench e2e --nodes 2`."
    assert [c.text for c in markdown_commands(text)] == ["qaccel bench e2e --nodes 2"]


def test_a_shown_script_checks_its_arguments():
    source = "import argparse\n\ndef parse_args(argv):\n    parser = argparse.ArgumentParser()\n    parser.add_argument('--steps', type=int)\n    return parser.parse_args(argv)\n"
    doc = f"Save this as `x.py`:\n\n```python\n# x.py\n{source}```\n"
    assert shown_script(doc, "x.py").startswith("# x.py")
    check_command("torchrun --nproc_per_node 2 x.py --steps 3", own_scripts={"x.py": source})
    with pytest.raises(pytest.fail.Exception, match="--stepz"):
        check_command("torchrun --nproc_per_node 2 x.py --stepz 3", own_scripts={"x.py": source})
    check_command("torchrun --nproc_per_node 2 x.py --anything", own_scripts={"x.py": "raise SystemExit('a script without parse_args is never run')\n"})
    with pytest.raises(AssertionError, match="neither a repository script"):
        check_command("torchrun --nproc_per_node 2 y.py", own_scripts={"x.py": source})
