"""``qaccel bench e2e`` measures the users' training entry: its modules hold no training loop of their own.

A module of the benchmark that calls ``backward`` would be a second loop whose step times are not the users'
(issue 31): no name, attribute or string in the code is ``backward`` (``loss.backward()``,
``torch.autograd.backward``, ``getattr(loss, "backward")``); prose that mentions the backward pass (help
texts, docstrings) is fine. The size limits are the house rules' (modules under 400 lines, functions under 80).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "qaccel" / "bench"
MODULES = sorted([*BENCH.glob("_e2e*.py"), BENCH / "e2e.py"])


def test_the_modules_are_found():
    names = {path.name for path in MODULES}
    assert {"e2e.py", "_e2e_jobs.py", "_e2e_entry.py", "_e2e_probe.py", "_e2e_methods.py"} <= names
    assert "_e2e_worker.py" not in names  # the old worker and its training loop are gone


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_no_backward_call_and_the_size_limits(path):
    text = path.read_text()
    tree = ast.parse(text)
    for node in ast.walk(tree):
        word = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else node.value if isinstance(node, ast.Constant) else None
        assert word != "backward", f"{path.name}:{node.lineno}: calls backward; the benchmark runs qaccel.train's loop, not its own"
    lines = len(text.splitlines())
    assert lines <= 400, f"{path.name}: {lines} lines (at most 400)"
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            length = node.end_lineno - node.lineno + 1
            assert length <= 80, f"{path.name}: {node.name} is {length} lines (at most 80)"


def test_the_checks_would_catch_a_loop(tmp_path):
    # the same checks on a module that trains: they fail
    looped = tmp_path / "_e2e_looped.py"
    looped.write_text('"""The backward pass, in prose: allowed."""\ndef step(model, batch):\n    model(batch).loss.backward()\n')
    with pytest.raises(AssertionError, match="_e2e_looped.py:3: calls backward"):
        test_no_backward_call_and_the_size_limits(looped)
    long = tmp_path / "_e2e_long.py"
    long.write_text("def f():\n" + "    x = 1\n" * 80)
    with pytest.raises(AssertionError, match="f is 81 lines"):
        test_no_backward_call_and_the_size_limits(long)
