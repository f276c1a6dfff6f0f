"""The training entry under the harness: ``python -m qaccel.bench._e2e_probe PROBE.json -- <qaccel.train flags>``.

Every rank of a ``qaccel bench e2e`` job runs this under torchrun. It runs ``qaccel.train`` itself, the users'
loop unchanged, and only adds one reading at the step boundaries that loop's :class:`StepMeter` already marks
(its clock starts in ``restart``, stops in ``end_step`` after the loss all-reduce, which every rank joins): the
first rank of each node reads its node's interface counters (``PROBE.json``'s ``node_counters``) there, and
every rank appends its step row with the counter deltas to ``<output_dir>/probe.rank<R>.jsonl``. One node:
the namespace loopback's ``tx_bytes`` is the whole job's traffic in the step (all ranks share it). Several
nodes: each node's ``lo`` (intra-node) and its veth's ``tx_bytes`` / ``rx_bytes`` (inter-node).

The harness reads ``metrics.jsonl`` for the step figures and these files for the link bytes and the other
ranks' wire bytes; nothing here trains, times or counts collectives of its own.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..training.run_log import RunProgress, StepMeter

if TYPE_CHECKING:
    from ..integration import Accelerator

__all__ = ["PROBE_FILE", "main", "read_counters"]

PROBE_FILE = "probe.rank{rank}.jsonl"


def read_counters(paths: dict[str, str]) -> dict[str, int]:
    """The current value of each interface counter file (``/sys/class/net/<dev>/statistics/...``)."""
    values = {}
    for key, path in paths.items():
        with open(path) as f:
            values[key] = int(f.read())
    return values


class CountedStepMeter(StepMeter):
    """The loop's :class:`StepMeter`, with this node's counters read at its two boundaries (first rank of a node).

    ``counters``: this node's counter paths (empty on the node's other ranks); ``out``: this rank's probe file.
    """

    def __init__(self, accelerator: Accelerator, *, counters: dict[str, str], out: Path) -> None:
        self.counters, self.out = counters, out  # before StepMeter's __init__, whose restart reads the counters
        super().__init__(accelerator)

    def restart(self) -> None:
        self.before = read_counters(self.counters)
        super().restart()

    def end_step(self, run: RunProgress, *, learning_rate: float) -> dict[str, Any]:
        row = super().end_step(run, learning_rate=learning_rate)
        after = read_counters(self.counters)
        record = {**row, "counters": {key: after[key] - self.before[key] for key in after},
                  "wire_bytes_by_kind": {kind: tally.sent_bytes for kind, tally in self.tallies.items()}}  # fmt: skip
        with open(self.out, "a") as f:
            f.write(json.dumps(record) + "\n")
        return row


def main(argv: list[str] | None = None) -> int:
    """Set up the counted meter for this rank, then run ``qaccel.train``'s command line (its exit status)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2 or argv[1] != "--":
        raise SystemExit("usage: python -m qaccel.bench._e2e_probe PROBE.json -- <qaccel.train flags>")
    spec = json.loads(Path(argv[0]).read_text())
    train_argv = argv[2:]
    rank, nproc_per_node = int(os.environ["RANK"]), int(spec["nproc_per_node"])
    node = rank // nproc_per_node
    group_rank = os.environ.get("GROUP_RANK")  # torchrun's node rank: ranks must be numbered node by node
    if group_rank is not None and int(group_rank) != node:
        raise RuntimeError(f"rank {rank} runs on node {group_rank}, expected node {node} (rank // nproc_per_node)")
    counted = functools.partial(
        CountedStepMeter,
        counters=spec["node_counters"][node] if rank % nproc_per_node == 0 else {},
        out=Path(spec["output_dir"]) / PROBE_FILE.format(rank=rank),
    )
    from .. import train as entry

    return entry.cli(train_argv, step_meter=counted)  # the loop's own meter, with the counters read at its boundaries


if __name__ == "__main__":
    sys.exit(main())
