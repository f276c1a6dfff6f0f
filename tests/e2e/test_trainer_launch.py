"""End to end: ``qaccel.Trainer`` on 2 CPU processes through ``torchrun``, next to stock Trainer runs.

Each test starts ``torchrun --nproc_per_node 2`` once on this file (``main`` below), which trains
several Trainers one after the other in the same two processes (same model init, same data order)
and writes what each rank saw to JSON. Start-up (importing transformers twice on 2 cores) costs
more than the training, hence one launch per test.

References, never qaccel's own output:
- stock ``transformers.Trainer`` with AdamW on DDP (``use_cpu=True``, gloo): the loss curve both
  qaccel runs are compared with;
- stock FSDP2 (``qaccel.Trainer`` with ``fsdp=True`` and no ``qsdp``: Accelerate's FSDP2 path, no
  qaccel comms) must match it too (FSDP2 and DDP compute the same averaged gradient);
- stock FSDP2's reduce-scatter bytes from parameter shapes: per step each rank sends, for every
  parameter, its padded dim-0 shard in fp32 ((P - 1) = 1 chunk at P = 2);
- an uninterrupted run for the resumed one.

Tolerances: W8G8's mean loss over the last 4 of 16 steps within 1% of stock (the quantizers are
unbiased, so the runs differ by rounding noise only: at 8 bits below 1/255 of a 1024-element
bucket's range, far under AdamW's per-step change; a wrong divide or garbage decoding moves the
loss by far more; the same bound as ``tests/dist/test_qsdp_training.py``). 0/1 Adam and 1-bit Adam
(same lr, DeepSpeed's default betas): mean loss over the last 8 of 64 steps at most 1.25x AdamW's
(the bound of ``tests/dist/test_zoadam_convergence.py``) and 1.5 nats below a uniform guess. With
DeepSpeed's semantics they apply no bias correction, so at the same lr their early steps are larger
and they end lower than AdamW on a run this short (measured: 1.78 and 1.70 against 3.20); a broken
integration shows up in the replica and resume checks, which are exact.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from pathlib import Path

VOCAB, SEQ, NUM_SEQS = 128, 32, 1024
QSDP_STEPS, QSDP_SAVE = 16, 8
ZOADAM_STEPS, ZOADAM_SAVE = 64, 34
ZOADAM_SETTINGS = {"var_freeze_step": 16, "var_update_scaler": 4, "local_step_scaler": 8, "local_step_clipper": 4}
QSDP_LR, ZOADAM_LR = 3e-3, 1e-3


# ----------------------------------------------------------------------------------------------- worker
def _build_model():
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _dataset():
    from torch.utils.data import Dataset

    from qaccel.zoo import bigram_sequences

    class Bigrams(Dataset):
        def __init__(self) -> None:
            self.tokens = bigram_sequences(VOCAB, SEQ, NUM_SEQS, seed=1)

        def __len__(self) -> int:
            return len(self.tokens)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.tokens[i], "labels": self.tokens[i]}

    return Bigrams()


def _training_args(output_dir: Path, steps: int, lr: float, **overrides):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=str(output_dir), max_steps=steps, per_device_train_batch_size=8, learning_rate=lr,
        gradient_accumulation_steps=1,
        lr_scheduler_type="constant", weight_decay=0.0, logging_steps=1, save_strategy="no", report_to="none",
        seed=0, disable_tqdm=True,
    )  # fmt: skip
    settings.update(overrides)
    return TrainingArguments(**settings)


def _probe():
    """A callback recording, after every step, what the model is and whether the replicas agree."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.steps: list[dict] = []

        def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
            record = {"step": state.global_step, "fsdp_module": isinstance(model, FSDPModule)}
            inner = getattr(optimizer, "optimizer", optimizer)
            schedule = getattr(inner, "schedule", None)
            if schedule is not None and not record["fsdp_module"]:
                flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
                rows = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
                dist.all_gather(rows, flat)
                record["replica_max_diff"] = max(float((row - rows[0]).abs().max()) for row in rows)
                record["steps_since_sync"] = schedule.steps_since_sync
                record["phase"] = schedule.phase.value
            self.steps.append(record)

    return Probe()


