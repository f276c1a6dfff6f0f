"""Single figures out of the benchmark JSON, the presets' recorded results, and the checkpoint's file table.

:func:`loss_pct` and :func:`bytes_ratio` are the two lookups every quoted figure goes through: a final
eval loss against the study's own baseline (``qaccel bench convergence``), and bytes per step against
FSDP2 fp32 (``qaccel bench comm --only qsdp``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._docs_blocks import Sources

__all__ = ["PRESET_FIGURES", "loss_pct", "bytes_ratio", "pct", "presets_table", "checkpoint_table"]

#: Which measurement stands for each preset of :data:`qaccel.fsdp.config.PRESETS`, per column: the bytes
#: row of ``qaccel bench comm`` (file, method label) and the convergence runs (file, task or "long", method).
#: A preset without a run in a column shows "—" there.
PRESET_FIGURES: dict[str, dict[str, tuple[str, ...]]] = {
    "w8g8": {
        "bytes": ("comm", "QSDP W8G8"),
        "tiny": ("convergence", "gpt2-tiny", "w8g8"),
        "long": ("convergence", "long", "w8g8"),
        "minilm": ("convergence_lowbit_minilm", "minilm-qsdp", "w8g8"),
    },
    "w4g4": {
        "bytes": ("comm", "QSDP W4G4"),
        "tiny": ("convergence", "gpt2-tiny", "w4g4"),
        "long": ("convergence", "long", "w4g4"),
        "minilm": ("convergence_lowbit_minilm", "minilm-qsdp", "w4g4"),
    },
    "w4g4-nearest-grad-hadamard": {
        "bytes": ("comm", "QSDP W4G4"),  # rounding and rotation change no byte
        "tiny": ("convergence_lowbit_grot", "gpt2-tiny", "w4g4-grot-nr"),
        "minilm": ("convergence_lowbit_minilm", "minilm-qsdp", "w4g4-grot-nr"),
    },
    "w3g3-nearest": {
        "bytes": ("comm_qsdp_lowbit", "QSDP W3G3"),
        "long": ("convergence_lowbit_long5", "gpt2-tiny", "w3g3-nr"),
    },
    "w3g2-nearest": {
        "bytes": ("comm_qsdp_lowbit", "QSDP W3G2"),
        "tiny": ("convergence_lowbit_nearest", "gpt2-tiny", "w3g2-nr"),
        "long": ("convergence_lowbit_long", "long", "w3g2-nr"),
        "minilm": ("convergence_lowbit_minilm", "minilm-qsdp", "w3g2-nr"),
    },
    "w2g2-nearest": {
        "bytes": ("comm_qsdp_lowbit", "QSDP W2G2"),
        "tiny": ("convergence_lowbit_nearest", "gpt2-tiny", "w2g2-nr"),
        "long": ("convergence_lowbit_long", "long", "w2g2-nr"),
    },
}


def loss_pct(src: Sources, name: str, task: str, method: str) -> tuple[float, int]:
    """``(final eval loss vs the study's baseline in %, seeds)`` of ``method`` in ``docs/bench/{name}.json``.

    ``task`` is a task of the study, or ``"long"`` for its long run.

    Raises:
        ValueError: the file has no such task or method.
    """
    report = src.json(name)
    study = report.get("long_run") if task == "long" else report["tasks"].get(task)
    if not study or method not in study["methods"]:
        raise ValueError(f"docs/bench/{name}.json: no method {method!r} in task {task!r}")
    return study["methods"][method]["summary"]["diff_vs_baseline_pct"], study["seeds"]


def bytes_ratio(src: Sources, name: str, method: str) -> float:
    """Bytes per step and rank of ``method`` over FSDP2 fp32's, from ``docs/bench/{name}.json`` (``bench comm``).

    Raises:
        ValueError: the file has no such method.
    """
    rows = {r["method"]: r for r in src.json(name)["qsdp"]["rows"]}
    if method not in rows:
        raise ValueError(f"docs/bench/{name}.json: no qsdp row {method!r}; rows: {', '.join(rows)}")
    return rows[method]["ratio_vs_baseline"]


def pct(value: float) -> str:
    """A loss difference as the documents quote it: ``+0.11%``."""
    return f"{value:+.2f}%"


def _seeds(seeds: int) -> str:
    return f"{seeds} seed{'s' if seeds != 1 else ''}" if seeds != 1 else "seed 0"


def _settings(name: str) -> str:
    from qaccel.fsdp.config import PRESETS

    return ", ".join(f"`{k}={v}`" for k, v in PRESETS[name]["settings"].items())


def presets_table(src: Sources, names: tuple[str, ...] = ()) -> str:
    """The presets' recorded results, one row per preset (``names``, or every one of ``PRESET_FIGURES``).

    Raises:
        ValueError: a name that is not a preset.
    """
    for name in names:
        if name not in PRESET_FIGURES:
            raise ValueError(f"presets({name}): unknown preset; choose from {', '.join(PRESET_FIGURES)}")
    lines = [
        "| preset | settings | bytes vs FSDP2 fp32 (GPT-2 124M) | gpt2-tiny, 50 steps | gpt2-tiny, 1000 steps | MiniLM fine-tune, 45 steps |",
        "|---|---|---|---|---|---|",
    ]
    for name in names or tuple(PRESET_FIGURES):
        figures = PRESET_FIGURES[name]
        cells = [f"`{name}`", _settings(name), f"{bytes_ratio(src, *figures['bytes']):.4g}x"]
        for column in ("tiny", "long", "minilm"):
            if column not in figures:
                cells.append("—")
                continue
            value, seeds = loss_pct(src, *figures[column])
            cells.append(f"{pct(value)} ({_seeds(seeds)})")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Loss columns: final eval loss against stock FSDP2 fp32 in the same study, mean over the seeds "
        "(`qaccel bench convergence`); bytes: `qaccel bench comm --only qsdp`.",
    ]
    return "\n".join(lines)


def checkpoint_table() -> str:
    """The files of ``checkpoint-STEP/``: qaccel's names from ``qaccel.checkpoint``, Accelerate's from its constants."""
    from accelerate.utils.constants import (
        FSDP_MODEL_NAME,
        OPTIMIZER_NAME,
        RNG_STATE_NAME,
        SAFE_WEIGHTS_NAME,
        SCHEDULER_NAME,
    )

    import qaccel.checkpoint as ckpt

    rows = [
        (f"`{FSDP_MODEL_NAME}_0/` (`.metadata`, `__RANK_0.distcp`)", "Accelerate, FSDP2 with `SHARDED_STATE_DICT` (QSDP or stock FSDP2)",
         "the model as a torch distributed checkpoint (DCP): every rank wrote its shards, rank 0 the index of offsets and lengths; "
         "keys are the model's `state_dict()` keys under a `model.` prefix"),
        (f"`{FSDP_MODEL_NAME}.bin`", "Accelerate, FSDP2 with `FULL_STATE_DICT`", "the full state dict (`torch.save`, rank 0)"),
        (f"`{SAFE_WEIGHTS_NAME}`", "Accelerate, DDP or one process (0/1 Adam, 1-bit Adam, plain DDP)",
         "the main process's weights; tied weights (GPT-2's `lm_head.weight`) are left out"),
        (f"`{OPTIMIZER_NAME}_0/`, `{OPTIMIZER_NAME}.bin`, `{SCHEDULER_NAME}.bin`, `{RNG_STATE_NAME}_{{r}}.pkl`, `custom_checkpoint_{{i}}.pkl`",
         "Accelerate", "optimizer, scheduler, RNG, registered objects (QSDP's seed step)"),
        (f"`{ckpt.ONEBIT_RANK_FILE}`", "qaccel, every rank", "a 1-bit optimizer's private per-rank state (`docs/zero_one_adam.md`, \"Checkpoints\")"),
        (f"`{ckpt.DILOCO_RANK_FILE}`", "qaccel, every rank (`--method diloco`)",
         "that rank's DiLoCo state (global weights, outer momentum, rounding seeds, error feedback) and its island's inner "
         "optimizer state (`docs/diloco.md`, \"Checkpoints\")"),
        (f"`{ckpt.QSDP_STATE_FILE}`", "qaccel, main process (QSDP)", "the seed schedule's step, seed, world size and config"),
        (f"`{ckpt.QSDP_ERROR_RANK_FILE}`", "qaccel, every rank (QSDP with `grad_error_feedback`)",
         "that rank's gradient error-feedback buffers (safetensors; `docs/qsdp.md`)"),
        (f"`{ckpt.STREAM_STATE_FILE}`", "qaccel, main process (`--streaming`)", "every rank's position in its data stream"),
        (f"`{ckpt.RUN_STATE_FILE}`", "`save_checkpoint_metadata`", "how the run was trained (below)"),
        (f"`{ckpt.MODEL_FILES_DIR}/`", "`save_checkpoint_metadata`", "`config.json`, `generation_config.json`, tokenizer files"),
        (f"`{ckpt.MANIFEST_FILE}`", "`save_checkpoint`, last", "every other file's size and SHA-256; its presence marks the checkpoint complete"),
    ]  # fmt: skip
    return "\n".join(["| entry | written by | content |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def _baseline(src: Sources, name: str, task: str) -> str:
    study = src.json(name)["tasks"][task]
    s = study["methods"][study["baseline"]]["summary"]
    return f"{s['final_eval_loss_mean']:.4f} ± {s['final_eval_loss_std']:.4f}"


#: the low-bit study's columns on gpt2-tiny: (heading, JSON, method-key suffix)
_LOWBIT_COLUMNS = (
    ("stochastic (default)", "convergence_lowbit", ""),
    ("+ rotation", "convergence_lowbit", "-rot"),
    ("+ error feedback", "convergence_lowbit", "-ef"),
    ("+ both", "convergence_lowbit", "-rot-ef"),
    ("nearest", "convergence_lowbit_nearest", "-nr"),
    ("nearest + error feedback", "convergence_lowbit_nearest", "-nr-ef"),
    ("nearest, gradients rotated", "convergence_lowbit_grot", "-grot-nr"),
)
LOWBIT_SOURCES = tuple(dict.fromkeys(c[1] for c in _LOWBIT_COLUMNS))


def lowbit_loss_table(src: Sources) -> str:
    """gpt2-tiny's final eval loss for every low-bit setting and variant (empty where a variant was not run)."""
    steps, seeds = (src.json("convergence_lowbit")["tasks"]["gpt2-tiny"][k] for k in ("steps", "seeds"))
    lines = [
        f"**Loss** (gpt2-tiny, {steps} steps, {seeds} seeds, final eval loss against FSDP2 fp32's "
        f"{_baseline(src, 'convergence_lowbit', 'gpt2-tiny')}):",
        "",
        "| setting | " + " | ".join(c[0] for c in _LOWBIT_COLUMNS) + " |",
        "|---" * (len(_LOWBIT_COLUMNS) + 1) + "|",
    ]
    for setting in ("w4g4", "w4g2", "w3g3", "w3g2", "w2g2"):
        cells = []
        for _, name, suffix in _LOWBIT_COLUMNS:
            methods = src.json(name)["tasks"]["gpt2-tiny"]["methods"]
            cells.append(pct(loss_pct(src, name, "gpt2-tiny", setting + suffix)[0]) if setting + suffix in methods else "")
        lines.append(f"| {setting.upper()} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


#: the MiniLM fine-tune's columns: (heading, method key)
_MINILM_COLUMNS = (
    ("W8G8", "w8g8"), ("W4G4", "w4g4"), ("W4G4 nearest", "w4g4-nr"), ("W4G4 nearest, gradients rotated", "w4g4-grot-nr"),
    ("W3G2", "w3g2"), ("W3G2 nearest", "w3g2-nr"), ("W3G2 nearest, gradients rotated", "w3g2-grot-nr"),
    ("W2G2 nearest, gradients rotated", "w2g2-grot-nr"),
)  # fmt: skip


def minilm_lowbit_table(src: Sources) -> str:
    """The MiniLM fine-tune's final eval loss for each low-bit setting, against stock FSDP2 fp32."""
    name, task = "convergence_lowbit_minilm", "minilm-qsdp"
    study = src.json(name)["tasks"][task]
    cells = [pct(loss_pct(src, name, task, key)[0]) for _, key in _MINILM_COLUMNS]
    return "\n".join([
        f"**MiniLM fine-tune** (pretrained MiniLM-L6, {study['steps']} steps, {study['seeds']} seeds, final eval loss against "
        f"stock FSDP2 fp32's {_baseline(src, name, task)} on the same job; `qaccel bench convergence --tasks {task}`):",
        "",
        "| QSDP | " + " | ".join(c[0] for c in _MINILM_COLUMNS) + " |",
        "|---" * (len(_MINILM_COLUMNS) + 1) + "|",
        "| vs FSDP2 fp32 | " + " | ".join(cells) + " |",
    ])  # fmt: skip


def phases_table(src: Sources) -> str:
    """Where a QSDP collective's time goes (``qaccel bench comm --only phases``), one row per collective and width."""
    lines = [
        "| collective | bits | P | payload B/rank | encode ms | transport ms | decode ms | kernels ms | overhead | per segment ms | "
        "stock fp32 ms | same bytes ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in src.json("phases")["phases"]["rows"]:
        lines.append(
            f"| {r['direction'].replace('_', '-')} | {r['bits']} | {r['world_size']} | {r['payload_bytes']:,} | {r['encode_ms']:.1f} | "
            f"{r['transport_ms']:.1f} | {r['decode_ms']:.1f} | {r['kernel_ms']:.1f} | {r['overhead']:.2f} | {r['per_segment_ms']:.1f} | "
            f"{r['stock_ms']:.1f} | {r['same_bytes_ms']:.1f} |"
        )
    return "\n".join(lines)
