"""``qaccel bench convergence``: eval loss of compressed methods against their uncompressed baseline, over seeds.

Each (task, method, seed) is one run of the package's training loop, launched as a user launches it
(``torchrun --standalone --nproc_per_node 2 -m qaccel.train --recipe TASK ...``, CPU ranks over gloo,
one thread each), and is evaluated by the loop on the recipe's eval split before training, at fixed
intervals and at the end; the study reads the run's ``metrics.jsonl``. The seeds are shared by the
methods of a task, so every method sees the same data orders; the seed also sets QSDP's rounding
noise. Reported per method: final eval loss mean ± std over seeds, its difference to the baseline in
% and in units of the baseline's seed std, the paired per-seed difference, and a verdict against the
goals (W8G8 +1%, W4G4 +2%, 0/1 Adam +2% of the baseline, and within its seed spread). An optional long
single-seed run of the tiny GPT (``--long_steps``) shows whether gaps close or grow. The task
minilm-qsdp (QSDP on the pretrained MiniLM against stock FSDP2, launched as under an FSDP2 launch
config) runs only when named in ``--tasks``.

``--replicas R`` (R > 1) runs the tasks on a hierarchical mesh instead: R replicas of
``--world_size / R`` ranks each, handed to every run as ``accelerate launch`` hands an FSDP2 launch
config with a ``parallelism_config`` to a script (``ACCELERATE_USE_FSDP``, ``PARALLELISM_CONFIG_*``).
The methods are then stock HSDP + AdamW (the baseline, ``--method none``), hierarchical QSDP
variants (gpt2-tiny; goal +1% each) and 0/1 Adam (goal +2%) and 1-bit Adam on HSDP shards; tasks
without hierarchical methods (minilm-finetune) are refused.

Run folders go to ``--runs_dir`` (kept: ``metrics.jsonl``, the final checkpoint, ``launch.log``) or
to a temporary folder that is removed run by run.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from . import _convergence_report, _convergence_stats
from ._convergence_run import hierarchical_env, loop_flags, seed_flags, train_command, train_run
from ._convergence_tasks import (
    TASKS,
    Method,
    Task,
    default_tasks,
    hierarchical_tasks,
    select_methods,
    task_by_name,
    task_methods,
)

__all__ = ["add_arguments", "run", "LONG_METHODS", "ConvergenceInputError"]


class ConvergenceInputError(ValueError):
    """A bad command-line value or ``--merge`` input, found before any rank starts (the CLI prints one line, exit 2)."""

logger = logging.getLogger(__name__)

LONG_METHODS = ("fsdp2", "w8g8", "w4g4")  # the long gpt2-tiny run: baseline and the two default codecs
QUICK_SEEDS = 2
LONG_FOLDER = "gpt2-tiny-long"  # the long run's folder under --runs_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", nargs="+", default=None, metavar="TASK", help=f"tasks to run (default: {', '.join(default_tasks())}; also: {', '.join(t for t in TASKS if t not in default_tasks())})")
    parser.add_argument("--methods", nargs="+", default=None, metavar="METHOD", help="methods to run (default: all of each task; the baseline always runs)")
    parser.add_argument("--seeds", type=int, default=None, help="seeds per method, 0..N-1 (default 5; --quick: 2)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run for every task (default: per task)")
    parser.add_argument("--eval_every", type=int, default=None, help="eval interval in steps (default: per task)")
    parser.add_argument("--long_steps", type=int, default=0, help="also train gpt2-tiny this many steps, 1 seed, FSDP2 vs W8G8 vs W4G4 (default 0: off)")
    parser.add_argument(
        "--long_methods", nargs="+", default=None, metavar="METHOD",
        help=f"gpt2-tiny methods of the long run (default: {' '.join(LONG_METHODS)}; the baseline always runs; groups such as lowbit allowed)",
    )  # fmt: skip
    parser.add_argument("--long_only", action="store_true", help="run only the long gpt2-tiny run (with --long_steps)")
    parser.add_argument("--quick", action="store_true", help="a few steps and 2 seeds: checks the pipeline, not convergence")
    parser.add_argument("--world_size", type=int, default=2, help="CPU ranks (default 2)")
    parser.add_argument(
        "--replicas", type=int, default=1,
        help="hierarchical mesh: this many replicas of world_size/replicas sharded ranks (Accelerate's dp_replicate_size); "
        "runs stock HSDP + AdamW vs hierarchical QSDP and the 1-bit optimizers on HSDP shards "
        "(default 1: every rank in one shard group)",
    )  # fmt: skip
    parser.add_argument("--runs_dir", default=None, help="keep each run's folder here: TASK/METHOD/seed-N (default: a temporary folder, removed)")
    parser.add_argument("--plot", default=None, help="write the PNG here (default: next to --json)")
    parser.add_argument("--markdown", default=None, help="write the Markdown tables here")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON", help="combine reports of earlier runs (e.g. one per task) instead of training")


def _check_mesh(replicas: int, world_size: int, long_steps: int) -> None:
    """``--replicas`` against ``--world_size``: R replicas of at least 2 sharded ranks each."""
    if replicas < 1:
        raise ValueError(f"--replicas={replicas}: must be >= 1 (1: a 1-D mesh)")
    if replicas == 1:
        return
    if world_size % replicas:
        raise ValueError(
            f"--replicas {replicas}: --world_size {world_size} is not divisible by it (world size = replicas x ranks per replica)"
        )
    if world_size // replicas < 2:
        raise ValueError(
            f"--replicas {replicas}: --world_size {world_size} leaves {world_size // replicas} rank per replica; hierarchical "
            f"runs shard within each replica, so they need >= 2 ranks per replica (e.g. --world_size {2 * replicas})"
        )
    if long_steps:
        raise ValueError(
            f"--long_steps {long_steps}: the long run is 1-D (FSDP2 vs W8G8 vs W4G4); drop it or --replicas {replicas}"
        )


def _check(args: argparse.Namespace) -> tuple[list[str], int]:
    if args.long_only and not args.long_steps:
        raise ValueError("--long_only: needs --long_steps N (N >= 1)")
    if args.long_only and args.tasks:
        raise ValueError(f"--long_only: runs gpt2-tiny's long run only; drop --tasks {' '.join(args.tasks)}")
    _check_mesh(args.replicas, args.world_size, args.long_steps)
    tasks = [] if args.long_only else args.tasks or (default_tasks() if args.replicas == 1 else hierarchical_tasks())
    for name in tasks:
        task_by_name(name)  # names the bad value
    seeds = args.seeds if args.seeds is not None else (QUICK_SEEDS if args.quick else 5)
    for flag, value, low in (("--seeds", seeds, 1), ("--world_size", args.world_size, 2), ("--long_steps", args.long_steps, 0)):
        if value < low:
            raise ValueError(f"{flag}={value}: must be >= {low}")
    for flag, value in (("--steps", args.steps), ("--eval_every", args.eval_every)):
        if value is not None and value < 1:
            raise ValueError(f"{flag}={value}: must be >= 1")
    for name in tasks:
        select_methods(TASKS[name], args.methods, args.replicas)  # unknown method names (or DDP tasks on 2 levels) fail here, before any rank starts
    _long_methods(args)
    return tasks, seeds


def _long_methods(args: argparse.Namespace) -> tuple[Method, ...]:
    """gpt2-tiny's methods of the long run: ``--long_methods`` (or :data:`LONG_METHODS`), the baseline first."""
    return select_methods(TASKS["gpt2-tiny"], getattr(args, "long_methods", None) or list(LONG_METHODS))


