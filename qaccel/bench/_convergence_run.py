"""One run of the convergence study: the user's training loop, launched the way a user launches it.

Each (task, method, seed) is one ``torchrun --standalone --nproc_per_node N -m qaccel.train`` job
on CPU ranks (gloo, one thread per rank) with the recipe and the study's flags. The study then reads
what the loop wrote: ``metrics.jsonl`` (per-step loss and bytes, eval results at step 0, every
``--eval_steps`` and at the end) and the final checkpoint's ``qaccel_state.json`` (the method config
the loop resolved). Sharding, batching, masking and evaluation are the loop's; nothing here
re-implements them, so the study's numbers are the ones a user's run of the same flags prints.

A hierarchical run (``replicas`` > 1) gets its mesh the way ``accelerate launch`` hands it to a
script: through Accelerate's ``ACCELERATE_USE_PARALLELISM_CONFIG`` / ``PARALLELISM_CONFIG_*``
variables (what a launch config's ``parallelism_config`` section becomes), which the loop's
Accelerator reads as ``ParallelismConfig(dp_replicate_size=R, dp_shard_size=world_size / R)``, and
the FSDP launch variables (``ACCELERATE_USE_FSDP``, ``FSDP_VERSION``) of an FSDP2 launch config.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from ._convergence_tasks import Method, Task

__all__ = [
    "loop_flags",
    "seed_flags",
    "mesh_env",
    "hierarchical_env",
    "FSDP_LAUNCH_ENV",
    "train_command",
    "train_run",
    "read_run",
]

PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the launched ranks import this qaccel, installed or not
LAUNCH_LOG = "launch.log"  # the job's stdout and stderr, in its output folder
# Settings that belong to an outer launcher or would silently change a method: the study's methods
# are its flags and the recipe, nothing else.
_DROPPED_ENV = ("ACCELERATE_", "FSDP_", "QACCEL_QSDP_", "QACCEL_ZERO_ONE_ADAM_", "QACCEL_ONEBIT_ADAM_")


def loop_flags(task: Task, method: Method, *, steps: int, eval_every: int) -> list[str]:
    """The ``qaccel.train`` flags of one (task, method), seed and output folder aside.

    The warm-up is the recipe's, capped at a third of the run (a short study run would otherwise
    spend most of its steps warming up). ``--allow_nonfinite`` lets a diverging method finish and
    be reported as diverged instead of stopping the whole study; finite runs are unaffected.
    """
    from ..zoo import load_recipe

    warmup_steps = min(load_recipe(task.recipe_name).training.warmup_steps, steps // 3)
    flags = [
        "--recipe", task.recipe_name, "--method", method.train_method, "--max_steps", str(steps),
        "--per_device_batch_size", str(task.per_device_batch_size), "--warmup_steps", str(warmup_steps),
        "--eval_steps", str(eval_every), "--eval_on_start", "--save_steps", "0", "--allow_nonfinite",
    ]  # fmt: skip
    for name, value in method.qsdp.items():
        flags += [f"--qsdp_{name}", "none" if value is None else str(value)]
    for name, value in method.zoadam.items():  # a pair such as betas is one comma-separated value
        flags += [f"--zoadam_{name}", ",".join(map(str, value)) if isinstance(value, tuple) else str(value)]
    return flags


def seed_flags(method: Method, seed: int | str) -> list[str]:
    """``--seed`` (data order, dropout, masked-LM masks) and, for QSDP, ``--qsdp_seed`` (rounding noise).

    The model initialisation is the recipe's whatever ``--seed`` says, so it is the same for every
    seed and method and does not hide method differences.
    """
    flags = ["--seed", str(seed)]
    if method.train_method == "qsdp":
        flags += ["--qsdp_seed", str(seed)]
    return flags


# What ``accelerate launch`` exports for an FSDP2 config (``distributed_type: FSDP``, ``fsdp_version: 2``, as in
# launch_configs/cpu_2x2_hqsdp.yaml) that decides the parallelism: the loop runs --method none and the
# 1-bit optimizers on FSDP2 (HSDP shards) only under such a launch, not from the recipe alone.
# The loop sets the plugin's other settings (wrap policy, state-dict type) itself.
FSDP_LAUNCH_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}


def mesh_env(replicas: int, world_size: int) -> dict[str, str]:
    """The variables ``accelerate launch`` exports for ``parallelism_config: {dp_replicate_size: R,
    dp_shard_size: world_size / R, tp_size: 1, cp_size: 1}`` (its ``prepare_extend_env_parallelism_config``,
    e.g. ``launch_configs/cpu_2x2_hqsdp.yaml``); empty for a 1-D run (``replicas`` 1), which the loop
    shards over all ranks."""
    if replicas == 1:
        return {}
    return {
        "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
        "PARALLELISM_CONFIG_DP_REPLICATE_SIZE": str(replicas),
        "PARALLELISM_CONFIG_DP_SHARD_SIZE": str(world_size // replicas),
        "PARALLELISM_CONFIG_TP_SIZE": "1",
        "PARALLELISM_CONFIG_CP_SIZE": "1",
        "PARALLELISM_CONFIG_CP_BACKEND": "torch",  # accelerate launch's defaults for the unused dimensions
        "PARALLELISM_CONFIG_SP_SIZE": "1",
        "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed",
    }


def hierarchical_env(replicas: int, world_size: int, *, fsdp_launch: bool = False) -> dict[str, str]:
    """The variables of a run on ``replicas`` replicas: :func:`mesh_env` and, for a hierarchical mesh
    or with ``fsdp_launch`` (a task launched as under an FSDP2 config), :data:`FSDP_LAUNCH_ENV` (an
    HSDP launch is an FSDP launch); empty for a 1-D run of a task launched as its recipe says."""
    mesh = mesh_env(replicas, world_size)
    return {**mesh, **FSDP_LAUNCH_ENV} if mesh or fsdp_launch else {}


def train_command(flags: list[str], *, world_size: int, output_dir: str | os.PathLike) -> list[str]:
    """``torchrun --standalone`` (a free rendezvous port on localhost) of ``python -m qaccel.train``."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world_size)]
    return [*launcher, "-m", "qaccel.train", *flags, "--output_dir", str(output_dir)]