def _run(name: str, trainer_cls, args, resume: str | None = None, model=None, **trainer_kwargs) -> dict:
    import torch.distributed as dist

    probe = _probe()
    model = _build_model() if model is None else model
    trainer = trainer_cls(model=model, args=args, train_dataset=_dataset(), callbacks=[probe], **trainer_kwargs)
    trainer.train(resume_from_checkpoint=resume)
    accelerator = trainer.accelerator
    result = {
        "name": name,
        "world_size": dist.get_world_size(),
        "trainer_world_size": args.world_size,
        "is_main_process": accelerator.is_main_process,
        "distributed_type": str(accelerator.distributed_type.value),
        "losses": {str(entry["step"]): entry["loss"] for entry in trainer.state.log_history if "loss" in entry},
        "log_history": trainer.state.log_history,
        "probe": probe.steps,
        "comm_stats": accelerator.comm_stats() if hasattr(accelerator, "comm_stats") else None,
        "qsdp_units": accelerator.qsdp.describe() if getattr(accelerator, "qsdp", None) is not None else None,
    }
    del trainer, accelerator
    gc.collect()  # free FSDP state and comm buffers while gloo is up (see qaccel.Accelerator.end_training)
    return result


def _qsdp_suite(out: Path) -> list[dict]:
    import transformers

    import qaccel
    from qaccel import QSDPConfig

    def args(folder: Path, **overrides):
        # 2 micro-batches of 4 per step: the reduce-scatter must run on the last one only.
        return _training_args(
            folder, QSDP_STEPS, QSDP_LR, per_device_train_batch_size=4, gradient_accumulation_steps=2, **overrides
        )

    w8g8 = QSDPConfig(weight_bits=8, grad_bits=8)
    ckpt_dir = out / "w8g8"
    return [
        _run("ddp_stock", transformers.Trainer, args(out / "ddp", use_cpu=True)),
        _run("fsdp_stock", qaccel.Trainer, args(out / "fsdp", fsdp=True)),
        # No fsdp args: the default wrapping (the model's _no_split_modules); bits off = stock collectives, counted.
        _run(
            "qsdp_off",
            qaccel.Trainer,
            args(out / "off"),
            qsdp=QSDPConfig(weight_bits=None, grad_bits=None),
        ),
        _run(
            "qsdp_w8g8",
            qaccel.Trainer,
            args(ckpt_dir, save_strategy="steps", save_steps=QSDP_SAVE),
            qsdp=w8g8,
        ),
        _run(
            "qsdp_w8g8_resumed",
            qaccel.Trainer,
            args(ckpt_dir),
            qsdp=w8g8,
            resume=str(ckpt_dir / f"checkpoint-{QSDP_SAVE}"),
        ),
    ]


