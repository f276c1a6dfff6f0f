"""``qaccel demo``: train ``gpt2-tiny`` with QSDP W8G8 and with stock FSDP2, side by side (the README's first command).

Both runs use 2 CPU processes, the same recipe, seed, data order and steps; only the
communication differs. Where the machine allows it (root, ``ip`` and ``tc``, network namespaces),
both jobs run inside a private network namespace whose loopback is shaped to ``--bandwidth``
(100 Mbit/s by default, shared by both ranks and both directions), the same set-up as
``qaccel bench e2e``, so the time columns show what fewer bytes buy. Elsewhere the jobs run on the
unshaped loopback, and one line says why only the bytes column shows the gain.

Each job is ``accelerate launch --config_file <launch config> -m qaccel.train ...`` with this
interpreter, and the launch config is one that ships inside the package (``qaccel configs``), so
the demo runs the same from a wheel as from a checkout.

Prints a table (final loss, eval perplexity, bytes this rank put on the wire, median step time,
wall time) and leaves, under ``--output_dir``: one run folder per method (checkpoint,
``metrics.jsonl``), ``demo.json`` with the table and the link (with the bytes the shaped device
carried), and ``demo.png`` (loss and bytes per step; needs matplotlib, from the ``bench`` extra).

    qaccel demo --output_dir runs/demo                     # what `make demo` runs
    qaccel demo --output_dir runs/demo --bandwidth none    # unshaped: bytes only
    qaccel demo --output_dir runs/demo --max_steps 20      # a quick look
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from .._extras import pip_line
from .._resources import launch_config_names, launch_config_path
from ._e2e_methods import format_rate, parse_rate
from ._e2e_netns import NamespaceError, ShapedNamespace, check_prerequisites
from .e2e import rate_arg  # the bench's --bandwidth parser: same syntax, same messages

__all__ = ["RUNS", "add_arguments", "open_link", "train_args", "train_command", "job_env", "summarize", "print_table", "plot", "run"]

RUNS = (
    ("QSDP W8G8", "qsdp", ["--qsdp_weight_bits", "8", "--qsdp_grad_bits", "8"]),
    ("FSDP2 (stock)", "none", []),
)
DEFAULT_STEPS = 200  # both jobs in about 10 minutes at 100 Mbit/s on a shared 2-core machine (README)
# gpt2-tiny has 0.94M parameters: at 300 Mbit/s its link time per step is below its compute and the
# step times differ by about 1.2x; at 100 Mbit/s the link dominates as it does for the 17M-parameter
# model of `qaccel bench e2e` at 300 Mbit/s, which is the situation QSDP is for.
DEFAULT_BANDWIDTH = "100mbit"
DEFAULT_LAUNCH_CONFIG = "cpu_2proc_qsdp"
COMMAND = "qaccel demo"


def _launch_config_arg(text: str) -> str:
    """A launch config file, or the name of a shipped one (``qaccel configs``); returns its path."""
    if Path(text).expanduser().is_file():
        return str(Path(text).expanduser())
    try:
        return str(launch_config_path(text))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: neither a file nor a launch config that ships with qaccel ({', '.join(launch_config_names())})"
        ) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: must be an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be an integer >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's flags (those of the former ``scripts/demo.py``)."""
    parser.add_argument("--output_dir", default="runs/demo", help="where the run folders, demo.json and demo.png go")
    parser.add_argument("--recipe", default="gpt2-tiny", help="the recipe both jobs train (`qaccel recipes`)")
    parser.add_argument("--max_steps", type=_positive_int, default=DEFAULT_STEPS,
                        help=f"optimizer steps per run (default {DEFAULT_STEPS}; the recipe has 300)")  # fmt: skip
    parser.add_argument("--bandwidth", type=rate_arg, default=DEFAULT_BANDWIDTH,
                        help=f"rate of the shaped link in tc syntax (default {DEFAULT_BANDWIDTH}); 'none': unshaped loopback")  # fmt: skip
    parser.add_argument("--launch_config", type=_launch_config_arg, default=DEFAULT_LAUNCH_CONFIG,
                        help=f"an Accelerate config file or a shipped one's name (default {DEFAULT_LAUNCH_CONFIG})")  # fmt: skip


