"""``qaccel bench convergence --quick`` end to end: every run is a ``torchrun -m qaccel.train`` job on 2 CPU ranks.

The quick preset checks the pipeline, not convergence. To fit the suite's time budget the study runs
one task and one compressed method (gpt2-tiny, FSDP2 vs QSDP W4G4, 2 seeds, 4 steps: four launches
of the training loop). What must hold even then: the report has every run with the loop's own
numbers (read back here from each run's ``metrics.jsonl`` and final checkpoint, written by
``qaccel.train``), training lowered the eval loss below the untrained model's, the seed reaches the
data order and QSDP's noise but not the initialisation, and compression sends fewer bytes. Flags of
every other (task, method) are checked against the loop's own parser without launching anything.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import statistics
from pathlib import Path

import pytest

from qaccel.bench._convergence_run import hierarchical_env, loop_flags, mesh_env, seed_flags
from qaccel.bench._convergence_tasks import TASKS
from qaccel.cli import main

REPO = Path(__file__).resolve().parents[2]
STEPS = TASKS["gpt2-tiny"].quick_steps
SUMMARY_KEYS = {
    "final_eval_loss", "final_eval_loss_mean", "final_eval_loss_std", "diff_vs_baseline_pct",
    "diff_vs_baseline_in_baseline_std", "paired_diff_mean", "paired_diff_std", "goal_pct",
    "wire_bytes_per_step_per_rank", "verdict",
}  # fmt: skip


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HUB_OFFLINE", "1")
    mp.setenv("OMP_NUM_THREADS", "1")
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("convergence")
    argv = ["bench", "convergence", "--quick", "--tasks", "gpt2-tiny", "--methods", "w4g4", "--runs_dir", str(out / "runs")]
    assert main([*argv, "--json", str(out / "c.json"), "--markdown", str(out / "c.md")]) == 0
    return json.loads((out / "c.json").read_text()), out


def loop_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # quick_report: four 2-rank launches of the training loop, minutes on 2 cores
def test_report_has_every_method_and_seed(quick_report):
    report, out = quick_report
    assert report["schema_version"] == 1 and report["benchmark"] == "convergence"
    assert report["seeds"] == [0, 1] and report["task_order"] == ["gpt2-tiny"]
    assert {"cpu", "ranks", "torch"} <= set(report["machine"])
    assert report["commands"] == [
        f"qaccel bench convergence --tasks gpt2-tiny --methods w4g4 --quick --runs_dir {out / 'runs'} --json {out / 'c.json'} --markdown {out / 'c.md'}"
    ]
    assert (out / "c.png").stat().st_size > 10_000  # a real figure, not an empty canvas
    md = (out / "c.md").read_text()
    task = report["tasks"]["gpt2-tiny"]
    assert task["steps"] == STEPS and task["eval_every"] == STEPS // 2
    assert task["method_order"] == ["fsdp2", "w4g4"] and set(task["methods"]) == {"fsdp2", "w4g4"}
    assert "#### gpt2-tiny: 4 steps, 2 seeds, 2 ranks" in md
    for key, method in task["methods"].items():
        assert method["label"] in md
        assert SUMMARY_KEYS <= set(method["summary"]), key
        runs = method["runs"]
        assert [run["seed"] for run in runs] == [0, 1]
        for run in runs:
            assert len(run["train_loss"]) == STEPS and all(math.isfinite(x) for x in run["train_loss"])
            # the loop evaluated the untrained model (--eval_on_start), every --eval_steps and at the end
            assert [point["step"] for point in run["eval"]] == [0, STEPS // 2, STEPS]
            losses = [point["eval_loss"] for point in run["eval"]]
            assert losses[-1] < losses[0], (key, run["seed"], losses)  # from scratch, a few steps lower the loss
        # mean ± std recomputed independently from the per-seed finals
        finals = [run["eval"][-1]["eval_loss"] for run in runs]
        assert method["summary"]["final_eval_loss_mean"] == pytest.approx(statistics.fmean(finals), rel=1e-12)
        assert method["summary"]["final_eval_loss_std"] == pytest.approx(statistics.stdev(finals), rel=1e-12)
    base = task["methods"]["fsdp2"]["summary"]["final_eval_loss_mean"]
    w4 = task["methods"]["w4g4"]["summary"]
    assert w4["diff_vs_baseline_pct"] == pytest.approx(100.0 * (w4["final_eval_loss_mean"] - base) / base, abs=1e-9)


@pytest.mark.slow
def test_every_number_is_the_training_loops_own(quick_report):
    """Each run folder is a qaccel.train output: its metrics.jsonl and final checkpoint hold the report's numbers."""
    report, out = quick_report
    for key, method in report["tasks"]["gpt2-tiny"]["methods"].items():
        for run in method["runs"]:
            run_dir = out / "runs" / "gpt2-tiny" / key / f"seed-{run['seed']}"
            rows = loop_rows(run_dir)
            steps = [r for r in rows if r["step"] >= 1]
            assert run["train_loss"] == [r["loss"] for r in steps]
            assert run["sent_bytes"] == sum(r["wire_bytes"] for r in steps) > 0
            assert run["eval"][-1]["eval_loss"] == steps[-1]["eval_loss"]
            assert run["eval"][0]["eval_loss"] == rows[0]["eval_loss"] and rows[0]["step"] == 0
            # the loop's checkpoint metadata: the job the study asked for
            state = json.loads((run_dir / f"checkpoint-{STEPS}" / "qaccel_state.json").read_text())
            assert state["recipe"] == "gpt2-tiny" and state["step"] == STEPS and state["world_size"] == 2
            assert state["method"] == ("qsdp" if key == "w4g4" else "none")
            assert state["extra"]["training"]["seed"] == run["seed"] and state["extra"]["training"]["per_device_batch_size"] == 4
            assert state["metrics"]["eval_loss"] == run["eval"][-1]["eval_loss"]
            if key == "w4g4":  # QSDP's rounding noise follows the run's seed
                config = state["method_config"]
                assert (config["weight_bits"], config["grad_bits"], config["seed"]) == (4, 4, run["seed"])


