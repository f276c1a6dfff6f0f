"""What ``qaccel bench convergence`` trains: tasks, their methods, the goals they are held to.

A task is a zoo recipe plus the few settings the study changes, through the training loop's own
flags, to fit many runs on a small machine (steps, batch, warm-up, eval interval). A method is
either a QSDP variant on FSDP2 or an optimizer on DDP; every task has exactly one uncompressed
baseline, against which the others are compared. Method settings other than those named here come
from the recipe, as in any ``python -m qaccel.train --recipe NAME`` run.

On a hierarchical mesh (``--replicas R > 1``: R replicas, each sharded over its own ranks, as
Accelerate's ``ParallelismConfig(dp_replicate_size=R, dp_shard_size=S)``) a task runs its
``hsdp_methods`` instead: stock HSDP + AdamW as the baseline, hierarchical QSDP variants, which
quantize within a replica (``weight_bits``/``grad_bits``) and across replicas
(``replica_grad_bits``), and the 1-bit optimizers on HSDP shards, which compress across replicas
and stay exact within one. Tasks without ``hsdp_methods`` run on DDP only: minilm-finetune, and
bert-tiny, whose masked-LM head Accelerate's FSDP2 preparation cannot shard yet (its prediction bias
is one parameter under two modules, and the output embedding becomes a unit of its own). The
QSDP rows of the pretrained MiniLM are a task of their own (minilm-qsdp: the same recipe launched as
on FSDP2, so its baseline is stock FSDP2), run only when named in ``--tasks``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "Method", "Task", "TASKS", "METHOD_GROUPS", "task_by_name", "task_methods", "select_methods", "hierarchical_tasks", "default_tasks",
]  # fmt: skip


@dataclass(frozen=True)
class Method:
    """One way of communicating: a ``qaccel.train --method`` and the ``--qsdp_*`` settings (QSDPConfig fields) and
    ``--zoadam_*`` settings (ZeroOneAdamConfig / OneBitAdamConfig fields) it adds to the recipe's."""

    key: str  # stable id used in the JSON
    label: str  # for tables and plots
    train_method: str  # qaccel.train --method value: qsdp, none, zero_one_adam, onebit_adam
    qsdp: dict[str, Any] = field(default_factory=dict)
    zoadam: dict[str, Any] = field(default_factory=dict)
    goal_pct: float | None = None  # allowed excess of the mean final eval loss over the baseline's, in %
    baseline: bool = False
    in_default_study: bool = True  # False: runs only when named in --methods (or through a group such as "lowbit")


@dataclass(frozen=True)
class Task:
    """A recipe and the study's settings for it (each becomes a ``qaccel.train`` flag)."""

    name: str  # the task's key in --tasks and the JSON; the recipe's name unless ``recipe`` says otherwise
    steps: int  # optimizer steps per run (default study)
    quick_steps: int  # optimizer steps per run with --quick
    eval_every: int  # --eval_steps (default study); the untrained model and the last step are always evaluated
    per_device_batch_size: int  # --per_device_batch_size
    methods: tuple[Method, ...]
    why: str  # one line: why these settings
    hsdp_methods: tuple[Method, ...] = ()  # on a hierarchical mesh (--replicas R > 1); empty: the task has none
    recipe: str | None = None  # the zoo recipe, if not ``name``
    # True: every run is launched as under an FSDP2 launch config (the loop's ``--method none`` is then
    # stock FSDP2, not the recipe's DDP), for QSDP's baseline on a recipe whose own method is DDP's
    fsdp_launch: bool = False
    in_default_study: bool = True  # False: runs only when named in --tasks

    @property
    def baseline(self) -> Method:
        return next(m for m in self.methods if m.baseline)

    @property
    def recipe_name(self) -> str:
        return self.recipe or self.name


