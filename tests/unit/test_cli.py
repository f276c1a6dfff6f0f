"""The ``qaccel`` CLI called in-process through ``main(argv)``."""

import json

import pytest
import torch

from qaccel.cli import main
from qaccel.quant import _native


def test_env_reports_versions_and_backends(capsys):
    assert main(["env"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema_version"] == 1
    env = report["env"]
    assert env["versions"]["torch"].startswith(torch.__version__.split("+")[0])
    assert env["cuda"]["available"] == torch.cuda.is_available()
    assert "reference" in env["kernels"]


def _native_cpu_kernels():
    kernels, reason = _native.try_load("cpu")
    if kernels is None:
        pytest.skip(f"the C++ kernels do not build here: {reason}")
    return kernels


def test_selfcheck_checks_native_backends_against_the_reference_baseline(capsys, monkeypatch):
    monkeypatch.delenv("QACCEL_KERNELS", raising=False)
    _native_cpu_kernels()
    assert main(["selfcheck", "--numel", "5000"]) == 0
    report = json.loads(capsys.readouterr().out)["selfcheck"]
    assert report["ok"] is True and report["baseline"] == "reference"
    assert report["backends"]["reference"] == {"role": "baseline"}  # reported, not compared with itself
    cpu = report["backends"]["cpu"]
    assert cpu["role"] == "checked" and cpu["ok"] is True
    ops = {check["op"] for check in cpu["checks"]}
    assert ops == {"quantize", "dequantize", "sign_pack", "sign_unpack", "onebit_encode", "onebit_server"}
    assert report["checked"] == ["cpu"]
    # absolute error of the W8 round trip (stochastic rounding): below one step, scale = range / 255
    assert 0 < report["w8_max_abs_error"] < 0.05


def test_selfcheck_fails_on_a_native_backend_that_differs(capsys, monkeypatch):
    """A native kernel one bit off in one code byte must make selfcheck exit 1 and name what differs."""
    monkeypatch.delenv("QACCEL_KERNELS", raising=False)
    kernels = _native_cpu_kernels()
    good = kernels.quantize_buckets

    def off_by_one_bit(*args, **kwargs):
        codes, lo, scale = good(*args, **kwargs)
        codes = codes.clone()
        codes[0] ^= 1
        return codes, lo, scale

    monkeypatch.setattr(kernels, "quantize_buckets", off_by_one_bit)
    assert main(["selfcheck", "--numel", "5000"]) == 1
    cpu = json.loads(capsys.readouterr().out)["selfcheck"]["backends"]["cpu"]
    bad = [c for c in cpu["checks"] if not c["identical"]]
    assert bad and {c["op"] for c in bad} >= {"quantize"} and cpu["ok"] is False


def test_selfcheck_reports_a_native_backend_it_could_not_check(capsys, monkeypatch):
    monkeypatch.setenv("QACCEL_KERNELS", "reference")
    assert main(["selfcheck", "--numel", "5000"]) == 0
    report = json.loads(capsys.readouterr().out)["selfcheck"]
    assert report["checked"] == [] and report["backends"]["cpu"]["role"] == "not checked"
    assert "QACCEL_KERNELS=reference" in report["backends"]["cpu"]["reason"]


def test_usage_errors_exit_2(capsys):
    assert main(["no-such-command"]) == 2
    assert main(["bench"]) == 2