@pytest.mark.slow
def test_recorded_command_is_the_users_command(quick_report):
    """The report's command line, placeholders filled in, resolves to the settings the loop recorded for the run."""
    from qaccel.train import check_inputs, parse_args

    report, out = quick_report
    words = shlex.split(report["tasks"]["gpt2-tiny"]["methods"]["w4g4"]["train_command"])
    assert words[:6] == ["torchrun", "--standalone", "--nproc_per_node", "2", "-m", "qaccel.train"]
    run_dir = out / "runs" / "gpt2-tiny" / "w4g4" / "seed-1"
    inputs = check_inputs(parse_args([str(run_dir) if w == "RUN_DIR" else "1" if w == "SEED" else w for w in words[6:]]), world_size=2)
    state = json.loads((run_dir / f"checkpoint-{STEPS}" / "qaccel_state.json").read_text())
    assert inputs.settings.to_dict() == state["extra"]["training"]
    assert inputs.plan.config_dict() == state["method_config"]


@pytest.mark.slow
def test_compression_sends_fewer_bytes_than_its_baseline(quick_report):
    methods = quick_report[0]["tasks"]["gpt2-tiny"]["methods"]
    fsdp = methods["fsdp2"]["summary"]["wire_bytes_per_step_per_rank"]
    # 4-bit codes plus metadata: between 1/8 and 1/4 of fp32
    assert fsdp / 8 < methods["w4g4"]["summary"]["wire_bytes_per_step_per_rank"] < fsdp / 4


@pytest.mark.slow
def test_the_seed_moves_data_and_noise_but_not_the_initialisation(quick_report):
    methods = quick_report[0]["tasks"]["gpt2-tiny"]["methods"]
    for key in ("fsdp2", "w4g4"):
        runs = methods[key]["runs"]
        assert runs[0]["train_loss"] != runs[1]["train_loss"], key  # another data order
    # the recipe's initialisation is the same for every seed: uncompressed, the untrained model's eval is too
    base = methods["fsdp2"]["runs"]
    assert base[0]["eval"][0]["eval_loss"] == base[1]["eval"][0]["eval_loss"]
    # with 4-bit weights the eval already sees QSDP's seeded rounding noise
    w4 = methods["w4g4"]["runs"]
    assert w4[0]["eval"][0]["eval_loss"] != w4[1]["eval"][0]["eval_loss"]