def run(args: argparse.Namespace) -> dict:
    """Train (or merge) the study; bad input raises :class:`ConvergenceInputError` before any rank starts."""
    try:
        checked = None if args.merge else _check(args)
        report = _merge(args.merge) if args.merge else None
    except ValueError as exc:
        raise ConvergenceInputError(str(exc)) from None
    if report is None:
        report = _measure(args, checked)
    png = args.plot or (str(Path(args.json_path).with_suffix(".png")) if getattr(args, "json_path", None) else None)
    if png:
        _convergence_report.plot(report, png)
        report["png"] = png
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(_convergence_report.markdown(report) + "\n")
        report["markdown"] = args.markdown
    return report


def _merge(paths: list[str]) -> dict:
    """One report from the JSON of several runs (e.g. one per task), without training anything."""
    merged: dict | None = None
    for path in paths:
        try:
            part = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"--merge {path}: cannot read a JSON report ({exc})") from None
        if part.get("benchmark") != "convergence":
            raise ValueError(f"--merge {path}: benchmark={part.get('benchmark')!r}, expected 'convergence'")
        part.pop("schema_version", None)
        _fill_order(part)
        if merged is None:
            merged = {**part, "tasks": dict(part["tasks"]), "commands": list(part["commands"]), "task_order": list(part["task_order"])}
            continue
        if part["seeds"] != merged["seeds"] or part["quick"] != merged["quick"]:
            raise ValueError(f"--merge {path}: seeds {part['seeds']} / quick {part['quick']} differ from the first report's")
        twice = sorted(set(part["tasks"]) & set(merged["tasks"]))
        if twice:
            raise ValueError(f"--merge {path}: task(s) {twice} already in an earlier report")
        merged["tasks"].update(part["tasks"])
        merged["task_order"] += part["task_order"]
        merged["commands"] += part["commands"]
        merged["seconds"] = round(merged["seconds"] + part["seconds"], 1)
        if part.get("long_run"):
            if merged.get("long_run"):
                raise ValueError(f"--merge {path}: a second long run")
            merged["long_run"] = part["long_run"]
    for key in ("png", "markdown"):
        merged.pop(key, None)
    return merged