_QSDP_METHODS = (
    Method("fsdp2", "FSDP2 fp32", "none", baseline=True),  # the recipe's FSDP2 job, uncompressed
    Method("w8g8", "QSDP W8G8 (b1024 fp32, default)", "qsdp", {"weight_bits": 8, "grad_bits": 8}, goal_pct=1.0),
    Method(
        "w8g8-b128-bf16",
        "QSDP W8G8 b128 bf16",
        "qsdp",
        {"weight_bits": 8, "grad_bits": 8, "weight_bucket_size": 128, "grad_bucket_size": 128, "weight_meta_dtype": "bfloat16", "grad_meta_dtype": "bfloat16"},
        goal_pct=1.0,
    ),
    Method("w4g4", "QSDP W4G4 (b128 bf16, default)", "qsdp", {"weight_bits": 4, "grad_bits": 4}, goal_pct=2.0),
    Method(
        "w4g4-b1024-fp32",
        "QSDP W4G4 b1024 fp32",
        "qsdp",
        {"weight_bits": 4, "grad_bits": 4, "weight_bucket_size": 1024, "grad_bucket_size": 1024, "weight_meta_dtype": "float32", "grad_meta_dtype": "float32"},
        goal_pct=2.0,
    ),
    Method(
        "w4g4-b64-bf16",
        "QSDP W4G4 b64 bf16",
        "qsdp",
        {"weight_bits": 4, "grad_bits": 4, "weight_bucket_size": 64, "grad_bucket_size": 64},
        goal_pct=2.0,
    ),
)
# Fewer bits (the low-bit study: --methods lowbit): weights and gradients at 2-4 bits with the per-bit
# default buckets (128 elements, bf16 metadata), each plain, with Hadamard rotation of both paths, with
# gradient error feedback (fp32 store), with both, with nearest rounding (both paths) alone, with
# error feedback and with rotation, and with the gradient path alone rotated. The goal is the issue's: within +1% of FSDP2.
_LOWBIT_SETTINGS = ((4, 4), (4, 2), (3, 3), (3, 2), (2, 2))
_LOWBIT_VARIANTS = (
    ("", "", {}),
    ("-rot", ", Hadamard-rotated", {"weight_rotation": "hadamard", "grad_rotation": "hadamard"}),
    ("-ef", ", gradient error feedback", {"grad_error_feedback": "float32"}),
    ("-rot-ef", ", rotated + error feedback", {"weight_rotation": "hadamard", "grad_rotation": "hadamard", "grad_error_feedback": "float32"}),
    # error feedback assumes a contractive compressor (|Q(x) - x| < |x|); stochastic rounding at 2 bits is not one
    ("-nr", ", nearest rounding", {"rounding": "nearest"}),
    ("-nr-ef", ", nearest rounding + error feedback", {"rounding": "nearest", "grad_error_feedback": "float32"}),
    ("-rot-nr", ", rotated + nearest rounding", {"weight_rotation": "hadamard", "grad_rotation": "hadamard", "rounding": "nearest"}),
    # the gradient path alone rotated: the codec study found rotation helps heavy-tailed gradients (MiniLM's), not weights
    ("-grot", ", gradients rotated", {"grad_rotation": "hadamard"}),
    ("-grot-nr", ", gradients rotated + nearest rounding", {"grad_rotation": "hadamard", "rounding": "nearest"}),
)
_LOWBIT_METHODS = tuple(
    Method(
        f"w{w}g{g}{suffix}", f"QSDP W{w}G{g}{label}", "qsdp", {"weight_bits": w, "grad_bits": g, **settings},
        goal_pct=1.0, in_default_study=False,
    )  # fmt: skip
    for w, g in _LOWBIT_SETTINGS
    for suffix, label, settings in _LOWBIT_VARIANTS
    if (w, g, suffix) != (4, 4, "")  # W4G4 plain is the default study's w4g4
)
#: ``--methods`` names that stand for a group of methods
METHOD_GROUPS = {"lowbit": ("w4g4", *(m.key for m in _LOWBIT_METHODS))}
# --method none on a hierarchical launch is stock HSDP: FSDP2 within a replica, an exact fp32 all-reduce across.
_HSDP_METHODS = (
    Method("hsdp", "stock HSDP fp32", "none", baseline=True),
    *(
        Method(f"hqsdp-w8g8-r{bits}", f"hierarchical QSDP W8G8, {bits}-bit across replicas", "qsdp", {"weight_bits": 8, "grad_bits": 8, "replica_grad_bits": bits}, goal_pct=1.0)
        for bits in (4, 8)
    ),
    Method(
        "hqsdp-off-r4",
        "hierarchical QSDP, exact within a replica, 4-bit across",
        "qsdp",
        {"weight_bits": None, "grad_bits": None, "replica_grad_bits": 4},
        goal_pct=1.0,
    ),
)
# The 1-bit optimizers on HSDP shards (--method zero_one_adam / onebit_adam under an FSDP launch with
# replicas): 1 bit (or nothing, on 0/1 Adam's local steps) across replicas, exact FSDP2 within one.
# gpt2-tiny's recipe has no 0/1 Adam section, so its settings are flags. 50 steps with a 16-step
# warm-up: freezing the variance at step 25 (half the run) gives 16 variance updates, and with the
# sync interval doubling every 5 phase-2 steps up to 8, 14 of the last 24 steps are local (10 syncs).
# beta2 0.95 as the AdamW baseline's: 0/1 Adam has no bias correction, and 0.999 would leave the
# variance at 2% of its value after 16 updates (see model_cards/bert-tiny.md).
_GPT2_HSDP_ONEBIT_METHODS = (
    Method(
        "hsdp-zero_one_adam",
        "0/1 Adam on HSDP shards",
        "zero_one_adam",
        zoadam={
            "var_freeze_step": 25,
            "var_update_scaler": 8,
            "local_step_scaler": 5,
            "local_step_clipper": 8,
            "betas": (0.9, 0.95),
        },
        goal_pct=2.0,
    ),
    # 1-bit Adam freezes after the warm-up (as DeepSpeed advises); the issue sets no goal for it
    Method(
        "hsdp-onebit_adam", "1-bit Adam on HSDP shards", "onebit_adam", zoadam={"freeze_step": 16, "betas": (0.9, 0.95)}
    ),
)
_ONEBIT_METHODS = (
    Method("adamw", "DDP AdamW", "none", baseline=True),
    Method("zero_one_adam", "0/1 Adam", "zero_one_adam", goal_pct=2.0),
    Method("onebit_adam", "1-bit Adam", "onebit_adam"),  # the issue sets no goal for it
)