@pytest.mark.slow
def test_merge_renders_without_training_and_refuses_a_task_twice(quick_report, tmp_path, capsys):
    report, out = quick_report
    assert main(["bench", "convergence", "--merge", str(out / "c.json"), "--markdown", str(tmp_path / "m.md"), "--plot", str(tmp_path / "m.png")]) == 0
    assert (tmp_path / "m.md").read_text() == (out / "c.md").read_text()
    capsys.readouterr()
    assert main(["bench", "convergence", "--merge", str(out / "c.json"), str(out / "c.json")]) == 2  # one line, exit 2
    assert re.search(r"^qaccel bench convergence: .*task\(s\) \['gpt2-tiny'\] already", capsys.readouterr().err)


def test_merge_still_renders_the_published_report(tmp_path):
    """docs/bench/convergence.json predates the loop-driven study (fixed eval prefix): its tables still render."""
    published = REPO / "docs" / "bench" / "convergence.json"
    assert main(["bench", "convergence", "--merge", str(published), "--markdown", str(tmp_path / "m.md"), "--plot", str(tmp_path / "m.png")]) == 0
    md = (tmp_path / "m.md").read_text()
    assert "#### gpt2-tiny: 50 steps, 5 seeds, 2 ranks, 4 examples per rank per step, eval on 32 held-out examples" in md
    report = json.loads(published.read_text())
    for name, task in report["tasks"].items():
        assert f"#### {name}: {task['steps']} steps" in md
        for method in task["methods"].values():
            assert f"| {method['label']} | {method['summary']['final_eval_loss_mean']:.4f} ± " in md


def test_merge_renders_the_published_minilm_low_bit_study(tmp_path):
    """docs/bench/convergence_lowbit_minilm.json (task minilm-qsdp): every row renders, in the study's order."""
    published = REPO / "docs" / "bench" / "convergence_lowbit_minilm.json"
    assert main(["bench", "convergence", "--merge", str(published), "--markdown", str(tmp_path / "m.md"), "--plot", str(tmp_path / "m.png")]) == 0
    md = (tmp_path / "m.md").read_text()
    assert md.startswith("#### minilm-qsdp: 45 steps, 5 seeds, 2 ranks")
    task = json.loads(published.read_text())["tasks"]["minilm-qsdp"]
    rows = [line for line in md.splitlines() if line.startswith("| QSDP") or line.startswith("| FSDP2")]
    assert [row.split(" | ")[0][2:] for row in rows] == [task["methods"][key]["label"] for key in task["method_order"]]
    assert task["method_order"][0] == "fsdp2" and task["baseline"] == "fsdp2"
    # each row's mean and difference, recomputed from the runs' own final evals
    finals = {key: statistics.fmean(run["eval"][-1]["eval_loss"] for run in task["methods"][key]["runs"]) for key in task["method_order"]}
    for row, key in zip(rows, task["method_order"], strict=True):
        cells = row.split(" | ")
        assert cells[1].startswith(f"{finals[key]:.4f} ± ")
        assert cells[2] == f"{100 * (finals[key] - finals['fsdp2']) / finals['fsdp2']:+.2f}%"