def _launch_env(mesh: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_DROPPED_ENV)}
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")  # CPU ranks over gloo, one thread each
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(mesh)  # after the drop of outer ACCELERATE_* settings: the study's own mesh
    return env


def train_run(
    method: Method, seed: int, flags: list[str], *, world_size: int, output_dir: Path, timeout_s: float, replicas: int = 1, fsdp_launch: bool = False
) -> dict:
    """Launch one training job and return its run record (see :func:`read_run`) plus its wall time.

    ``replicas`` > 1 launches it on a hierarchical mesh (:func:`mesh_env`); ``fsdp_launch`` as under
    an FSDP2 launch config (:data:`FSDP_LAUNCH_ENV`).

    Raises:
        RuntimeError: the job failed or ran past ``timeout_s`` (the message has the command and
            the tail of its log, ``output_dir/launch.log``).
    """
    command = train_command([*flags, *seed_flags(method, seed)], world_size=world_size, output_dir=output_dir)
    output_dir.mkdir(parents=True, exist_ok=False)
    log = output_dir / LAUNCH_LOG
    started = time.perf_counter()
    with open(log, "w") as out:
        # Its own session: on a timeout or Ctrl-C the launcher and its ranks go down together.
        env = _launch_env(hierarchical_env(replicas, world_size, fsdp_launch=fsdp_launch))
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except BaseException as exc:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if isinstance(exc, subprocess.TimeoutExpired):
                raise RuntimeError(f"{shlex.join(command)}: no result within {timeout_s:.0f} s (killed); log tail:\n{_tail(log)}") from None
            raise
    if code != 0:
        raise RuntimeError(f"{shlex.join(command)}: exit {code}; log tail:\n{_tail(log)}")
    return {**read_run(output_dir, seed, inter_node=replicas > 1), "seconds": round(time.perf_counter() - started, 1)}


def _tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]


def read_run(output_dir: Path, seed: int, *, inter_node: bool = False) -> dict:
    """A finished ``qaccel.train`` run's record, from the files the loop wrote in ``output_dir``.

    Returns:
        ``seed``; ``train_loss`` (per optimizer step, mean over ranks); ``eval`` (per evaluation:
        ``step`` and the loop's ``eval_*`` results, step 0 being the untrained model);
        ``sent_bytes`` (rank 0's training traffic, evaluation excluded); ``train_seconds`` (sum of
        the loop's step times); ``config`` (the method config in the final checkpoint); with
        ``inter_node`` (a hierarchical run), ``sent_bytes_inter_node``: the part of ``sent_bytes``
        that crossed replicas (the loop's ``wire_bytes_inter_node``, summed over steps).

    Raises:
        RuntimeError: ``metrics.jsonl`` lacks a step, or the final checkpoint is missing.
    """
    from ..checkpoint import checkpoint_path, read_run_state
    from ..training import read_metrics

    rows = read_metrics(output_dir / "metrics.jsonl")
    train = [row for row in rows if row["step"] >= 1]
    steps = [row["step"] for row in train]
    if not steps or steps != list(range(1, len(steps) + 1)):
        raise RuntimeError(f"{output_dir / 'metrics.jsonl'}: steps {steps[:5]}...{steps[-3:]}; expected one row per step from 1")
    final = checkpoint_path(output_dir, steps[-1])  # --save_steps 0: the loop saves once, at the end
    try:
        state = read_run_state(final)
    except (FileNotFoundError, ValueError) as err:
        raise RuntimeError(f"{output_dir}: no final checkpoint from qaccel.train ({err})") from None
    evals = [row for row in rows if "eval_loss" in row]
    # float(): metrics.jsonl writes NaN and inf as strings
    record = {
        "seed": seed,
        "train_loss": [float(row["loss"]) for row in train],
        "eval": [{"step": row["step"], **{k: float(v) for k, v in row.items() if k.startswith("eval_") and k != "eval_wire_bytes"}} for row in evals],
        "sent_bytes": train[-1]["wire_bytes_total"],
        "train_seconds": round(sum(row["step_seconds"] for row in train), 2),
        "config": state["method_config"],
    }
    if inter_node:
        record["sent_bytes_inter_node"] = sum(row["wire_bytes_inter_node"] for row in train)
    return record
