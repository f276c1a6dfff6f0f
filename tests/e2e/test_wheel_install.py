"""The wheel is the product: built from this checkout, installed outside it, every `qaccel` command works.

The wheel goes into a fresh virtual environment (its dependencies come from the test's own
environment through a path file, so nothing is downloaded), and every command runs from an empty
temporary folder, so neither the checkout nor an editable install can stand in for what the wheel
lacks. The references are the repository's own folders (the recipes and launch configs the wheel
must carry) and the checks of a real run (its checkpoint, its export, the push plan).
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Building the wheel and a virtual environment for it costs half a minute before any test runs:
# the slow tier (make test-all, CI), as packaging changes rarely.
pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    # a copy of the files git would commit, so the build sees what a clean clone holds (no build/, egg-info)
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO, capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        target = src / name
        target.parent.mkdir(parents=True, exist_ok=True)
        source = REPO / name
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            target.write_bytes(source.read_bytes())
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    _run(cmd, cwd=out, env=dict(os.environ))
    (built,) = out.glob("qaccel-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> dict:
    """A new virtual environment holding the wheel; returns its python, its qaccel and an environment."""
    venv = tmp_path_factory.mktemp("venv")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=venv, env=dict(os.environ))
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies: this environment's site-packages, after the new one (a path line does not run
    # the editable install's hook, so `import qaccel` can only find the wheel)
    (purelib / "deps.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)], cwd=venv, env=dict(os.environ))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QACCEL_", "FSDP_", "ACCELERATE_", "PYTHON"))}
    # ninja (kernel builds) and the console script of the new environment
    env.update(PATH=os.pathsep.join([str(venv / "bin"), sysconfig.get_paths()["scripts"], env.get("PATH", "")]))
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return {"python": python, "qaccel": venv / "bin" / "qaccel", "env": env, "purelib": purelib}


def test_the_wheel_carries_the_recipes_launch_configs_kernels_and_entry_point(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, pattern in (("model_cards", "*.md"), ("launch_configs", "*.yaml"), ("qaccel/csrc", "*.cpp")):
        expected = {f"qaccel/{p.relative_to(REPO).as_posix().removeprefix('qaccel/')}" for p in (REPO / folder).glob(pattern)}
        assert expected and expected <= names, sorted(expected - names)
    assert "qaccel/train.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "qaccel = qaccel.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_every_command_runs_from_the_installed_wheel(installed, tmp_path):
    python, qaccel, env = installed["python"], str(installed["qaccel"]), installed["env"]
    where = _run([str(python), "-c", "import qaccel; print(qaccel.__file__)"], cwd=tmp_path, env=env).stdout.strip()
    assert Path(where).is_relative_to(installed["purelib"]), where  # the wheel, not the checkout

    listing = _run([qaccel, "recipes", "--json"], cwd=tmp_path, env=env).stdout
    shipped = sorted(p.stem for p in (REPO / "model_cards").glob("*.md"))
    assert [r["name"] for r in json.loads(listing)["recipes"]] == shipped

    config = Path(_run([qaccel, "configs", "--path", "cpu_2proc_qsdp"], cwd=tmp_path, env=env).stdout.strip())
    assert config.is_relative_to(installed["purelib"])
    assert config.read_bytes() == (REPO / "launch_configs" / "cpu_2proc_qsdp.yaml").read_bytes()

    out = tmp_path / "run"
    _run([qaccel, "train", "--recipe", "gpt2-tiny", "--max_steps", "5", "--eval_steps", "0", "--output_dir", str(out)], cwd=tmp_path, env=env)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 5 and rows[-1]["wire_bytes_total"] > 0
    checkpoint = out / "checkpoint-5"
    assert (checkpoint / "qaccel_state.json").is_file()

    exported = tmp_path / "export"
    report = json.loads(_run([qaccel, "export", str(checkpoint), str(exported)], cwd=tmp_path, env=env).stdout)
    assert "config.json" in report["export"]["files"] and (exported / "README.md").is_file()

    plan = json.loads(_run([qaccel, "push", str(exported), "--repo_id", "org/gpt2-tiny-qsdp", "--dry_run"], cwd=tmp_path, env=env).stdout)
    assert plan["push"]["repo_id"] == "org/gpt2-tiny-qsdp"
    assert sorted(f["path"] for f in plan["push"]["files"]) == sorted(p.relative_to(exported).as_posix() for p in exported.rglob("*") if p.is_file())


def test_bad_input_from_the_installed_wheel_is_one_line(installed, tmp_path):
    proc = subprocess.run([str(installed["qaccel"]), "train", "--recipe", "gpt2-tiny", "--output_dir", str(tmp_path / "o"), "--qsdp_weight_bits", "9"],
                          cwd=tmp_path, env=installed["env"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("qaccel train: QSDPConfig.weight_bits=9"), proc.stderr
    assert not (tmp_path / "o").exists()


def test_the_demo_runs_from_the_installed_wheel(installed, tmp_path):
    """The README's first command, from the wheel: both jobs train on the launch config inside the package."""
    out = tmp_path / "demo"
    cmd = [str(installed["qaccel"]), "demo", "--max_steps", "3", "--bandwidth", "none", "--output_dir", str(out)]
    proc = _run(cmd, cwd=tmp_path, env=installed["env"])
    report = json.loads((out / "demo.json").read_text())
    runs = report["runs"]
    assert sorted(runs) == ["FSDP2 (stock)", "QSDP W8G8"], sorted(runs)
    for name, run_dir in (("QSDP W8G8", "qsdp"), ("FSDP2 (stock)", "none")):
        rows = [json.loads(line) for line in (out / run_dir / "metrics.jsonl").read_text().splitlines()]
        assert runs[name]["steps"] == 3 == [r["step"] for r in rows if "loss" in r][-1]
        assert runs[name]["wire_bytes_total"] == rows[-1]["wire_bytes_total"] > 0  # the table reads the runs' own logs
    # W8G8 sends about a quarter of stock FSDP2's fp32 bytes (0.255x on gpt2-tiny); a broken codec path sends as many
    assert runs["QSDP W8G8"]["wire_bytes_total"] < 0.35 * runs["FSDP2 (stock)"]["wire_bytes_total"]
    assert str(installed["purelib"]) in proc.stdout + proc.stderr  # the packaged launch config, not a checkout path
