"""The README's first command: train ``gpt2-tiny`` with QSDP W8G8 and with stock FSDP2, side by side.

Both runs use 2 CPU processes, the same recipe, seed, data order and steps; only the
communication differs. Prints a table (final loss, eval perplexity, bytes this rank put on the
wire, wall time) and leaves, under ``--output_dir``: one run folder per method (checkpoint,
``metrics.jsonl``), ``demo.json`` with the table, and ``demo.png`` (loss and bytes per step).

    python scripts/demo.py --output_dir runs/demo            # what `make demo` runs
    python scripts/demo.py --output_dir runs/demo --max_steps 50
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
RUNS = (
    ("QSDP W8G8", "qsdp", ["--qsdp_weight_bits", "8", "--qsdp_grad_bits", "8"]),
    ("FSDP2 (stock)", "none", []),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="runs/demo")
    parser.add_argument("--recipe", default="gpt2-tiny")
    parser.add_argument("--max_steps", type=int, default=200, help="optimizer steps per run (the recipe has 300; 200 keeps the demo within about 5 minutes on 2 cores)")
    parser.add_argument("--launch_config", default=str(REPO_ROOT / "launch_configs" / "cpu_2proc_qsdp.yaml"))
    return parser.parse_args(argv)


def train(args: argparse.Namespace, method: str, extra: list[str], run_dir: Path) -> float:
    """One ``accelerate launch`` of scripts/train.py; returns its wall time in seconds."""
    command = [
        sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.launch_config,
        str(REPO_ROOT / "scripts" / "train.py"), "--recipe", args.recipe, "--method", method,
        "--output_dir", str(run_dir), *extra,
    ]  # fmt: skip
    if args.max_steps is not None:
        command += ["--max_steps", str(args.max_steps)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    print(f"\n=== {method}: {' '.join(command[3:])}", flush=True)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True)
    return time.perf_counter() - start


def summarize(run_dir: Path, seconds: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last_eval = [r for r in rows if "eval_loss" in r][-1]
    return {
        "steps": rows[-1]["step"],
        "final_loss": sum(r["loss"] for r in rows[-10:]) / len(rows[-10:]),  # mean of the last 10 steps
        "eval_loss": last_eval["eval_loss"],
        "eval_perplexity": last_eval["eval_perplexity"],
        "wire_bytes_total": rows[-1]["wire_bytes_total"],
        "wire_bytes_per_step": rows[-1]["wire_bytes_total"] / rows[-1]["step"],
        "wall_seconds": seconds,
        "median_step_seconds": sorted(r["step_seconds"] for r in rows)[len(rows) // 2],
        "curve": {"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows], "wire_bytes": [r["wire_bytes"] for r in rows]},
    }


def print_table(results: dict[str, dict]) -> None:
    base = results["FSDP2 (stock)"]["wire_bytes_total"]
    header = f"{'method':<15} {'steps':>5} {'final loss':>10} {'eval ppl':>9} {'MB sent/rank':>12} {'vs stock':>8} {'time s':>7}"
    print("\n" + header + "\n" + "-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<15} {r['steps']:>5} {r['final_loss']:>10.4f} {r['eval_perplexity']:>9.2f} "
            f"{r['wire_bytes_total'] / 1e6:>12.1f} {r['wire_bytes_total'] / base:>8.3f} {r['wall_seconds']:>7.1f}"
        )
    print("final loss: mean of the last 10 steps; MB sent: bytes this rank put on the wire (qaccel's meter); time: whole launch")


def plot(results: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in results.items():
        ax_loss.plot(r["curve"]["step"], r["curve"]["loss"], label=name, linewidth=1)
        ax_bytes.plot(r["curve"]["step"], [b / 1e6 for b in r["curve"]["wire_bytes"]], label=name)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title="gpt2-tiny, 2 CPU processes")
    ax_bytes.set(xlabel="optimizer step", ylabel="MB sent per rank", title="bytes on the wire per step", ylim=(0, None))
    for ax in (ax_loss, ax_bytes):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for name, method, extra in RUNS:
        run_dir = out / method
        seconds = train(args, method, extra, run_dir)
        results[name] = summarize(run_dir, seconds)
    print_table(results)
    (out / "demo.json").write_text(json.dumps(results, indent=2) + "\n")
    plot(results, out / "demo.png")
    print(f"\nruns: {out}/qsdp, {out}/none (checkpoints, metrics.jsonl); table: {out}/demo.json; plot: {out}/demo.png")
    return results


if __name__ == "__main__":
    main()