def _zoadam_suite(out: Path) -> list[dict]:
    import transformers

    import qaccel
    from qaccel.optim import OneBitAdam, ZeroOneAdam

    def args(folder: Path, **overrides):
        return _training_args(folder, ZOADAM_STEPS, ZOADAM_LR, **overrides)

    def zoadam_run(name: str, **run_kwargs) -> dict:
        model = _build_model()
        optimizer = ZeroOneAdam(model.parameters(), lr=ZOADAM_LR, **ZOADAM_SETTINGS)
        return _run(name, qaccel.Trainer, model=model, optimizers=(optimizer, None), **run_kwargs)

    ckpt_dir = out / "zoadam"
    runs = [
        _run("adamw_stock", transformers.Trainer, args(out / "adamw", use_cpu=True)),
        zoadam_run("zoadam", args=args(ckpt_dir, save_strategy="steps", save_steps=ZOADAM_SAVE)),
        zoadam_run("zoadam_resumed", args=args(ckpt_dir), resume=str(ckpt_dir / f"checkpoint-{ZOADAM_SAVE}")),
        # Same samples per step in 2 micro-batches: the hook must still fire once per optimizer step.
        zoadam_run(
            "zoadam_accumulated", args=args(out / "ga", per_device_train_batch_size=4, gradient_accumulation_steps=2)
        ),
    ]
    model = _build_model()
    onebit = OneBitAdam(model.parameters(), lr=ZOADAM_LR, freeze_step=ZOADAM_SETTINGS["var_freeze_step"])
    runs.append(_run("onebit", qaccel.Trainer, args(out / "onebit"), model=model, optimizers=(onebit, None)))
    return runs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="qaccel.Trainer e2e worker (run under torchrun)")
    parser.add_argument("suite", choices=("qsdp", "zoadam"))
    parser.add_argument("--out", type=Path, required=True)
    options = parser.parse_args(argv)
    import torch.distributed as dist

    results = _qsdp_suite(options.out) if options.suite == "qsdp" else _zoadam_suite(options.out)
    rank = dist.get_rank()
    (options.out / f"rank{rank}.json").write_text(json.dumps(results))
    gc.collect()
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ tests
def _launch(suite: str, out: Path) -> list[dict[str, dict]]:
    """Run the suite on 2 processes; per rank, the runs by name."""
    from tests._launch import run_job, torchrun_cmd  # here: this module is also the ranks' entry point

    run_job(torchrun_cmd(__file__, suite, "--out", str(out)), timeout=420, TRANSFORMERS_OFFLINE="1")
    return [{run["name"]: run for run in json.loads((out / f"rank{r}.json").read_text())} for r in range(2)]


def _losses(run: dict) -> list[float]:
    return [run["losses"][str(step)] for step in sorted(map(int, run["losses"]))]


def _tail_mean(losses: list[float], n: int) -> float:
    return sum(losses[-n:]) / n


def _check_two_processes(ranks: list[dict[str, dict]], name: str, distributed_type: str) -> None:
    for rank, runs in enumerate(ranks):
        run = runs[name]
        assert run["world_size"] == 2 and run["trainer_world_size"] == 2, run["name"]
        assert run["is_main_process"] == (rank == 0), (name, rank)
        assert run["distributed_type"] == distributed_type, (name, run["distributed_type"])


def _wire_total(run: dict, kind: str) -> int:
    return run["comm_stats"]["total"].get(kind, {}).get("sent_bytes", 0)


def _param_shapes() -> list[tuple[int, ...]]:
    model = _build_model()
    return [tuple(p.shape) for p in model.parameters()]  # tied lm_head/wte listed once