def open_link(stack: contextlib.ExitStack, bandwidth: str) -> tuple[ShapedNamespace | None, dict]:
    """A shaped namespace (closed by ``stack``, also on Ctrl-C), or None and the reason in ``link["note"]``."""
    rate = parse_rate(bandwidth)
    if rate is None:
        return None, {"rate": "none", "note": "--bandwidth none: unshaped loopback, so time is compute and only the bytes show the gain"}
    try:
        check_prerequisites(what=COMMAND)
        ns = stack.enter_context(ShapedNamespace(name=f"qaccel-demo-{os.getpid()}"))
        try:
            tbf = ns.shape(rate)
        except NamespaceError:
            ns.close()
            raise
    except NamespaceError as exc:
        reason = str(exc).splitlines()[0]
        return None, {"rate": "none", "note": f"no shaped link, so only the bytes show the gain (time here is compute): {reason}"}
    note = f"both jobs run in network namespace {ns.name}, its loopback shaped to {format_rate(rate)} (tc tbf, shared by both ranks)"
    return ns, {"rate": format_rate(rate), "tbf": tbf, "namespace": ns.name, "note": note}


def train_args(args: argparse.Namespace, method: str, extra: list[str], run_dir: Path) -> list[str]:
    """One job's ``qaccel.train`` arguments."""
    return ["--recipe", args.recipe, "--method", method, "--output_dir", str(run_dir), "--max_steps", str(args.max_steps), *extra]


def train_command(args: argparse.Namespace, method: str, extra: list[str], run_dir: Path) -> list[str]:
    """One job's ``accelerate launch -m qaccel.train`` command, run with this interpreter."""
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", args.launch_config]
    return [*launch, "-m", "qaccel.train", *train_args(args, method, extra, run_dir)]


