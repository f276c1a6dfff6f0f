"""Worker for ``tests/e2e/test_cpu_autodetect.py``: what ``qaccel.Accelerator()`` sees under ``torchrun``.

Usage: ``torchrun --nproc_per_node 2 tests/e2e/_launch_probe.py OUT_DIR MODE`` with MODE ``default``
(``Accelerator()``), ``qsdp`` (``Accelerator(fsdp_plugin=QSDPPlugin())``), ``stock``
(``accelerate.Accelerator()``, the upstream behaviour) or ``cpu_false`` (``Accelerator(cpu=False)``).
Each rank writes ``rank<RANK>.json``: its view of the run plus a sum over the process group, which shows
whether the processes really form one group.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import accelerate
import torch
import torch.distributed as dist

from qaccel import Accelerator, QSDPPlugin


def main(out_dir: str, mode: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    if mode == "stock":
        accelerator = accelerate.Accelerator()
    elif mode == "qsdp":
        accelerator = Accelerator(fsdp_plugin=QSDPPlugin(weight_bits=8, grad_bits=8))
    elif mode == "cpu_false":
        accelerator = Accelerator(cpu=False)
    else:
        accelerator = Accelerator()
    ones = torch.ones(1, device=accelerator.device)
    group_sum = accelerator.reduce(ones, reduction="sum") if accelerator.num_processes > 1 else ones
    record = {
        "rank_env": int(os.environ["RANK"]),
        "num_processes": accelerator.num_processes,
        "process_index": accelerator.process_index,
        "is_main_process": accelerator.is_main_process,
        "is_local_main_process": accelerator.is_local_main_process,
        "distributed_type": accelerator.distributed_type.value,
        "device": str(accelerator.device),
        "group_size": dist.get_world_size() if dist.is_initialized() else None,
        "group_sum": float(group_sum[0]),
    }
    Path(out_dir, f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