def test_qsdp_trainer_matches_stock_fsdp2_with_a_quarter_of_the_bytes(tmp_path):
    ranks = _launch("qsdp", tmp_path)
    rank0 = ranks[0]
    for name in ("fsdp_stock", "qsdp_off", "qsdp_w8g8", "qsdp_w8g8_resumed"):
        _check_two_processes(ranks, name, "FSDP")
        assert all(step["fsdp_module"] for step in rank0[name]["probe"]), f"{name}: model is not an FSDP2 module"
    _check_two_processes(ranks, "ddp_stock", "MULTI_CPU")

    stock_ddp, stock_fsdp = _losses(rank0["ddp_stock"]), _losses(rank0["fsdp_stock"])
    assert len(stock_fsdp) == QSDP_STEPS
    # FSDP2 and DDP average the same gradients; only the order of float additions differs.
    close = [math.isclose(a, b, rel_tol=1e-4) for a, b in zip(stock_fsdp, stock_ddp, strict=True)]
    assert all(close), (stock_fsdp, stock_ddp)
    # Bits off: every unit keeps FSDP2's own collective, only counted: the run is the stock run.
    assert _losses(rank0["qsdp_off"]) == stock_fsdp

    w8g8 = _losses(rank0["qsdp_w8g8"])
    assert all(math.isfinite(x) for x in w8g8)
    assert _tail_mean(w8g8, 4) < w8g8[0] - 0.5, f"W8G8 did not learn: {w8g8}"
    stock_tail = _tail_mean(stock_fsdp, 4)
    assert abs(_tail_mean(w8g8, 4) - stock_tail) <= 0.01 * stock_tail, (w8g8, stock_fsdp)
    assert w8g8 != stock_fsdp  # the quantized path really ran

    # Wire bytes in the Trainer's log history, per logging interval (= one step) and in total.
    for rank, runs in enumerate(ranks):
        history = [entry for entry in runs["qsdp_w8g8"]["log_history"] if "loss" in entry]
        assert len(history) == QSDP_STEPS
        for entry in history:
            assert entry["wire_bytes/qsdp.all_gather"] > 0, (rank, entry)
            assert entry["wire_bytes/qsdp.reduce_scatter"] > 0, (rank, entry)
            assert entry["wire_bytes"] == sum(v for k, v in entry.items() if k.startswith("wire_bytes/"))
        assert history[-1]["wire_bytes_total"] == sum(entry["wire_bytes"] for entry in history)
        assert history[-1]["wire_bytes_total"] == runs["qsdp_w8g8"]["comm_stats"]["total_sent_bytes"]

    # Stock reduce-scatter bytes from the parameter shapes alone (P = 2: one fp32 shard sent per parameter).
    stock_rs_per_step = sum(4 * math.ceil(s[0] / 2) * math.prod(s[1:]) for s in _param_shapes())
    off, q = rank0["qsdp_off"], rank0["qsdp_w8g8"]
    assert _wire_total(off, "fsdp.reduce_scatter") == QSDP_STEPS * stock_rs_per_step
    # Big units (quantized in the W8G8 run): their stock bytes are the bits-off run's minus what the
    # small units still send stock in the W8G8 run. At 8 bits a value costs 1 byte instead of 4, plus
    # 8 bytes of metadata per 1024 values and the 1-D parameters (biases, norms: 1.5% of these
    # units here) sent raw: 0.25 <= ratio <= 0.27.
    for direction in ("all_gather", "reduce_scatter"):
        stock_big = _wire_total(off, f"fsdp.{direction}") - _wire_total(q, f"fsdp.{direction}")
        ratio = _wire_total(q, f"qsdp.{direction}") / stock_big
        assert 0.25 <= ratio <= 0.27, (direction, ratio)
    # One reduce-scatter per unit and optimizer step, none on the first of the 2 micro-batches.
    quantized_units = sum(unit["grads_quantized"] for unit in q["qsdp_units"])
    assert quantized_units >= 3  # both blocks and the embedding unit
    assert q["comm_stats"]["total"]["qsdp.reduce_scatter"]["calls"] == QSDP_STEPS * quantized_units

    # Resume from checkpoint-8: the seed schedule comes back from qaccel_qsdp.json, so steps 9..16
    # draw the same rounding noise and repeat the uninterrupted run exactly.
    saved = json.loads((tmp_path / "w8g8" / f"checkpoint-{QSDP_SAVE}" / "qaccel_qsdp.json").read_text())
    assert saved["seeds"]["step"] == QSDP_SAVE and saved["world_size"] == 2
    resumed = rank0["qsdp_w8g8_resumed"]
    assert [p["step"] for p in resumed["probe"]] == list(range(QSDP_SAVE + 1, QSDP_STEPS + 1))
    assert [resumed["losses"][str(s)] for s in range(QSDP_SAVE + 1, QSDP_STEPS + 1)] == w8g8[QSDP_SAVE:]


