"""The table of docs/diloco.md, "Tests": DiLoCo's quantized outer gradients against fp32 on the test's model.

Runs ``tests/dist/test_diloco.py``'s training (3 gloo ranks, 4 syncs of 3 AdamW steps) at each bit
width with error feedback off and on, and prints how far the final weights are from the fp32 run's,
the cosine of the movements, the bytes against fp32, and whether the islands ended bit-identical.

Usage (from the repository root): ``python scripts/diloco_outer_bits.py``
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests._dist import run_ranks  # noqa: E402
from tests.dist.test_diloco import _flat, _model, _train  # noqa: E402


def main() -> None:
    folder = Path(tempfile.mkdtemp())
    exact = run_ranks(_train, 3, folder, None)[0]
    moved = exact["after_syncs"][-1] - _flat(_model())
    print("| outer_bits | error feedback | off the fp32 run, of its movement | cosine | bytes vs fp32 | islands identical |")
    print("|---|---|---|---|---|---|")
    for bits in (8, 4, 2):
        for feedback in (False, True):
            ranks = run_ranks(_train, 3, folder, bits, feedback)
            final = ranks[0]["after_syncs"][-1]
            off = (final - exact["after_syncs"][-1]).norm() / moved.norm()
            cosine = torch.nn.functional.cosine_similarity(final - _flat(_model()), moved, dim=0)
            identical = all(torch.equal(r["after_syncs"][-1], final) for r in ranks)
            print(f"| {bits} | {'on' if feedback else 'off'} | {off:.2%} | {cosine:.4f} | {ranks[0]['recorded'] / exact['recorded']:.2f}x | {identical} |")


if __name__ == "__main__":
    main()
