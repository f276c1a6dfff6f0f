"""``qaccel.Trainer`` on 2 gloo ranks: the clipping choice is logged once, and ``max_grad_norm=0`` overlaps.

Each rank builds a ``qaccel.Trainer`` around a tiny GPT-2 and a :class:`~qaccel.optim.OneBitAdam`
with ``freeze_step=2``, trains 6 steps and reports the records of the Trainer's logger and, from a
callback that runs between backward and ``optimizer.step()``, whether a 1-bit all-reduce started in
backward was then in flight (``comm_overlap.in_flight``). The reference for which steps are
compressed is 1-bit Adam's schedule as ``docs/zero_one_adam.md`` states it: step 1 ``init``, steps
2 .. max(freeze_step, 2) ``full``, then ``onebit_momentum``; with the default ``max_grad_norm=1.0``
none of them may overlap, with ``max_grad_norm=0`` every compressed one must.
"""

from __future__ import annotations

import logging
import os

import pytest

from tests._dist import run_ranks

STEPS, FREEZE_STEP = 6, 2
COMPRESSED_STEPS = list(range(max(FREEZE_STEP, 2) + 1, STEPS + 1))  # 1-based optimizer steps


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.levelname, record.getMessage()))


def _train(rank, world_size, out_dir, max_grad_norm):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments

    import qaccel
    from qaccel.optim import OneBitAdam
    from qaccel.zoo import bigram_sequences

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    tokens = bigram_sequences(64, 16, 4 * STEPS * world_size, seed=1)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    optimizer = OneBitAdam(model.parameters(), lr=1e-3, freeze_step=FREEZE_STEP)
    in_flight: list[bool] = []

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            in_flight.append(optimizer.comm_overlap is not None and optimizer.comm_overlap.in_flight)

    overrides = {} if max_grad_norm is None else {"max_grad_norm": max_grad_norm}
    args = TrainingArguments(
        output_dir=str(out_dir), use_cpu=True, max_steps=STEPS, per_device_train_batch_size=4, report_to="none",
        save_strategy="no", logging_steps=1, lr_scheduler_type="constant", disable_tqdm=True, **overrides,
    )  # fmt: skip
    logger = logging.getLogger("qaccel.integration.trainer")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trainer = qaccel.Trainer(model=model, args=args, train_dataset=data, optimizers=(optimizer, None), callbacks=[Probe()])
        trainer.train()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return {
        "records": handler.records,
        "in_flight": in_flight,
        "gradient_clipping": optimizer.config.gradient_clipping,
        "clipped_with_norm": optimizer.last_grad_norm is not None,
    }


@pytest.mark.parametrize("max_grad_norm", [None, 0.0], ids=["default_args", "max_grad_norm_0"])
def test_trainer_logs_its_clipping_choice_once_and_overlaps_without_clipping(tmp_path, max_grad_norm):
    results = run_ranks(_train, 2, tmp_path, tmp_path / "out", max_grad_norm, timeout_s=300)
    clipping = max_grad_norm is None  # TrainingArguments' default max_grad_norm is 1.0
    rank0, rank1 = results
    assert rank1["records"] == []  # rank 0 only
    assert len(rank0["records"]) == 1, rank0["records"]
    level, message = rank0["records"][0]
    assert message.startswith("qaccel.Trainer: OneBitAdam")
    if clipping:
        assert level == "WARNING"
        assert "clips at max_grad_norm=1.0" in message and "no overlap" in message and "set max_grad_norm=0" in message
    else:
        assert level == "INFO"
        assert "does not clip" in message and "overlaps backward" in message
    for rank, out in enumerate(results):
        assert out["gradient_clipping"] == (1.0 if clipping else 0.0)
        assert out["clipped_with_norm"] is clipping
        expected = [clipping is False and step in COMPRESSED_STEPS for step in range(1, STEPS + 1)]
        assert out["in_flight"] == expected, f"rank {rank}"