def test_zero_one_adam_trainer_tracks_adamw_with_synced_replicas(tmp_path):
    ranks = _launch("zoadam", tmp_path)
    rank0 = ranks[0]
    for name in ("adamw_stock", "zoadam", "zoadam_resumed", "zoadam_accumulated", "onebit"):
        _check_two_processes(ranks, name, "MULTI_CPU")

    adamw = _losses(rank0["adamw_stock"])
    for name in ("zoadam", "onebit"):
        losses = _losses(rank0[name])
        assert len(losses) == ZOADAM_STEPS and all(math.isfinite(x) for x in losses)
        assert _tail_mean(losses, 8) < math.log(VOCAB) - 1.5, f"{name} did not learn: {losses}"
        assert _tail_mean(losses, 8) <= 1.25 * _tail_mean(adamw, 8), (name, losses, adamw)

    # The hook ran: full-precision all-reduces on variance steps, 1-bit collectives afterwards.
    hook_kinds = ("ddp.all_reduce", "onebit.all_to_all", "onebit.all_gather")
    for name in ("zoadam", "onebit"):
        for kind in hook_kinds:
            assert _wire_total(rank0[name], kind) > 0, (name, kind)
        history = [entry for entry in rank0[name]["log_history"] if "loss" in entry]
        assert any(entry.get("wire_bytes/onebit.all_to_all", 0) > 0 for entry in history)
        assert history[-1]["wire_bytes_total"] == rank0[name]["comm_stats"]["total_sent_bytes"]

    # Gradient accumulation: per kind, as many collectives as without it (the hook fires on the last
    # micro-batch only; the schedule counts optimizer steps), and it learns as well.
    accumulated, plain = rank0["zoadam_accumulated"]["comm_stats"], rank0["zoadam"]["comm_stats"]
    for kind in hook_kinds:
        assert accumulated["total"][kind]["calls"] == plain["total"][kind]["calls"], kind
    accumulated = rank0["zoadam_accumulated"]
    assert _tail_mean(_losses(accumulated), 8) <= 1.25 * _tail_mean(adamw, 8)
    assert all(p["replica_max_diff"] == 0.0 for p in accumulated["probe"] if p["steps_since_sync"] == 0)

    # Replicas: identical after every phase-1 step and at every sync; apart between syncs (local steps).
    probe = rank0["zoadam"]["probe"]
    synced = [p for p in probe if p["phase"] == "variance" or p["steps_since_sync"] == 0]
    local = [p for p in probe if p["phase"] == "local_steps" and p["steps_since_sync"] > 0]
    assert synced and local
    assert any(p["phase"] == "local_steps" and p["steps_since_sync"] == 0 for p in probe)
    assert all(p["replica_max_diff"] == 0.0 for p in synced), synced
    assert any(p["replica_max_diff"] > 0.0 for p in local)

    # Checkpoint: every rank's file is in the Trainer's checkpoint folder; the save point lies between
    # syncs, so the rank files carry local weights, and the resumed run repeats the uninterrupted one.
    ckpt = tmp_path / "zoadam" / f"checkpoint-{ZOADAM_SAVE}"
    assert (ckpt / "qaccel_zoadam_rank0.pt").is_file() and (ckpt / "qaccel_zoadam_rank1.pt").is_file()
    assert next(p for p in probe if p["step"] == ZOADAM_SAVE)["steps_since_sync"] > 0
    for runs in ranks:
        resumed, uninterrupted = runs["zoadam_resumed"], runs["zoadam"]
        assert [p["step"] for p in resumed["probe"]] == list(range(ZOADAM_SAVE + 1, ZOADAM_STEPS + 1))
        after_save = [resumed["losses"][str(s)] for s in range(ZOADAM_SAVE + 1, ZOADAM_STEPS + 1)]
        assert after_save == _losses(uninterrupted)[ZOADAM_SAVE:]
        assert resumed["probe"] == uninterrupted["probe"][ZOADAM_SAVE:]  # same replica gaps and schedule


if __name__ == "__main__":
    main()