@pytest.mark.parametrize(
    ("task", "recipe", "warmup", "parallelism"),
    [
        ("gpt2-tiny", "gpt2-tiny", 16, "fsdp2"),
        ("bert-tiny", "bert-tiny", 40, "ddp"),
        ("minilm-finetune", "minilm-finetune", 15, "ddp"),
        # the same recipe, launched as under an FSDP2 config: the baseline is stock FSDP2, QSDP's like for like
        ("minilm-qsdp", "minilm-finetune", 15, "fsdp2"),
    ],
)
def test_every_method_resolves_in_the_training_loop_as_meant(task, recipe, warmup, parallelism, tmp_path, monkeypatch):
    """No launch: the loop's own parser and input check turn each (task, method)'s flags into the intended run."""
    from qaccel.train import check_inputs, parse_args

    spec = TASKS[task]
    launch = hierarchical_env(1, 2, fsdp_launch=spec.fsdp_launch)
    assert launch == ({"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"} if task == "minilm-qsdp" else {})
    for name, value in launch.items():
        monkeypatch.setenv(name, value)
    for method in spec.methods:
        flags = loop_flags(spec, method, steps=spec.steps, eval_every=spec.eval_every)
        args = parse_args([*flags, *seed_flags(method, 3), "--output_dir", str(tmp_path)])
        assert args.eval_on_start and args.allow_nonfinite
        inputs = check_inputs(args, world_size=2)
        cfg, plan = inputs.settings, inputs.plan
        assert (inputs.recipe.name, plan.method, cfg.seed) == (recipe, method.train_method, 3)
        assert (cfg.max_steps, cfg.per_device_batch_size, cfg.eval_steps, cfg.save_steps) == (spec.steps, 4, spec.eval_every, 0)
        assert cfg.warmup_steps == warmup  # the recipe's warm-up, capped at a third of the run
        assert plan.parallelism == parallelism, method.key
        if method.train_method == "qsdp":
            assert plan.qsdp.seed == 3, method.key  # QSDP's noise follows the run's seed
            for name, value in method.qsdp.items():
                assert getattr(plan.qsdp, name) == value, (method.key, name)
        elif plan.qsdp is not None:  # the FSDP2 baseline: stock collectives, only counted
            assert (plan.qsdp.weight_bits, plan.qsdp.grad_bits) == (None, None)
        assert (plan.onebit is not None) == (method.train_method in ("zero_one_adam", "onebit_adam")), method.key


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tasks", "gpt3"], "unknown task 'gpt3'; choose from gpt2-tiny, bert-tiny, minilm-finetune, minilm-qsdp"),
        (["--methods", "w1g1"], r"--methods: unknown \['w1g1'\]"),
        (["--long_steps", "10", "--long_methods", "w1g1"], r"--methods: unknown \['w1g1'\]"),
        (["--seeds", "0"], "--seeds=0: must be >= 1"),
        (["--long_only"], "--long_only: needs --long_steps N"),
    ],
)
def test_bad_arguments_name_the_value(argv, message, capsys):
    # Bad input: one line on stderr and exit 2, before any rank starts.
    assert main(["bench", "convergence", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qaccel bench convergence: ") and re.search(message, err[0])


def test_a_run_folder_is_never_overwritten(tmp_path):
    (tmp_path / "gpt2-tiny" / "w4g4" / "seed-0").mkdir(parents=True)
    with pytest.raises(ValueError, match=re.escape(f"--runs_dir {tmp_path}: {tmp_path / 'gpt2-tiny' / 'w4g4'} already exist")):
        main(["bench", "convergence", "--tasks", "gpt2-tiny", "--methods", "w4g4", "--runs_dir", str(tmp_path)])


# ---- hierarchical mesh (--replicas R > 1): stock HSDP vs hierarchical QSDP ----------------------------------


def test_hierarchical_mesh_is_what_accelerate_launch_exports():
    """The study's mesh variables are the ones ``accelerate launch`` exports for launch_configs/cpu_2x2_hqsdp.yaml
    (Accelerate's own launcher code computes the reference), and Accelerate reads them as a 2 x 2 HSDP mesh."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils.launch import prepare_extend_env_parallelism_config, prepare_multi_gpu_env


    launch_args = launch_command_parser().parse_args(["--config_file", str(REPO / "launch_configs" / "cpu_2x2_hqsdp.yaml"), "train.py"])
    launch_args, _, _ = _validate_launch_command(launch_args)
    assert mesh_env(2, 4) == prepare_extend_env_parallelism_config(launch_args, {})
    assert mesh_env(1, 4) == {}  # the 1-D study's runs get no mesh variables: unchanged
    # Every variable a hierarchical run gets is one accelerate launch exports for that FSDP2 config, with its value
    # (the FSDP ones decide that --method none and the 1-bit optimizers run on FSDP2 / HSDP shards).
    exported = prepare_multi_gpu_env(launch_args)
    assert hierarchical_env(2, 4).items() <= exported.items()
    assert {"ACCELERATE_USE_FSDP", "FSDP_VERSION"} <= set(hierarchical_env(2, 4)) and hierarchical_env(1, 4) == {}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in mesh_env(2, 4).items():
            mp.setenv(name, value)
        config = ParallelismConfig()
        assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size, config.cp_size) == (2, 2, 1, 1)


def test_hierarchical_methods_resolve_in_the_training_loop_as_meant(tmp_path, monkeypatch):
    """No launch: under the mesh variables, each hierarchical method's flags become the intended plan; the baseline is
    ``--method none`` (stock HSDP: every codec off, the replica all-reduce exact)."""
    from qaccel.bench._convergence_tasks import select_methods
    from qaccel.train import check_inputs, parse_args

    for name, value in hierarchical_env(2, 4).items():
        monkeypatch.setenv(name, value)
    spec = TASKS["gpt2-tiny"]
    methods = select_methods(spec, None, replicas=2)
    assert [m.key for m in methods] == ["hsdp", "hqsdp-w8g8-r4", "hqsdp-w8g8-r8", "hqsdp-off-r4", "hsdp-zero_one_adam", "hsdp-onebit_adam"]
    expected = {  # (train method, weight_bits, grad_bits, replica_grad_bits, goal), as the issue names the methods
        "hsdp": ("none", None, None, None, None),
        "hqsdp-w8g8-r4": ("qsdp", 8, 8, 4, 1.0),
        "hqsdp-w8g8-r8": ("qsdp", 8, 8, 8, 1.0),
        "hqsdp-off-r4": ("qsdp", None, None, 4, 1.0),
        # the 1-bit optimizers compress across replicas themselves; inside a node stock FSDP2
        "hsdp-zero_one_adam": ("zero_one_adam", None, None, None, 2.0),
        "hsdp-onebit_adam": ("onebit_adam", None, None, None, None),
    }
    for method in methods:
        args = parse_args([*loop_flags(spec, method, steps=spec.steps, eval_every=spec.eval_every), *seed_flags(method, 3), "--output_dir", str(tmp_path)])
        plan = check_inputs(args, world_size=4).plan
        assert (plan.method, plan.parallelism) == (expected[method.key][0], "fsdp2"), method.key
        bits = (plan.qsdp.weight_bits, plan.qsdp.grad_bits, plan.qsdp.replica_grad_bits)
        assert (plan.method, *bits, method.goal_pct) == expected[method.key], method.key
        assert method.baseline == (method.key == "hsdp")


# The 0/1 Adam settings each task's HSDP row runs with (recipe values under the flags), and the step kinds its
# schedule then takes in the study's run, counted by hand from DeepSpeed's rules (steps 2..F+1 are phase 1; a
# variance step when t is a multiple of an interval that doubles after 8 updates; in phase 2 a sync when t is a
# multiple of an interval that doubles every alpha steps up to H):
#   gpt2-tiny, 50 steps, F 25: variance at t = 2..9 and 10, 12, .., 24 (16), the other 9 of t = 2..26 1-bit;
#     t = 27..31 sync (5); 32..36 every 2nd (3 syncs, 2 local); 37..41 every 4th (1, 4); 42..50 every 8th (1, 8).
_ZOADAM_HSDP = {
    "gpt2-tiny": (
        {"var_freeze_step": 25, "var_update_scaler": 8, "local_step_scaler": 5, "local_step_clipper": 8, "betas": (0.9, 0.95), "gradient_clipping": 0.0},
        {"init": 1, "full": 16, "onebit_gradient": 9, "local": 14, "sync": 10},
    ),
}


@pytest.mark.parametrize("task", ["gpt2-tiny"])
def test_zero_one_adam_on_hsdp_shards_reaches_local_steps_within_the_run(task, tmp_path, monkeypatch):
    """No launch: the 0/1 Adam row's flags reach the loop's ZeroOneAdamConfig, and with them the run's steps
    include local steps (phase 2, nothing sent) — the part of 0/1 Adam the +2% goal is about."""
    from qaccel.bench._convergence_tasks import select_methods
    from qaccel.optim._schedule import ZeroOneAdamSchedule, count_step_kinds
    from qaccel.train import check_inputs, parse_args

    for name, value in hierarchical_env(2, 4).items():
        monkeypatch.setenv(name, value)
    spec = TASKS[task]
    baseline, method = select_methods(spec, ["hsdp-zero_one_adam"], replicas=2)
    assert (baseline.key, baseline.train_method, baseline.baseline) == ("hsdp", "none", True)
    assert (method.key, method.train_method, method.goal_pct) == ("hsdp-zero_one_adam", "zero_one_adam", 2.0)
    args = parse_args([*loop_flags(spec, method, steps=spec.steps, eval_every=spec.eval_every), *seed_flags(method, 3), "--output_dir", str(tmp_path)])
    inputs = check_inputs(args, world_size=4)
    plan, config = inputs.plan, inputs.plan.onebit
    assert (plan.parallelism, plan.qsdp.replica_grad_bits, inputs.settings.seed) == ("fsdp2", None, 3)
    settings, kinds = _ZOADAM_HSDP[task]
    assert {name: getattr(config, name) for name in settings} == settings
    assert config.lr == inputs.settings.learning_rate == 1e-3  # the recipe's training settings, as for the baseline
    schedule = lambda: ZeroOneAdamSchedule(config.var_freeze_step, config.var_update_scaler, config.local_step_scaler, config.local_step_clipper)  # noqa: E731
    counts = {kind.value: n for kind, n in count_step_kinds(schedule, spec.steps).items() if n}
    assert counts == kinds


def test_hierarchical_method_selection_keeps_the_baseline_and_the_json_keys_of_every_task():
    """``--methods`` picks rows of each task's hierarchical list (the baseline always runs); tasks without one are named."""
    from qaccel.bench._convergence_tasks import default_tasks, hierarchical_tasks, select_methods

    assert hierarchical_tasks() == ["gpt2-tiny"]  # bert-tiny's masked-LM head cannot be sharded by Accelerate's FSDP2 yet
    picks = ["hsdp-zero_one_adam", "hsdp-onebit_adam"]
    assert [m.key for m in select_methods(TASKS["gpt2-tiny"], picks, replicas=2)] == ["hsdp", "hsdp-zero_one_adam", "hsdp-onebit_adam"]
    # the 1-D rows are untouched (their keys name the published JSON's methods)
    assert [m.key for m in select_methods(TASKS["bert-tiny"], None)] == ["adamw", "zero_one_adam", "onebit_adam"]
    assert [m.key for m in select_methods(TASKS["gpt2-tiny"], None)] == ["fsdp2", "w8g8", "w8g8-b128-bf16", "w4g4", "w4g4-b1024-fp32", "w4g4-b64-bf16"]
    # the low-bit study runs only when asked for, as a group or by name
    lowbit = [m.key for m in select_methods(TASKS["gpt2-tiny"], ["lowbit"])]
    assert lowbit[:2] == ["fsdp2", "w4g4"] and len(lowbit) == 2 + 44 and "w3g2-rot-ef" in lowbit and "w2g2-nr-ef" in lowbit
    assert [m.key for m in select_methods(TASKS["gpt2-tiny"], ["w3g2-ef"])] == ["fsdp2", "w3g2-ef"]
    # QSDP on the pretrained MiniLM: the same rows against stock FSDP2, and only when named in --tasks
    assert [m.key for m in select_methods(TASKS["minilm-qsdp"], None)] == ["fsdp2", "w8g8", "w4g4"]
    assert [m.key for m in select_methods(TASKS["minilm-qsdp"], ["lowbit"])] == lowbit
    assert default_tasks() == ["gpt2-tiny", "bert-tiny", "minilm-finetune"]
    # the flags a row adds, in the loop's syntax (a pair is one comma-separated value)
    gpt2_zoadam = select_methods(TASKS["gpt2-tiny"], ["hsdp-zero_one_adam"], replicas=2)[1]
    assert loop_flags(TASKS["gpt2-tiny"], gpt2_zoadam, steps=50, eval_every=10)[-10:] == [
        "--zoadam_var_freeze_step", "25", "--zoadam_var_update_scaler", "8", "--zoadam_local_step_scaler", "5",
        "--zoadam_local_step_clipper", "8", "--zoadam_betas", "0.9,0.95",
    ]  # fmt: skip
    assert not any(flag.startswith("--zoadam_") for flag in loop_flags(TASKS["bert-tiny"], TASKS["bert-tiny"].methods[1], steps=120, eval_every=30))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--replicas", "0"], "--replicas=0: must be >= 1"),
        (["--replicas", "3", "--world_size", "4"], "--replicas 3: --world_size 4 is not divisible by it"),
        (["--replicas", "2"], "--replicas 2: --world_size 2 leaves 1 rank per replica"),
        (["--replicas", "2", "--world_size", "4", "--tasks", "minilm-finetune"], "--replicas 2: task minilm-finetune runs on DDP .*no hierarchical variant"),
        (["--replicas", "2", "--world_size", "4", "--tasks", "minilm-qsdp"], "--replicas 2: task minilm-qsdp runs on FSDP2 on one level .*no hierarchical variant"),
        (["--replicas", "2", "--world_size", "4", "--methods", "w8g8"], "--methods w8g8: run.* on a 1-D mesh"),
        (["--replicas", "2", "--world_size", "4", "--tasks", "gpt2-tiny", "--methods", "zero_one_adam"], "--methods zero_one_adam: run.* on a 1-D mesh.* hsdp-zero_one_adam"),
        (["--methods", "hqsdp-w8g8-r4"], r"--methods hqsdp-w8g8-r4: run.* on a hierarchical mesh \(--replicas R > 1\)"),
        (["--tasks", "bert-tiny", "--methods", "hsdp-zero_one_adam"], r"--methods hsdp-zero_one_adam: run.* on a hierarchical mesh"),
        (["--replicas", "2", "--world_size", "4", "--long_steps", "10"], "--long_steps 10: the long run is 1-D"),
    ],
)
def test_bad_hierarchical_arguments_name_the_value(argv, message, capsys):
    # Bad input: one line on stderr and exit 2, before any rank starts.
    assert main(["bench", "convergence", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qaccel bench convergence: ") and re.search(message, err[0])


@pytest.mark.slow  # two 4-rank launches on 2 cores: about 2 minutes; the planning tests above run in the default tier
def test_quick_hierarchical_study_runs_on_two_replicas_against_stock_hsdp(tmp_path, monkeypatch_module):
    """One seed, stock HSDP vs hierarchical QSDP W8G8 r4 on 2 replicas x 2 ranks: two launches of the user's loop.

    What the loop itself wrote says the runs were hierarchical (its start line), that the baseline is stock HSDP
    (``--method none``, every codec off) and that the 4-bit replica all-reduce moved fewer bytes across replicas."""
    runs = tmp_path / "runs"
    argv = ["bench", "convergence", "--quick", "--replicas", "2", "--world_size", "4", "--tasks", "gpt2-tiny", "--methods", "hqsdp-w8g8-r4"]
    argv += ["--seeds", "1", "--steps", "2", "--eval_every", "2"]
    assert main([*argv, "--runs_dir", str(runs), "--json", str(tmp_path / "h.json"), "--markdown", str(tmp_path / "h.md")]) == 0
    report = json.loads((tmp_path / "h.json").read_text())
    task = report["tasks"]["gpt2-tiny"]
    assert (task["world_size"], task["replicas"], task["ranks_per_replica"], task["baseline"]) == (4, 2, 2, "hsdp")
    assert task["method_order"] == ["hsdp", "hqsdp-w8g8-r4"]
    assert "#### gpt2-tiny: 2 steps, 1 seed, 4 ranks on 2 replicas x 2 ranks" in (tmp_path / "h.md").read_text()
    inter = {}
    for key, method in task["methods"].items():
        run_dir = runs / "gpt2-tiny" / key / "seed-0"
        assert "on fsdp2 (hierarchical: 2 replicas x 2 shards), 4 processes" in (run_dir / "launch.log").read_text(), key
        state = json.loads((run_dir / "checkpoint-2" / "qaccel_state.json").read_text())
        assert state["world_size"] == 4 and state["extra"]["parallelism"] == "fsdp2"
        if key == "hsdp":  # --method none: the recipe's FSDP2, no codec
            assert state["method"] == "none" and state["method_config"] == {"parallelism": "fsdp2"}
        else:
            config = state["method_config"]
            assert state["method"] == "qsdp" and (config["weight_bits"], config["grad_bits"], config["replica_grad_bits"]) == (8, 8, 4)
        rows = [r for r in loop_rows(run_dir) if r["step"] >= 1]
        assert method["runs"][0]["sent_bytes_inter_node"] == sum(r["wire_bytes_inter_node"] for r in rows) > 0
        inter[key] = method["summary"]["wire_bytes_inter_node_per_step_per_rank"]
        words = shlex.split(method["train_command"])
        mesh = [f"{k}={v}" for k, v in hierarchical_env(2, 4).items()]  # the hierarchical mesh, as accelerate launch exports it
        assert words[: len(mesh)] == mesh and words[len(mesh) : len(mesh) + 2] == ["torchrun", "--standalone"]
    # Stock HSDP sends an exact fp32 all-reduce of each rank's gradient shard across the 2 replicas: a ring all-reduce
    # sends 2 (R - 1) / R = 1 shard per rank per step. The shard, from the recipe's model (FSDP2 pads dim 0 to 2 rows).
    from qaccel.zoo import load_model, load_recipe, load_tokenizer

    recipe = load_recipe("gpt2-tiny")
    model = load_model(recipe, load_tokenizer(recipe, None))
    shard = sum(math.ceil(p.shape[0] / 2) * (p.numel() // p.shape[0]) for p in model.parameters())
    assert inter["hsdp"] == 4 * shard
    # 4-bit codes and their bucket metadata across replicas, against fp32: between 1/8 and 1/4 of stock HSDP's
    assert inter["hsdp"] / 8 < inter["hqsdp-w8g8-r4"] < inter["hsdp"] / 4