TASKS: dict[str, Task] = {
    "gpt2-tiny": Task(
        name="gpt2-tiny",
        steps=50,
        quick_steps=4,
        eval_every=10,
        per_device_batch_size=4,
        methods=(*_QSDP_METHODS, *_LOWBIT_METHODS),
        why="recipe settings (AdamW 1e-3, cosine), 16 warm-up steps, 50 steps of 2 x 4 sequences of 128 tokens (the recipe: 300 of 2 x 8); eval on the recipe's whole eval split",
        hsdp_methods=(*_HSDP_METHODS, *_GPT2_HSDP_ONEBIT_METHODS),
    ),
    "bert-tiny": Task(
        name="bert-tiny",
        steps=120,
        quick_steps=4,
        eval_every=30,
        per_device_batch_size=4,
        methods=_ONEBIT_METHODS,
        why="recipe settings (0/1 Adam freezes the variance at step 100), 120 steps of 2 x 4 sequences with 40 warm-up steps (the recipe: 300 of 2 x 8, 100 warm-up); eval on the recipe's whole eval split",
    ),
    "minilm-finetune": Task(
        name="minilm-finetune",
        steps=45,
        quick_steps=3,
        eval_every=15,
        per_device_batch_size=4,
        methods=_ONEBIT_METHODS,
        why="recipe settings (0/1 Adam freezes the variance at step 30), 45 steps of 2 x 4 docstrings of up to 64 tokens with 15 warm-up steps (the recipe: 100 of 2 x 8, 30 warm-up); eval on the recipe's whole eval split",
    ),
    # The low-bit study's second task (issue 20): QSDP on the pretrained MiniLM, whose gradients are
    # heavy-tailed where gpt2-tiny's are not, against stock FSDP2 on the same job.
    "minilm-qsdp": Task(
        name="minilm-qsdp",
        recipe="minilm-finetune",
        steps=45,
        quick_steps=3,
        eval_every=15,
        per_device_batch_size=4,
        methods=(
            Method("fsdp2", "FSDP2 fp32", "none", baseline=True),
            *(m for m in _QSDP_METHODS if m.key in ("w8g8", "w4g4")),
            *_LOWBIT_METHODS,
        ),
        why="minilm-finetune's job (45 steps of 2 x 4 docstrings, 15 warm-up steps, eval on the whole eval split) on FSDP2: stock FSDP2 AdamW against QSDP",
        fsdp_launch=True,
        in_default_study=False,
    ),
}


