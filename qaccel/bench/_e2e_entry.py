"""What ``qaccel bench e2e`` hands the users' training entry, and what it reads back.

Every configuration is one ``qaccel.train`` run (under :mod:`qaccel.bench._e2e_probe`, which adds the link
counters): the bench model as a recipe file (:func:`write_recipe`: GPT-2 of ``MODELS``' shape from config,
trained on the offline ``stdlib-text`` corpus with its BPE tokenizer), each method as the entry's own flags
(:func:`entry_flags`), and its step figures read back from the run's ``metrics.jsonl`` (``step_seconds``,
``wire_bytes``, ``step_kind``) and the probe files (:func:`read_run`), in the raw form ``_e2e_report`` sums up.

The compute-only time (:func:`compute_jobs`, :func:`read_compute`) is the same entry with ``--method none``
on one process, one such run per rank of the job started together: the same per-rank model, batch and
AdamW step as the job and the same contention for the cores, without any communication. (The same ranks on
an unshaped link would still pay gloo's copies and the loopback's time, and a single run alone on the
machine would not compete for the cores as the job's ranks do.) Its precision is the method's
(``--mixed_precision bf16`` for the bf16 rows: autocast on one process, as near as one process gets to
FSDP2's bf16 parameters); its optimizer covers the whole model, exact for DDP, slightly more than an
FSDP2 rank's shard.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

from ._e2e_methods import METHODS, MODELS, make_schedule, steady_kinds
from ._e2e_plan import E2EError
from ._e2e_probe import PROBE_FILE

__all__ = ["FSDP_LAUNCH_ENV", "write_recipe", "entry_flags", "train_argv", "compute_jobs", "read_compute", "read_run"]

# What ``accelerate launch`` of an FSDP2 config exports (as ``qaccel bench convergence`` sets it): the entry runs
# ``--method none`` and the 1-bit optimizers on FSDP2 only under such a launch, not from the recipe alone.
FSDP_LAUNCH_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2"}
_TRAIN_METHODS = {"onebit": "onebit_adam", "zero_one": "zero_one_adam"}
SMALL_DDP_BUCKET_MB = 4.0  # ddp_buckets="small": 4 MB of fp32 gradients, 128 KB once 1-bit
EVAL_FRACTION = 0.002  # the entry evaluates once, after the last step, on this share of the corpus: short, not measured


def write_recipe(model: str, folder: Path, *, steps: int, lr: float) -> Path:
    """The recipe file of bench model ``model``: its GPT-2 shape, batch and sequence length, ``steps`` steps at ``lr``.

    The recipe's method is ``none``: under an FSDP launch (:data:`FSDP_LAUNCH_ENV`) that is stock FSDP2, else DDP.
    """
    shape, config = MODELS[model], MODELS[model]["config"]
    recipe = {
        "name": f"e2e-{model}",
        "summary": f"qaccel bench e2e's {model}: GPT-2 from config on stdlib text",
        "task": "causal-lm",
        "model": {"name_or_path": None, "transformer_layer_cls": "GPT2Block",
                  "config": {"model_type": "gpt2", **{k: config[k] for k in ("n_layer", "n_embd", "n_head", "n_positions")}}},
        "tokenizer": {"name_or_path": None, "kind": "bpe", "vocab_size": config["vocab_size"]},
        "dataset": {"name": "stdlib-text", "seq_len": shape["seq_len"], "eval_fraction": EVAL_FRACTION, "max_train_examples": None},
        "training": {"max_steps": steps, "per_device_batch_size": shape["batch_size"], "gradient_accumulation_steps": 1,
                     "learning_rate": lr, "weight_decay": 0.0, "warmup_steps": 0, "lr_scheduler": "constant", "seed": 0,
                     "eval_steps": 0, "save_steps": 0, "mixed_precision": "no"},
        "method": {"name": "none"},
        "launch": {"config": "launch_configs/cpu_2proc_ddp.yaml", "num_processes": 2},
    }  # fmt: skip
    path = folder / f"e2e-{model}.yaml"
    path.write_text(json.dumps(recipe, indent=1) + "\n")  # JSON is YAML
    return path


def _model_mb(model: str) -> float:
    c = MODELS[model]["config"]
    params = c["n_layer"] * 13 * c["n_embd"] ** 2 + (c["vocab_size"] + c["n_positions"]) * c["n_embd"]
    return params * 4 / 2**20


def _value(value: object) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def entry_flags(method: str, prefetch: bool | None, model: str, probe: dict | None) -> tuple[list[str], bool]:
    """``qaccel.train`` flags of ``method`` (a ``METHODS`` row) with ``prefetch``, and whether it runs under an FSDP launch."""
    m = METHODS[method]
    flags = ["--mixed_precision", "bf16" if m.compute == "bf16" else "no"]
    if m.optimizer != "adamw":
        flags += ["--method", _TRAIN_METHODS[m.optimizer]]
        flags += [arg for key, value in (probe or {}).items() for arg in (f"--zoadam_{key}", _value(value))]
        flags += [] if m.overlap_comm else ["--zoadam_overlap_comm", "false"]
    elif m.parallel == "fsdp" and m.qsdp is not None and m.reduce_scatter != "alltoall":
        flags += ["--method", "qsdp", "--qsdp_weight_bits", _value(m.qsdp[0]), "--qsdp_grad_bits", _value(m.qsdp[1])]
    else:  # stock FSDP2 or DDP: the entry's baseline
        flags += ["--method", "none"]
    if m.parallel == "fsdp":
        flags += ["--qsdp_prefetch", _value(bool(prefetch))]
        flags += [] if m.overlap_reduce_scatter else ["--qsdp_overlap_reduce_scatter", "false"]
        flags += ["--fsdp_reduce_scatter", "alltoall"] if m.reduce_scatter == "alltoall" else []
        if m.qsdp is not None and m.optimizer != "adamw":  # a 1-bit optimizer on HSDP shards: QSDP inside a node
            flags += ["--qsdp_weight_bits", _value(m.qsdp[0]), "--qsdp_grad_bits", _value(m.qsdp[1])]
        flags += ["--qsdp_replica_grad_bits", _value(m.replica_grad_bits)] if m.mesh == "hqsdp" and m.optimizer == "adamw" else []
        return flags, True
    if m.ddp in ("powersgd", "bf16"):
        flags += ["--ddp_comm_hook", m.ddp] + (["--powersgd_start_iter", "2"] if m.ddp == "powersgd" else [])
    if m.ddp_buckets == "one":  # a cap that holds the whole model: PowerSGD's one bucket on gloo (docs/powersgd_gloo.md)
        flags += ["--ddp_bucket_cap_mb", f"{2 * _model_mb(model) + 1:.0f}"]
    elif m.ddp_buckets == "small":
        flags += ["--ddp_bucket_cap_mb", str(SMALL_DDP_BUCKET_MB)]
    return flags, False


def train_argv(recipe: Path, flags: list[str], output_dir: Path, *, steps: int, timeout_s: float) -> list[str]:
    """The whole ``qaccel.train`` command line of one run."""
    return ["--recipe", str(recipe), *flags, "--max_steps", str(steps), "--collective_timeout_s", f"{timeout_s:.0f}",
            "--output_dir", str(output_dir)]  # fmt: skip


def compute_jobs(recipe: Path, compute: str, ranks: int, steps: int, folder: Path) -> list[tuple[list[str], Path, Path]]:
    """The compute-only runs of precision ``compute``: ``ranks`` one-process runs of the entry (module docstring),
    each as ``(argv, output_dir, log)``."""
    flags = ["--method", "none", "--mixed_precision", "bf16" if compute == "bf16" else "no"]
    jobs = []
    for rank in range(ranks):
        out = folder / f"compute-{compute}.rank{rank}"
        argv = [sys.executable, "-m", "qaccel.train", *train_argv(recipe, flags, out, steps=steps, timeout_s=600)]
        jobs.append((argv, out, folder / f"compute-{compute}.rank{rank}.log"))
    return jobs


def _metrics(output_dir: Path) -> list[dict]:
    from ..training import read_metrics

    rows = [row for row in read_metrics(output_dir / "metrics.jsonl") if row["step"] >= 1]
    if [row["step"] for row in rows] != list(range(1, len(rows) + 1)):
        raise E2EError(f"{output_dir / 'metrics.jsonl'}: expected one row per step from 1, got steps {[r['step'] for r in rows]}")
    return rows


def read_compute(jobs: list[tuple[list[str], Path, Path]], warmup: int) -> dict:
    """The compute-only figures of one precision: the model's parameters, rank 0's steps and every run's median steady step."""
    runs = [_metrics(out) for _, out, _ in jobs]
    steps = [{"step": r["step"] - 1, "seconds": r["step_seconds"], "steady": r["step"] > warmup} for r in runs[0]]
    medians = [statistics.median(r["step_seconds"] for r in rows if r["step"] > warmup) for rows in runs]
    return {"num_params": _num_params(jobs[0][2]), "compute_steps_rank0": steps, "compute_median_s_per_rank": medians}


