"""The training entry point (qaccel.train, scripts/train.py) refuses bad input with a clear error before any process group or collective exists,
and writes nothing to the output directory (the table in docs/errors.md).

All cases run in one separate Python process (this file run as a script, see ``_run_cases``): each
calls the script's ``main(argv)`` with its environment, and reports the error type, its message and
whether the output directory appeared. One process keeps the torch/transformers import cost to once;
every case fails before an Accelerator is built, so nothing process-wide carries over between them.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._launch import REPO, run_job


def _foreign_checkpoint(root: Path, method: str, recipe: str, task: str, base_model: str, config: dict | None = None, world_size: int = 1) -> Path:
    """A complete checkpoint folder as another run writes it: its run state and a manifest over it."""
    from qaccel.checkpoint import build_run_state, write_manifest

    folder = root / "checkpoint-4"
    folder.mkdir(parents=True)
    state = build_run_state(
        method=method, method_config=config or {}, recipe=recipe, task=task, step=4, world_size=world_size, wire_bytes_total=0,
        metrics=None, base_model=base_model, dataset=None,
    )  # fmt: skip
    (folder / "qaccel_state.json").write_text(json.dumps(state))
    write_manifest(folder)
    return folder


def _cases(tmp: Path) -> dict[str, dict]:
    bert = _foreign_checkpoint(tmp / "bert_run", "zero_one_adam", "bert-tiny", "masked-lm", "bert-tiny")
    from qaccel.fsdp import QSDPConfig
    from qaccel.zoo import load_recipe

    gpt2_tiny_qsdp = QSDPConfig.from_env(**load_recipe("gpt2-tiny").method.qsdp).to_dict()
    other_model = _foreign_checkpoint(tmp / "gpt2_124m_run", "qsdp", "gpt2-124m", "causal-lm", "gpt2-124m", gpt2_tiny_qsdp)
    damaged = _foreign_checkpoint(tmp / "damaged_run", "qsdp", "gpt2-tiny", "causal-lm", "gpt2-tiny")
    (damaged / "qaccel_state.json").write_text((damaged / "qaccel_state.json").read_text() + " ")
    from qaccel.optim import DiLoCoConfig

    diloco_config = {**DiLoCoConfig(sync_every=50).to_dict(), "parallelism": "ddp", "qsdp": None}
    diloco_run = _foreign_checkpoint(tmp / "diloco_run", "diloco", "gpt2-tiny", "causal-lm", None, diloco_config, world_size=2)
    bad_recipe = tmp / "bad.md"
    bad_recipe.write_text("no front matter\n")

    def case(*argv: str, **env: str) -> dict:
        return {"argv": [*argv], "env": env}

    return {
        "unknown_recipe": case("--recipe", "gpt2-huge"),
        "missing_recipe_file": case("--recipe", str(tmp / "nope.md")),
        "malformed_recipe_file": case("--recipe", str(bad_recipe)),
        "unknown_method": case("--recipe", "gpt2-tiny", "--method", "adam"),
        "qsdp_bits": case("--recipe", "gpt2-tiny", "--qsdp_weight_bits", "9"),
        "qsdp_bucket": case("--recipe", "gpt2-tiny", "--qsdp_grad_bucket_size", "0"),
        "qsdp_unknown_env_key": case("--recipe", "gpt2-tiny", QACCEL_QSDP_WEIGHT_BITZ="4"),
        "qsdp_unknown_flag": case("--recipe", "gpt2-tiny", "--qsdp_bits", "4"),
        "zoadam_schedule": case("--recipe", "bert-tiny", "--zoadam_var_freeze_step", "-1"),
        "zoadam_unsupported_value": case("--recipe", "bert-tiny", "--zoadam_amsgrad", "true"),
        "zero_one_adam_under_fsdp_launch": case("--recipe", "bert-tiny", ACCELERATE_USE_FSDP="true"),
        "deepspeed_launch": case("--recipe", "gpt2-tiny", ACCELERATE_USE_DEEPSPEED="true"),
        "diloco_bad_setting": case("--recipe", "gpt2-tiny", "--method", "diloco", "--diloco_outer_bits", "9"),
        "diloco_save_between_syncs": case("--recipe", "gpt2-tiny", "--method", "diloco", "--diloco_sync_every", "40"),
        "diloco_eval_between_syncs": case("--recipe", "gpt2-tiny", "--method", "diloco", "--diloco_sync_every", "75", "--save_steps", "0"),
        "diloco_fragments_with_checkpoints": case("--recipe", "gpt2-tiny", "--method", "diloco", "--diloco_sync_every", "50", "--diloco_fragments", "2"),
        "diloco_under_fsdp_launch": case("--recipe", "gpt2-tiny", "--method", "diloco", ACCELERATE_USE_FSDP="true"),
        "diloco_replica_bits": case(
            "--recipe", "gpt2-tiny", "--method", "diloco", "--qsdp_replica_grad_bits", "4",
            ACCELERATE_USE_FSDP="true", PARALLELISM_CONFIG_DP_REPLICATE_SIZE="2",
        ),  # fmt: skip
        "resume_diloco_other_world_size": case("--recipe", "gpt2-tiny", "--method", "diloco", "--diloco_sync_every", "50",
                                               "--resume_from_checkpoint", str(diloco_run)),  # fmt: skip
        "resume_missing_folder": case("--recipe", "gpt2-tiny", "--resume_from_checkpoint", str(tmp / "gone")),
        "resume_not_a_checkpoint": case("--recipe", "gpt2-tiny", "--resume_from_checkpoint", str(tmp)),
        "resume_damaged": case("--recipe", "gpt2-tiny", "--resume_from_checkpoint", str(damaged)),
        "resume_other_method": case("--recipe", "gpt2-tiny", "--resume_from_checkpoint", str(bert)),
        "resume_other_model": case("--recipe", "gpt2-tiny", "--resume_from_checkpoint", str(other_model)),
        "collective_timeout": case("--recipe", "gpt2-tiny", "--collective_timeout_s", "0"),
        "check_replicas_env": case("--recipe", "gpt2-tiny", QACCEL_CHECK_REPLICAS="often"),
        "push_without_id": case("--recipe", "gpt2-tiny", "--push_to_hub"),
        "no_steps": case("--recipe", "gpt2-tiny", "--max_steps", "0"),
        "negative_steps": case("--recipe", "gpt2-tiny", "--max_steps", "-3"),
        "negative_batch": case("--recipe", "gpt2-tiny", "--per_device_batch_size", "-1"),
        "no_logging": case("--recipe", "gpt2-tiny", "--logging_steps", "0"),
    }


# case -> (error type, substrings of the message)
EXPECTED = {
    "unknown_recipe": ("ValueError", ["gpt2-huge", "gpt2-tiny", "bert-tiny"]),
    "missing_recipe_file": ("ValueError", ["nope.md", "no such file"]),
    "malformed_recipe_file": ("ValueError", ["bad.md", "must start with a '---' line"]),
    "unknown_method": ("UsageError", ["--method: invalid choice: 'adam'", "qsdp"]),
    "qsdp_bits": ("ValueError", ["weight_bits", "9"]),
    "qsdp_bucket": ("ValueError", ["grad_bucket_size", "0"]),
    "qsdp_unknown_env_key": ("ValueError", ["QACCEL_QSDP_WEIGHT_BITZ", "QACCEL_QSDP_WEIGHT_BITS"]),
    "qsdp_unknown_flag": ("UsageError", ["unrecognized arguments: --qsdp_bits 4"]),
    "zoadam_schedule": ("ValueError", ["var_freeze_step", "-1"]),
    "zoadam_unsupported_value": ("NotImplementedError", ["ZeroOneAdamConfig.amsgrad=True: must be False"]),
    "zero_one_adam_under_fsdp_launch": ("ValueError", ["runs on HSDP shards", "dp_replicate_size >= 2", "--launch_config cpu_2x2_hqsdp", "cpu_2proc_ddp"]),
    "deepspeed_launch": ("ValueError", ["DeepSpeed", "cpu_2proc_qsdp.yaml"]),
    "diloco_bad_setting": ("ValueError", ["DiLoCoConfig.outer_bits=9", "an int in [2, 8], or off"]),
    "diloco_save_between_syncs": ("ValueError", ["--save_steps=150 with --method diloco: must be a multiple of --diloco_sync_every=40"]),
    "diloco_eval_between_syncs": ("ValueError", ["--eval_steps=100 with --method diloco: must be a multiple of --diloco_sync_every=75"]),
    "diloco_fragments_with_checkpoints": ("ValueError", ["--save_steps=150 with --diloco_fragments=2: must be 0 (only at the end"]),
    "diloco_under_fsdp_launch": ("ValueError", ["--method diloco with an FSDP launch config: runs on HSDP shards", "cpu_2x2_hqsdp"]),
    "diloco_replica_bits": ("ValueError", ["--qsdp_replica_grad_bits=4: with --method diloco DiLoCo sends only the outer pseudo-gradients"]),
    "resume_diloco_other_world_size": ("ValueError", ["trained with method 'diloco' on 2 processes, this run has 1", "resume on 2 processes"]),
    "resume_missing_folder": ("CheckpointError", ["gone: no such directory"]),
    "resume_not_a_checkpoint": ("CheckpointError", ["no manifest.json", "not a complete qaccel checkpoint"]),
    "resume_damaged": ("CheckpointError", ["qaccel_state.json", "the manifest says"]),
    "resume_other_method": ("ValueError", ["trained with method 'zero_one_adam', this run uses 'qsdp'"]),
    "resume_other_model": ("ValueError", ["resume: ", "differs", "gpt2-124m", "gpt2-tiny"]),
    "collective_timeout": ("ValueError", ["--collective_timeout_s 0.0: must be a number of seconds > 0"]),
    "check_replicas_env": ("ValueError", ["QACCEL_CHECK_REPLICAS='often': must be an integer >= 0"]),
    "push_without_id": ("UsageError", ["--push_to_hub needs --hub_model_id"]),
    "no_steps": ("ValueError", ["--max_steps=0: must be >= 1"]),
    "negative_steps": ("ValueError", ["--max_steps=-3: must be >= 1"]),
    "negative_batch": ("ValueError", ["--per_device_batch_size=-1: must be >= 1"]),
    "no_logging": ("UsageError", ["--logging_steps=0: must be >= 1"]),
}


def _run_cases(tmp: Path) -> dict[str, dict]:
    """In this (separate) process: run every case through ``main`` and report what happened."""
    train = importlib.import_module("qaccel.train")  # what scripts/train.py links to
    results = {}
    for name, case in _cases(tmp).items():
        out = tmp / "out" / name
        saved_env = dict(os.environ)
        os.environ.update(case["env"])
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                train.main([*case["argv"], "--output_dir", str(out)])
            result = {"error": None}
        except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
            # the classes a caller can catch it as (a SettingError is a ValueError)
            result = {"error": type(exc).__name__, "catchable_as": [c.__name__ for c in type(exc).__mro__], "message": str(exc)}
        finally:
            os.environ.clear()
            os.environ.update(saved_env)
        result["output_dir_exists"] = out.exists()
        results[name] = result
    return results


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("train_errors")
    proc = run_job([sys.executable, __file__, str(tmp)], timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_input_is_refused_before_any_collective_and_nothing_is_written(outcomes, name):
    kind, fragments = EXPECTED[name]
    result = outcomes[name]
    assert kind in result.get("catchable_as", [result["error"]]), result
    for fragment in fragments:
        assert fragment in result["message"], (fragment, result["message"])
    assert not result["output_dir_exists"], result


def _launch(cmd: list[str], tmp_path: Path, **extra_env: str) -> subprocess.CompletedProcess:
    return run_job(cmd, check=False, cwd=tmp_path, timeout=300, **extra_env)


def _torchrun_bad_recipe(tmp_path: Path, **extra_env: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "qaccel.train", "--recipe", "gpt2-huge", "--output_dir", str(tmp_path / "out")]  # fmt: skip
    return _launch(cmd, tmp_path, **extra_env)


def test_under_torchrun_only_the_main_process_reports_bad_input_in_one_line(tmp_path):
    proc = _torchrun_bad_recipe(tmp_path)
    assert proc.returncode != 0
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if "qaccel.train: " in line]
    assert len(ours) == 1 and ours[0].startswith("qaccel.train: unknown recipe 'gpt2-huge'; valid recipes: "), ours
    # no traceback through qaccel's code (torchrun's own failure summary follows, as with any exit 2)
    assert 'qaccel/train.py", line' not in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def test_qaccel_debug_keeps_the_traceback_for_bad_input(tmp_path):
    proc = _torchrun_bad_recipe(tmp_path, QACCEL_DEBUG="1")
    assert 'qaccel/train.py", line' in proc.stderr and proc.stderr.count("qaccel.train: unknown recipe") == 1


def test_qaccel_train_checks_before_it_launches_anything(tmp_path):
    # a 1-bit optimizer with an explicit 1-D FSDP launch config (without one, qaccel train picks the DDP twin of the
    # recipe's config): refused in the CLI process, exit 2, one line
    cmd = [sys.executable, "-m", "qaccel.cli", "train", "--recipe", "gpt2-tiny", "--method", "zero_one_adam", "--launch_config", "cpu_2proc_qsdp",
           "--output_dir", str(tmp_path / "out")]  # fmt: skip
    proc = _launch(cmd, tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("qaccel train: --method zero_one_adam with an FSDP launch config: runs on HSDP shards"), proc.stderr
    assert not (tmp_path / "out").exists()


def test_every_case_has_an_expectation():
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        assert set(_cases(Path(tmp))) == set(EXPECTED)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(_run_cases(Path(sys.argv[1]))))
