"""``qaccel.Trainer`` refuses set-ups it cannot run, with errors naming the setting, and hands
``max_grad_norm`` to 1-bit optimizers.

The cases run in one separate Python process (``main`` below): building ``TrainingArguments`` sets
up Accelerate's process-wide state, which must not leak into other tests of this pytest process.
Every case is checked before any model is wrapped or trained.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _cases(out_dir: str) -> dict[str, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    import qaccel
    from qaccel import QSDPConfig
    from qaccel.optim import OneBitAdam, ZeroOneAdam

    def model():
        return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))

    def args(**overrides):
        return TrainingArguments(output_dir=out_dir, report_to="none", max_steps=1, **overrides)

    def outcome(build) -> dict:
        try:
            value = build()
        except Exception as exc:  # noqa: BLE001 - the type and message are what the test checks
            return {"error": type(exc).__name__, "message": str(exc)}
        return {"error": None, "value": value}

    w8g8 = QSDPConfig(weight_bits=8, grad_bits=8)

    def with_optimizer(optimizer_cls, trainer_args, **trainer_kwargs):
        m = model()
        optimizer = optimizer_cls(m.parameters(), **trainer_kwargs.pop("optimizer_kwargs", {}))
        trainer = qaccel.Trainer(model=m, args=trainer_args, optimizers=(optimizer, None), **trainer_kwargs)
        return trainer.optimizer.config.gradient_clipping

    def onebit_from_cls():
        return qaccel.Trainer(
            model=model(), args=args(), qsdp=w8g8, optimizer_cls_and_kwargs=(OneBitAdam, {"lr": 1e-3})
        )

    return {
        "qsdp_with_fsdp1": outcome(
            lambda: qaccel.Trainer(model=model(), args=args(fsdp=True, fsdp_config={"version": 1}), qsdp=w8g8)
        ),
        "qsdp_with_zero_one_adam": outcome(lambda: with_optimizer(ZeroOneAdam, args(), qsdp=w8g8)),
        "qsdp_not_a_config": outcome(lambda: qaccel.Trainer(model=model(), args=args(), qsdp={"weight_bits": 8})),
        "onebit_adam_with_fsdp": outcome(lambda: with_optimizer(OneBitAdam, args(fsdp=True))),
        "clipping_conflict": outcome(
            lambda: with_optimizer(ZeroOneAdam, args(max_grad_norm=1.0), optimizer_kwargs={"gradient_clipping": 0.5})
        ),
        "clipping_adopted": outcome(lambda: with_optimizer(ZeroOneAdam, args(max_grad_norm=0.7))),
        "clipping_off": outcome(lambda: with_optimizer(ZeroOneAdam, args(max_grad_norm=0.0))),
        "clipping_own": outcome(
            lambda: with_optimizer(ZeroOneAdam, args(max_grad_norm=0.0), optimizer_kwargs={"gradient_clipping": 0.5})
        ),
        # A 1-bit optimizer built by the Trainer itself (optimizer_cls_and_kwargs) is checked when it is created.
        "qsdp_with_onebit_from_cls": outcome(lambda: type(onebit_from_cls().create_optimizer()).__name__),
        "default_accelerator": outcome(lambda: type(qaccel.Trainer(model=model(), args=args()).accelerator).__module__),
    }


def main() -> None:
    print(json.dumps(_cases(sys.argv[1])))


def test_bad_combinations_raise_clear_errors_and_max_grad_norm_moves_to_the_optimizer(tmp_path):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("QACCEL_", "FSDP_", "ACCELERATE_", "WORLD_SIZE", "RANK"))
    }
    env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, __file__, str(tmp_path)], env=env, cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    cases = json.loads(proc.stdout.strip().splitlines()[-1])

    def error(name: str, kind: str, *words: str) -> None:
        case = cases[name]
        assert case["error"] == kind, (name, case)
        for word in words:
            assert word in case["message"], (name, word, case["message"])

    error("qsdp_with_fsdp1", "ValueError", "version=1", "FSDP2")
    error("qsdp_with_zero_one_adam", "ValueError", "qsdp=", "ZeroOneAdam")
    error("qsdp_not_a_config", "TypeError", "QSDPConfig", "dict")
    error("onebit_adam_with_fsdp", "ValueError", "OneBitAdam", "FSDP")
    error("clipping_conflict", "ValueError", "max_grad_norm=1.0", "gradient_clipping=0.5")
    error("qsdp_with_onebit_from_cls", "ValueError", "qsdp=", "OneBitAdam")
    assert cases["clipping_adopted"] == {"error": None, "value": 0.7}
    assert cases["clipping_off"] == {"error": None, "value": 0.0}
    assert cases["clipping_own"] == {"error": None, "value": 0.5}
    assert cases["default_accelerator"] == {"error": None, "value": "qaccel.integration.accelerator"}


if __name__ == "__main__":
    main()