def _num_params(log: Path) -> int:
    """The model's parameters from a one-process run's first line (``describe_run``: ``N parameters (local)``)."""
    for line in log.read_text(errors="replace").splitlines():
        if " parameters (local)" in line:
            return int(line.split(" parameters (local)")[0].rsplit(" ", 1)[1].replace(",", ""))
    raise E2EError(f"{log}: no 'parameters (local)' line from qaccel.train")


def _probe_rows(output_dir: Path, world_size: int) -> list[list[dict]]:
    per_rank = []
    for rank in range(world_size):
        path = output_dir / PROBE_FILE.format(rank=rank)
        per_rank.append([json.loads(line) for line in path.read_text().splitlines() if line.strip()])
    return per_rank


def read_run(output_dir: Path, method: str, world_size: int, warmup: int, probe: dict | None, nproc_per_node: int = 0) -> dict:
    """One configuration's raw result from its run's files: per step its kind, time, link and meter bytes.

    Several nodes (``world_size`` > ``nproc_per_node`` > 0): each step also has every node's counter deltas and
    the per-level figures (:func:`_level_figures`).

    Raises:
        E2EError: a file is missing or the steps disagree (the 1-bit kinds with the probe schedule's).
    """
    rows = _metrics(output_dir)
    per_rank = _probe_rows(output_dir, world_size)
    if any(len(ranks) != len(rows) for ranks in per_rank):
        raise E2EError(f"{output_dir}: the probe files do not have one row per step of metrics.jsonl ({len(rows)})")
    if probe is not None:  # the 1-bit rows: steady by the rule of onebit_probe, on a fresh schedule of the same settings
        kinds = steady_kinds(make_schedule(METHODS[method].optimizer, probe), len(rows))
        if [k for k, _ in kinds] != [r.get("step_kind") for r in rows]:
            raise E2EError(f"{output_dir}: the run's step kinds {[r.get('step_kind') for r in rows]} are not the probe schedule's")
    else:
        kinds = [("step", row["step"] > warmup) for row in rows]
    steps = []
    for i, (row, (kind, steady)) in enumerate(zip(rows, kinds, strict=True)):
        steps.append({
            "step": i, "kind": kind, "steady": steady, "seconds": row["step_seconds"], "loss": row["loss"],
            "link_bytes": per_rank[0][i]["counters"].get("lo", 0), "meter_sent_bytes": row["wire_bytes"],
            "meter_sent_bytes_per_rank": [ranks[i]["wire_bytes"] for ranks in per_rank],
            "meter_by_kind": per_rank[0][i]["wire_bytes_by_kind"],
        })  # fmt: skip
        if 0 < nproc_per_node < world_size:
            steps[-1].update(_level_figures([ranks[i] for ranks in per_rank], nproc_per_node, METHODS[method].mesh == "flat"))
    raw = {"world_size": world_size, "steps": steps, "info": _run_info(output_dir, len(rows))}
    if 0 < nproc_per_node < world_size:
        raw.update(nodes=world_size // nproc_per_node, nproc_per_node=nproc_per_node)
        raw["info"].update(nodes=raw["nodes"], nproc_per_node=nproc_per_node, mesh=METHODS[method].mesh)
    return raw


def _level_figures(ranks: list[dict], nproc_per_node: int, flat: bool) -> dict:
    """One step of a several-node job from every rank's probe row: each node's counter deltas (read by its first
    rank), their totals, and every rank's meter bytes by level.

    ``inter_node_bytes`` counts each inter-node byte once, where it leaves its node (every veth's ``tx``); the
    busiest shaped direction sets the link time. The entry's ``wire_bytes_inter_node`` is what crossed replicas
    (hierarchical QSDP's, a sharded 1-bit optimizer's ``hsdp.*`` kinds); a flat method's collectives run over
    all ranks, which span the nodes, so all its bytes count as inter-node.
    """
    per_node = [ranks[k]["counters"] for k in range(0, len(ranks), nproc_per_node)]
    intra, inter = sum(n["lo"] for n in per_node), sum(n["inter_tx"] for n in per_node)
    levels = [
        {"intra_node": 0, "inter_node": r["wire_bytes"]} if flat
        else {"intra_node": r["wire_bytes"] - r["wire_bytes_inter_node"], "inter_node": r["wire_bytes_inter_node"]}
        for r in ranks
    ]  # fmt: skip
    return {"node_bytes": per_node, "intra_node_bytes": intra, "inter_node_bytes": inter, "link_bytes": intra + inter,
            "inter_node_busiest_direction_bytes": max(max(n["inter_tx"], n["inter_rx"]) for n in per_node),
            "meter_by_level_per_rank": levels}  # fmt: skip


def _run_info(output_dir: Path, step: int) -> dict:
    """What the entry resolved: the method config and parallelism its final checkpoint records."""
    from ..checkpoint import checkpoint_path, read_run_state

    state = read_run_state(checkpoint_path(output_dir, step))
    return {"method_config": state["method_config"], "parallelism": state.get("extra", {}).get("parallelism")}


def child_env(env: dict, *, fsdp: bool) -> dict:
    """A run's environment: the harness's, with the FSDP launch variables for an FSDP2 row."""
    clean = {k: v for k, v in env.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    return {**clean, **(FSDP_LAUNCH_ENV if fsdp else {}), "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