def _fill_order(report: dict) -> None:
    """Orders lost to the sorted JSON keys: the task and method order of the study's definitions."""
    report.setdefault("task_order", [name for name in TASKS if name in report["tasks"]])
    if "command" in report:  # a single command line, as the first reports wrote it
        report.setdefault("commands", [report.pop("command")])
    sections = list(report["tasks"].values()) + ([report["long_run"]] if report.get("long_run") else [])
    for section in sections:
        known = dict.fromkeys(m.key for task in TASKS.values() for m in task.methods)  # every key once, in definition order
        section.setdefault("method_order", [key for key in known if key in section["methods"]])


def _measure(args: argparse.Namespace, checked: tuple[list[str], int]) -> dict:
    tasks, num_seeds = checked
    seeds = list(range(num_seeds))
    jobs: list[tuple] = []  # (folder under the runs dir, task, method, seeds, steps, eval interval)
    settings: dict[str, dict] = {}
    for name in tasks:
        task = TASKS[name]
        steps = args.steps or (task.quick_steps if args.quick else task.steps)
        eval_every = args.eval_every or (max(1, steps // 2) if args.quick else task.eval_every)
        settings[name] = {"steps": steps, "eval_every": eval_every}
        jobs += [(name, task, method, seeds, steps, eval_every) for method in select_methods(task, args.methods, args.replicas)]
    if args.long_steps:
        long_eval = max(1, args.long_steps // 20)
        jobs += [(LONG_FOLDER, TASKS["gpt2-tiny"], m, [0], args.long_steps, long_eval) for m in _long_methods(args)]
    root = Path(args.runs_dir) if args.runs_dir else Path(tempfile.mkdtemp(prefix="qaccel-convergence-"))
    folders = [root / folder / method.key for folder, _, method, *_ in jobs]
    taken = [str(folder) for folder in folders if folder.exists()]
    if taken:
        raise ValueError(f"--runs_dir {root}: {', '.join(taken)} already exist; a run never overwrites another (choose an empty folder)")
    logger.info("bench convergence: %d jobs (%s) x %d seeds on %d CPU ranks, runs in %s", len(jobs), ", ".join(tasks), num_seeds, args.world_size, root)
    started = time.perf_counter()
    try:
        results = [
            _train_seeds(folder, *job[1:], world_size=args.world_size, replicas=args.replicas, keep=bool(args.runs_dir))
            for folder, job in zip(folders, jobs, strict=True)
        ]
    finally:
        if not args.runs_dir:
            shutil.rmtree(root, ignore_errors=True)
    report: dict = {
        "benchmark": "convergence",
        "commands": [_command_line(args)],
        "machine": _machine(args.world_size, args.replicas),
        "seeds": seeds,
        "quick": bool(args.quick),
        "task_order": tasks,
        "tasks": {},
        "long_run": None,
        "seconds": round(time.perf_counter() - started, 1),
    }
    split = len(results) - (len(_long_methods(args)) if args.long_steps else 0)  # the long run's jobs come last
    study, long = results[:split], results[split:]
    for name in tasks:
        task = TASKS[name]
        mine = [r for r in study if r["task"] == name]
        report["tasks"][name] = {
            **settings[name],
            "seeds": num_seeds,
            "world_size": args.world_size,
            **({"replicas": args.replicas, "ranks_per_replica": args.world_size // args.replicas} if args.replicas > 1 else {}),
            "per_device_batch_size": task.per_device_batch_size,
            "why": task.why,
            "baseline": next(m.key for m in task_methods(task, args.replicas) if m.baseline),
            "method_order": [r["method"] for r in mine],  # the JSON is written with sorted keys
            "methods": _methods(task_methods(task, args.replicas), mine),
        }
    if long:
        report["long_run"] = {
            "steps": args.long_steps,
            "eval_every": max(1, args.long_steps // 20),
            "seeds": 1,
            "method_order": [r["method"] for r in long],
            "methods": _methods(TASKS["gpt2-tiny"].methods, long),
        }
    return report


def _train_seeds(
    folder: Path,
    task: Task,
    method: Method,
    seeds: list[int],
    steps: int,
    eval_every: int,
    *,
    world_size: int,
    replicas: int = 1,
    keep: bool,
) -> dict:
    """One ``qaccel.train`` job per seed in ``folder/seed-N`` (on a hierarchical mesh if ``replicas`` > 1);
    each folder is removed after reading unless ``keep``."""
    flags = loop_flags(task, method, steps=steps, eval_every=eval_every)
    runs = []
    for seed in seeds:
        output_dir = folder / f"seed-{seed}"
        run = train_run(
            method, seed, flags, world_size=world_size, output_dir=output_dir, timeout_s=600 + 20 * steps, replicas=replicas, fsdp_launch=task.fsdp_launch
        )
        runs.append(run)
        if not keep:  # checkpoints of the pretrained MiniLM are hundreds of MB; the record is all the study needs
            shutil.rmtree(output_dir)
        # progress on stderr whatever the log level: a full study takes an hour
        print(f"bench convergence: {task.name} {method.key} seed {seed}: eval loss {run['eval'][-1]['eval_loss']:.4f} "
              f"after {steps} steps ({run['seconds']:.0f} s)", file=sys.stderr, flush=True)  # fmt: skip
    # The loop's command line for this method, as a user would type it (torchrun is the launcher the study ran;
    # a hierarchical mesh travels in the environment, as accelerate launch passes it).
    launched = train_command([*flags, *seed_flags(method, "SEED")], world_size=world_size, output_dir="RUN_DIR")
    mesh = [f"{name}={value}" for name, value in hierarchical_env(replicas, world_size, fsdp_launch=task.fsdp_launch).items()]
    command = shlex.join([*mesh, "torchrun", *launched[3:]])  # launched[:3]: this interpreter's `-m torch.distributed.run`
    return {"task": task.name, "method": method.key, "runs": runs, "train_command": command}


def _methods(methods: tuple[Method, ...], results: list[dict]) -> dict:
    """Per method key: label, runs, eval curve band and the summary against the baseline."""
    by_key = {r["method"]: r for r in results}
    base_key = next(m.key for m in methods if m.baseline)
    out = {}
    for method in methods:
        if method.key not in by_key:
            continue
        runs = by_key[method.key]["runs"]
        out[method.key] = {
            "label": method.label,
            "is_baseline": method.baseline,
            "train_method": method.train_method,
            "qsdp": method.qsdp,
            # --zoadam_* flags; rows without them keep their keys
            **({"zoadam": method.zoadam} if method.zoadam else {}),
            "config": runs[0]["config"],
            "train_command": by_key[method.key]["train_command"],
            "runs": [{k: v for k, v in run.items() if k != "config"} for run in runs],
            "eval_curve": _convergence_stats.curve_band(runs),
            "summary": _convergence_stats.summarize_method(runs, by_key[base_key]["runs"], method.goal_pct, is_baseline=method.baseline),
        }
        if "sent_bytes_inter_node" in runs[0]:  # a hierarchical run: the part of the traffic that crossed replicas
            per_step = [run["sent_bytes_inter_node"] / len(run["train_loss"]) for run in runs]
            out[method.key]["summary"]["wire_bytes_inter_node_per_step_per_rank"] = sum(per_step) / len(per_step)
    return out


def _command_line(args: argparse.Namespace) -> str:
    """The command that makes this report, rebuilt from the parsed options (defaults left out)."""
    parts = ["qaccel", "bench", "convergence"]
    for flag, value in (("--tasks", args.tasks), ("--methods", args.methods), ("--long_methods", getattr(args, "long_methods", None))):
        if value:
            parts += [flag, *value]
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--eval_every", args.eval_every)):
        if value is not None:
            parts += [flag, str(value)]
    if args.long_steps:
        parts += ["--long_steps", str(args.long_steps)]
    if args.long_only:
        parts.append("--long_only")
    if args.quick:
        parts.append("--quick")
    if args.world_size != 2:
        parts += ["--world_size", str(args.world_size)]
    if args.replicas != 1:
        parts += ["--replicas", str(args.replicas)]
    if args.runs_dir:
        parts += ["--runs_dir", args.runs_dir]
    for flag, value in (("--json", getattr(args, "json_path", None)), ("--plot", args.plot), ("--markdown", args.markdown)):
        if value:
            parts += [flag, value]
    return " ".join(shlex.quote(p) for p in parts)


def _machine(world_size: int, replicas: int = 1) -> dict:
    import os

    machine = {
        "cpu": _cpu_model(),
        "logical_cpus": os.cpu_count(),
        "ranks": world_size,
        "threads_per_rank": 1,
        "backend": "gloo",
        "launcher": "torchrun --standalone -m qaccel.train",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    if replicas > 1:
        machine["launcher"] += (
            " with PARALLELISM_CONFIG_* in the environment (as accelerate launch exports a launch config's parallelism_config)"
        )
        machine["mesh"] = (
            f"{replicas} replicas x {world_size // replicas} ranks (dp_replicate_size x dp_shard_size), all on this machine"
        )
    return machine


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
