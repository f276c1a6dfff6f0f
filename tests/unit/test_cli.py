"""The ``qaccel`` CLI called in-process through ``main(argv)``."""

import json

import torch

from qaccel.cli import main


def test_env_reports_versions_and_backends(capsys):
    assert main(["env"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema_version"] == 1
    env = report["env"]
    assert env["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert env["cuda"]["available"] == torch.cuda.is_available()
    assert "reference" in env["kernels"]


def test_selfcheck_passes_and_reports_every_backend(capsys):
    assert main(["selfcheck", "--numel", "5000"]) == 0
    report = json.loads(capsys.readouterr().out)["selfcheck"]
    assert report["ok"] is True
    assert "reference" in report["backends"]
    assert 0 < report["w8_max_abs_error"] < 0.05


def test_usage_errors_exit_2(capsys):
    assert main(["no-such-command"]) == 2
    assert main(["bench"]) == 2