def task_by_name(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"--tasks: unknown task {name!r}; choose from {', '.join(TASKS)}")
    return TASKS[name]


def default_tasks() -> list[str]:
    """The tasks a study without ``--tasks`` runs on a 1-D mesh (those with ``in_default_study``)."""
    return [name for name, task in TASKS.items() if task.in_default_study]


def hierarchical_tasks() -> list[str]:
    """The tasks that run on a hierarchical mesh (those with ``hsdp_methods``)."""
    return [name for name, task in TASKS.items() if task.hsdp_methods]


def task_methods(task: Task, replicas: int = 1) -> tuple[Method, ...]:
    """The task's methods on a 1-D mesh (``replicas`` 1) or on a hierarchical one (``replicas`` > 1).

    Raises:
        ValueError: ``replicas`` > 1 for a task without hierarchical methods (its methods run on DDP only).
    """
    if replicas == 1:
        return task.methods
    if not task.hsdp_methods:
        labels = ", ".join(m.label for m in task.methods if m.in_default_study)  # not the 44 low-bit rows
        parallelism = "FSDP2 on one level" if task.fsdp_launch else "DDP"
        raise ValueError(
            f"--replicas {replicas}: task {task.name} runs on {parallelism} ({labels}), which has no hierarchical variant; "
            f"hierarchical runs need methods on HSDP: choose --tasks {' '.join(hierarchical_tasks())}, or --replicas 1"
        )
    return task.hsdp_methods


def select_methods(task: Task, keys: list[str] | None, replicas: int = 1) -> tuple[Method, ...]:
    """The task's methods (for the mesh ``replicas`` asks for) named in ``keys``; the baseline is always kept.

    ``keys`` None: the default study (every method with ``in_default_study``). A group name of
    :data:`METHOD_GROUPS` stands for its methods.
    """
    methods = task_methods(task, replicas)
    if not keys:
        return tuple(m for m in methods if m.in_default_study)
    keys = [key for name in keys for key in METHOD_GROUPS.get(name, (name,))]
    known = {m.key for m in methods}
    flat = {m.key for t in TASKS.values() for m in t.methods}
    hierarchical = {m.key for t in TASKS.values() for m in t.hsdp_methods}
    unknown = sorted(set(keys) - flat - hierarchical)
    if unknown:
        raise ValueError(
            f"--methods: unknown {unknown}; known methods: {', '.join(sorted(flat))} (1-D), {', '.join(sorted(hierarchical))} (--replicas R > 1)"
        )
    other_mesh = sorted(set(keys) & (flat if replicas > 1 else hierarchical))
    if other_mesh:
        needs = (
            f"a 1-D mesh (--replicas 1); with --replicas {replicas} choose from {', '.join(m.key for m in methods)}"
            if replicas > 1
            else "a hierarchical mesh (--replicas R > 1)"
        )
        raise ValueError(f"--methods {' '.join(other_mesh)}: run(s) on {needs}")
    chosen = set(keys) & known
    return tuple(m for m in methods if m.baseline or m.key in chosen)