def job_env(ns: ShapedNamespace | None) -> dict[str, str]:
    """The jobs' environment: this one, one thread per rank unless set; qaccel is imported as installed."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    if ns is not None:
        env["GLOO_SOCKET_IFNAME"] = "lo"  # the namespace's only interface; the host name may resolve to another
    return env


def _train(args: argparse.Namespace, method: str, extra: list[str], run_dir: Path, ns: ShapedNamespace | None) -> dict:
    """Run one job; returns its wall time and, when shaped, the bytes the link carried.

    Raises:
        subprocess.CalledProcessError: the job failed (its own output says why).
    """
    command = train_command(args, method, extra, run_dir)
    print(f"\n=== {method}: {' '.join(command[3:])}", flush=True)
    before = ns.qdisc_stats() if ns is not None else {}
    start = time.perf_counter()
    subprocess.run(ns.command(command) if ns is not None else command, env=job_env(ns), check=True)
    result = {"wall_seconds": time.perf_counter() - start}
    if ns is not None:
        after = ns.qdisc_stats()
        result["link_bytes"] = after.get("bytes", 0) - before.get("bytes", 0)  # both ranks, launch and eval included
        result["link_drops"] = after.get("drops", 0) - before.get("drops", 0)
    return result


def summarize(run_dir: Path, launch: dict) -> dict:
    """One run's row of the table (and its curves) from its ``metrics.jsonl``, with ``launch``'s timings."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last_eval = [r for r in rows if "eval_loss" in r][-1]
    return {
        "steps": rows[-1]["step"],
        "final_loss": sum(r["loss"] for r in rows[-10:]) / len(rows[-10:]),  # mean of the last 10 steps
        "eval_loss": last_eval["eval_loss"],
        "eval_perplexity": last_eval["eval_perplexity"],
        "wire_bytes_total": rows[-1]["wire_bytes_total"],
        "wire_bytes_per_step": rows[-1]["wire_bytes_total"] / rows[-1]["step"],
        "median_step_seconds": sorted(r["step_seconds"] for r in rows)[len(rows) // 2],
        **launch,
        "curve": {"step": [r["step"] for r in rows], "loss": [r["loss"] for r in rows], "wire_bytes": [r["wire_bytes"] for r in rows],
                  "seconds": list(itertools.accumulate(r["step_seconds"] for r in rows))},  # fmt: skip
    }


def print_table(results: dict[str, dict], link: dict) -> None:
    """The table on stdout, stock FSDP2 as the ``vs stock`` baseline."""
    base = results["FSDP2 (stock)"]
    header = (f"{'method':<15} {'steps':>5} {'final loss':>10} {'eval ppl':>9} {'MB sent/rank':>12} {'vs stock':>8} "
              f"{'s/step':>7} {'time s':>7}")  # fmt: skip
    print(f"\nlink: {link['rate']}\n" + header + "\n" + "-" * len(header))
    for name, r in results.items():
        print(
            f"{name:<15} {r['steps']:>5} {r['final_loss']:>10.4f} {r['eval_perplexity']:>9.2f} "
            f"{r['wire_bytes_total'] / 1e6:>12.1f} {r['wire_bytes_total'] / base['wire_bytes_total']:>8.3f} "
            f"{r['median_step_seconds']:>7.3f} {r['wall_seconds']:>7.1f}"
        )
    print("final loss: mean of the last 10 steps; MB sent: bytes this rank put on the wire (qaccel's meter); "
          "s/step: median optimizer step; time: whole launch (start-up, eval and checkpoint included)")  # fmt: skip
    print(f"demo: {link['note']}")


def plot(results: dict[str, dict], link: dict, path: Path) -> str:
    """Draw loss and bytes per step to ``path``; returns what was written, for the closing line."""
    try:
        import matplotlib
    except ImportError:  # an optional extra: the table and demo.json are the result
        return f"no plot (matplotlib is not installed: {pip_line('bench', ['matplotlib'])})"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes, ax_time) = plt.subplots(1, 3, figsize=(15, 4))
    for name, r in results.items():
        ax_loss.plot(r["curve"]["step"], r["curve"]["loss"], label=name, linewidth=1)
        ax_bytes.plot(r["curve"]["step"], [b / 1e6 for b in r["curve"]["wire_bytes"]], label=name)
        ax_time.plot(r["curve"]["step"], r["curve"]["seconds"], label=name)
    ax_loss.set(xlabel="optimizer step", ylabel="training loss", title=f"gpt2-tiny, 2 CPU processes, link {link['rate']}")
    ax_bytes.set(xlabel="optimizer step", ylabel="MB sent per rank", title="bytes on the wire per step", ylim=(0, None))
    ax_time.set(xlabel="optimizer step", ylabel="seconds", title="training time (sum of step times)", ylim=(0, None))
    for ax in (ax_loss, ax_bytes, ax_time):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot: {path}"


def run(args: argparse.Namespace) -> dict[str, dict]:
    """Both jobs, the table, ``demo.json`` and ``demo.png``; returns the rows by method name.

    Raises:
        subprocess.CalledProcessError: a job failed.
    """
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    with contextlib.ExitStack() as stack:
        ns, link = open_link(stack, args.bandwidth)
        print(f"demo: {link['note']}", flush=True)
        for name, method, extra in RUNS:
            run_dir = out / method
            results[name] = summarize(run_dir, _train(args, method, extra, run_dir, ns))
    print_table(results, link)
    (out / "demo.json").write_text(json.dumps({"link": link, "runs": results}, indent=2) + "\n")
    drawn = plot(results, link, out / "demo.png")
    print(f"\nruns: {out}/qsdp, {out}/none (checkpoints, metrics.jsonl); table: {out}/demo.json; {drawn}")
    return results
