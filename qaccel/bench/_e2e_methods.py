"""What ``qaccel bench e2e`` runs: the methods, the model shapes, link rates and the 1-bit probe schedules.

Pure data and validation (no torch.distributed): the parent process validates the command line with it and
``_e2e_entry`` turns each row into the training entry's flags, so both agree on names.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "Method",
    "METHODS",
    "DEFAULT_METHODS",
    "MODELS",
    "PREFETCH_DEFAULT",
    "parse_rate",
    "format_rate",
    "parse_methods",
    "config_label",
    "onebit_probe",
    "make_schedule",
    "paper_counts",
    "PAPER_SCHEDULES",
    "NODES_DEFAULT_METHODS",
    "NODES_ONEBIT_METHODS",
    "default_methods",
    "check_methods_for_nodes",
]


@dataclass(frozen=True)
class Method:
    """One row of the method table.

    Attributes:
        name: stable key (JSON, ``--methods``).
        title: for tables and plots.
        parallel: ``"fsdp"`` (FSDP2, one unit per block and the root) or ``"ddp"``.
        compute: ``"fp32"`` or ``"bf16"``: the precision of forward/backward, which also picks the
            compute-only reference.
        qsdp: ``(weight_bits, grad_bits)`` when qaccel's comms are installed on the FSDP2 units
            (``(None, None)``: installed but both paths off, the metered pass-through); ``None``: stock FSDP2.
        ddp: DDP's gradient hook: ``"adamw"`` (qaccel's metered all-reduce), ``"powersgd"``, ``"bf16"`` or
            ``"onebit"`` (qaccel's 1-bit hook, :func:`qaccel.optim.register_ddp_comm_hook`, which follows the
            optimizer's comm plan).
        optimizer: ``"adamw"`` (torch's AdamW), ``"onebit"`` (1-bit Adam) or ``"zero_one"`` (0/1 Adam). A 1-bit
            optimizer runs under DDP (``ddp="onebit"``) or, on several nodes, on the node-sharded FSDP2 units of
            ``mesh="hqsdp"``, where :func:`qaccel.optim.register_hsdp_comm_hook` hands it the traffic across nodes.
        meter: where the meter bytes come from: ``"qaccel"``, the training entry's wire meter (``metrics.jsonl``'s
            ``wire_bytes``), for every row: stock FSDP2 counts through QSDP's pass-through comms, PowerSGD and the
            bf16 hook through the entry's metered hooks (``qaccel.training.comm_options``).
        mesh: ``"flat"`` (one group of all ranks, whatever the node count), ``"hsdp"`` (stock FSDP2 on the
            2-D mesh: sharded within a node, replicated across nodes) or ``"hqsdp"`` (FSDP2 on the intra-node
            mesh, qaccel across the replica group: hierarchical QSDP's all-reduce with AdamW, the 1-bit
            optimizer's compressed all-reduce with ``optimizer`` 1-bit). The last two need several nodes.
        replica_grad_bits: hierarchical QSDP's bits per gradient across nodes (``None``: exact fp32).
        reduce_scatter: ``"fsdp"`` (the installed comm's own) or ``"alltoall"``: qaccel's exact
            :func:`qaccel.comm.alltoall_reduce_scatter` in place of gloo's, which all-reduces the whole
            buffer (pytorch/pytorch#118911): the fair fp32 baseline, a true reduce-scatter.
        ddp_buckets: DDP's gradient buckets: ``"default"`` (25 MB), ``"one"`` (a cap that holds the whole
            model) or ``"small"`` (4 MB: more, shorter 1-bit all-reduces to overlap with backward).
            PowerSGD needs one on gloo: torch's hook deadlocks there with several (``docs/powersgd_gloo.md``).
        overlap_comm: a 1-bit optimizer's ``overlap_comm`` under DDP (start each bucket's 1-bit all-reduce
            in backward, the default; False: the optimizer step runs it after backward).
        overlap_reduce_scatter: QSDP's ``overlap_reduce_scatter`` (the default, True: the reduce-scatter's
            transport runs while autograd computes the next unit; False: FSDP2 waits for it).
    """

    name: str
    title: str
    parallel: str
    compute: str = "fp32"
    qsdp: tuple[int | None, int | None] | None = None
    ddp: str | None = None
    meter: str = "qaccel"
    mesh: str = "flat"
    replica_grad_bits: int | None = None
    reduce_scatter: str = "fsdp"
    ddp_buckets: str = "default"
    optimizer: str = "adamw"
    overlap_comm: bool = True
    overlap_reduce_scatter: bool = True

    def __post_init__(self) -> None:
        if self.optimizer not in _OPTIMIZERS:
            raise ValueError(
                f"Method {self.name}: optimizer={self.optimizer!r}, expected one of {', '.join(_OPTIMIZERS)}"
            )
        onebit = self.optimizer != "adamw"
        if self.parallel == "ddp" and onebit != (self.ddp == "onebit"):
            raise ValueError(f"Method {self.name}: a 1-bit optimizer under DDP needs ddp='onebit' and only it "
                             f"(got optimizer={self.optimizer!r}, ddp={self.ddp!r})")  # fmt: skip
        if self.parallel == "fsdp" and onebit and self.mesh != "hqsdp":
            raise ValueError(f"Method {self.name}: a 1-bit optimizer on FSDP2 shards needs mesh='hqsdp' (it owns the "
                             f"traffic across nodes), got mesh={self.mesh!r}")  # fmt: skip

    @property
    def needs_nodes(self) -> bool:
        """Replicates across nodes and shards within one: only meaningful with ``--nodes`` >= 2."""
        return self.mesh != "flat"

    @property
    def schedule_weighted(self) -> bool:
        """1-bit optimizers change what a step sends over the run: their figures are weighted by step kind."""
        return self.optimizer != "adamw"


_OPTIMIZERS = ("adamw", "onebit", "zero_one")


_TABLE = (
    Method("fsdp2-fp32", "FSDP2 fp32", "fsdp"),
    Method("fsdp2-fp32-a2a", "FSDP2 fp32, true reduce-scatter", "fsdp", qsdp=(None, None), reduce_scatter="alltoall"),
    Method("fsdp2-bf16", "FSDP2 bf16 (params and reductions)", "fsdp", compute="bf16"),
    Method("qsdp-off", "qaccel comms, compression off", "fsdp", qsdp=(None, None)),
    Method("qsdp-w8g8", "QSDP W8G8", "fsdp", qsdp=(8, 8)),
    Method("qsdp-w8g8-bf16", "QSDP W8G8, bf16 compute", "fsdp", compute="bf16", qsdp=(8, 8)),
    Method("qsdp-w4g4", "QSDP W4G4", "fsdp", qsdp=(4, 4)),
    Method("qsdp-w8g8-rs-serial", "QSDP W8G8, reduce-scatter not overlapped", "fsdp", qsdp=(8, 8), overlap_reduce_scatter=False),
    Method("qsdp-w4g4-rs-serial", "QSDP W4G4, reduce-scatter not overlapped", "fsdp", qsdp=(4, 4), overlap_reduce_scatter=False),
    Method("qsdp-w4g4-bf16", "QSDP W4G4, bf16 compute", "fsdp", compute="bf16", qsdp=(4, 4)),
    Method("ddp-adamw", "DDP AdamW", "ddp", ddp="adamw"),
    Method("ddp-powersgd", "DDP AdamW + PowerSGD hook (rank 1, one DDP bucket)", "ddp", ddp="powersgd", ddp_buckets="one"),
    Method("ddp-bf16", "DDP AdamW + bf16 compression hook", "ddp", ddp="bf16"),
    Method("onebit-adam", "1-bit Adam", "ddp", ddp="onebit", optimizer="onebit"),
    Method("zero-one-adam", "0/1 Adam", "ddp", ddp="onebit", optimizer="zero_one"),
    Method("onebit-adam-serial", "1-bit Adam, 1-bit all-reduce after backward", "ddp", ddp="onebit", optimizer="onebit", overlap_comm=False),
    Method("onebit-adam-4mb", "1-bit Adam, 4 MB DDP buckets", "ddp", ddp="onebit", optimizer="onebit", ddp_buckets="small"),
    Method("zero-one-adam-4mb", "0/1 Adam, 4 MB DDP buckets", "ddp", ddp="onebit", optimizer="zero_one", ddp_buckets="small"),
    Method("zero-one-adam-serial", "0/1 Adam, 1-bit all-reduce after backward", "ddp", ddp="onebit", optimizer="zero_one", overlap_comm=False),
    # several nodes only (``--nodes`` >= 2): sharded within a node, replicated across nodes
    Method("hsdp-fp32", "HSDP fp32 (stock FSDP2, 2-D mesh)", "fsdp", mesh="hsdp"),
    Method("hqsdp-w8g8-r8", "hierarchical QSDP: W8G8 in a node, 8-bit across", "fsdp", qsdp=(8, 8), mesh="hqsdp", replica_grad_bits=8),
    Method("hqsdp-w8g8-r4", "hierarchical QSDP: W8G8 in a node, 4-bit across", "fsdp", qsdp=(8, 8), mesh="hqsdp", replica_grad_bits=4),
    Method("hqsdp-off-r4", "hierarchical QSDP: exact in a node, 4-bit across", "fsdp", qsdp=(None, None), mesh="hqsdp", replica_grad_bits=4),
    # 1-bit optimizers on the node's shards: exact inside a node (qaccel's comms with compression off, metered),
    # exact across nodes on full steps only, 1-bit across on the compressed ones, nothing across on local steps
    Method("hsdp-zero-one-adam", "0/1 Adam on HSDP shards: exact in a node, 1-bit across, local steps", "fsdp", qsdp=(None, None), mesh="hqsdp", optimizer="zero_one"),
    Method("hsdp-onebit-adam", "1-bit Adam on HSDP shards: exact in a node, 1-bit momentum across", "fsdp", qsdp=(None, None), mesh="hqsdp", optimizer="onebit"),
    Method("hqsdp-w8g8-zero-one-adam", "QSDP W8G8 in a node + 0/1 Adam across", "fsdp", qsdp=(8, 8), mesh="hqsdp", optimizer="zero_one"),
)  # fmt: skip
METHODS: dict[str, Method] = {m.name: m for m in _TABLE}
# one node (and ``all`` there): every method that runs on one node, in table order
DEFAULT_METHODS: tuple[str, ...] = tuple(name for name, m in METHODS.items() if not m.needs_nodes)
# several nodes, by default: the comparison (stock FSDP2 and QSDP over all ranks, stock and hierarchical HSDP)
NODES_DEFAULT_METHODS: tuple[str, ...] = ("fsdp2-fp32", "hsdp-fp32", "qsdp-w8g8", "hqsdp-w8g8-r8", "hqsdp-w8g8-r4", "hqsdp-off-r4")
# The 1-bit rows on HSDP shards with their baseline, the 0/1 Adam comparison. Not in the default: each
# runs a probe schedule of 4 to 6 x --steps steps (every step kind --steps times, onebit_probe), about 5 minutes
# for gpt2-17m at --steps 3 on 2 shared cores, so the four take about 15: run them with --methods.
NODES_ONEBIT_METHODS: tuple[str, ...] = (
    "hsdp-fp32",
    "hsdp-zero-one-adam",
    "hsdp-onebit-adam",
    "hqsdp-w8g8-zero-one-adam",
)
# --prefetch default: both settings for the two methods the overlap question is about and for the fair fp32
# baseline they are compared with, off elsewhere.
PREFETCH_DEFAULT = {"fsdp2-fp32": (False, True), "fsdp2-fp32-a2a": (False, True), "qsdp-w8g8": (False, True)}

# Model shapes. gpt2-17m: 17.4M parameters, sized so that stock FSDP2 fp32 spends most of its step on a
# 300 Mbit/s link communicating (see BENCHMARKS.md). "tiny" is for the smoke test.
MODELS: dict[str, dict] = {
    "gpt2-17m": {
        "config": {"n_layer": 8, "n_embd": 384, "n_head": 6, "vocab_size": 8192, "n_positions": 128,
                   "bos_token_id": 8191, "eos_token_id": 8191},
        "batch_size": 4,
        "seq_len": 128,
    },
    "tiny": {
        "config": {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 512, "n_positions": 32,
                   "bos_token_id": 511, "eos_token_id": 511},
        "batch_size": 2,
        "seq_len": 32,
    },
}

# The schedules the 1-bit step kinds are weighted with: the 0/1 Adam paper's BERT-Large seq128 run with the
# DeepSpeed tutorial's alpha, as in `qaccel bench comm` (T = 152,000 steps; 1-bit Adam freezes at 23,000).
PAPER_SCHEDULES = {
    "total_steps": 152_000,
    "zero_one": {"var_freeze_step": 12_500, "var_update_scaler": 16, "local_step_scaler": 1000, "local_step_clipper": 16},
    "onebit": {"freeze_step": 23_000},
}

_RATE_UNITS = {  # tc(8) rate units -> bits per second; a bare number is bits per second, as in tc
    "": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
    "kibit": 2**10, "mibit": 2**20, "gibit": 2**30, "tibit": 2**40,
    "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9, "tbps": 8e12,
    "kibps": 8 * 2**10, "mibps": 8 * 2**20, "gibps": 8 * 2**30, "tibps": 8 * 2**40,
}  # fmt: skip
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$")
MIN_RATE_BITS = 1e5  # below 100 kbit/s a 17M-parameter step would take hours


def parse_rate(text: str) -> float | None:
    """``tc`` rate syntax (``300mbit``, ``1gbit``, ``125mbps``, ``5e5`` is refused) to bits/s; ``none``: unshaped."""
    word = text.strip().lower()
    if word in ("none", "unshaped"):
        return None
    match = _RATE_RE.match(word)
    units = ", ".join(u for u in _RATE_UNITS if u)
    if not match or match.group(2) not in _RATE_UNITS:
        raise ValueError(f"bandwidth {text!r}: expected a tc rate such as 300mbit or 1gbit (units: {units}), or 'none'")
    bits = float(match.group(1)) * _RATE_UNITS[match.group(2)]
    if bits < MIN_RATE_BITS:
        raise ValueError(f"bandwidth {text!r}: {bits:g} bit/s is below the minimum of {MIN_RATE_BITS:g} bit/s (100kbit)")
    return bits


def format_rate(bits: float | None) -> str:
    """Bits/s as tc writes them (``300mbit``), ``none`` for unshaped."""
    if bits is None:
        return "none"
    for unit, scale in (("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)):
        if bits >= scale and abs(bits / scale - round(bits / scale)) < 1e-9:
            return f"{round(bits / scale)}{unit}"
    return f"{round(bits)}bit"


def parse_methods(text: str) -> list[str]:
    """A comma-separated list of method names (``all`` for every one), each checked against the table.

    ``all`` stays ``["all"]`` here: what it means depends on ``--nodes`` (:func:`default_methods`).
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    if names == ["all"]:
        return names
    unknown = [name for name in names if name not in METHODS]
    if unknown or not names:
        raise ValueError(f"--methods {text!r}: unknown {unknown or 'empty list'}; known: {', '.join(METHODS)} (or all)")
    return list(dict.fromkeys(names))


def default_methods(nodes: int, *, everything: bool = False) -> list[str]:
    """The methods run without ``--methods`` (``everything``: with ``--methods all``) at ``nodes`` nodes.

    One node: every one-node method either way. Several nodes: the issue's six by default; ``all`` adds
    every flat method, which runs over all ranks of all nodes unchanged.
    """
    if nodes == 1:
        return list(DEFAULT_METHODS)
    return list(METHODS) if everything else list(NODES_DEFAULT_METHODS)


def check_methods_for_nodes(methods: list[str], nodes: int) -> None:
    """Refuse, naming them, the methods that need several nodes when ``nodes`` is 1 (ValueError)."""
    if nodes > 1:
        return
    multi = [name for name in methods if METHODS[name].needs_nodes]
    if multi:
        flat = ", ".join(DEFAULT_METHODS)
        raise ValueError(
            f"--methods {','.join(multi)}: shards within a node and replicates across nodes, so it needs --nodes 2 or "
            f"more (got --nodes {nodes}); on one node use the flat methods: {flat}"
        )


def config_label(method: str, prefetch: bool | None) -> str:
    """Stable key of a (method, prefetch) configuration: ``qsdp-w8g8`` or ``qsdp-w8g8+prefetch``."""
    return f"{method}+prefetch" if prefetch else method


def onebit_probe(method: str, samples: int) -> tuple[dict, int]:
    """A schedule (optimizer kwargs) and step count under which every step kind of ``method``'s 1-bit optimizer
    occurs ``samples`` times in steady state.

    Steady means: neither the first step of its kind nor a step at whose end the phase changes (both
    allocate optimizer state, as in ``qaccel bench comm``). The init step is measured once and counts in
    the schedule-weighted figures with its (tiny) weight. DDP and HSDP rows of one optimizer share the probe.
    """
    optimizer = METHODS[method].optimizer if method in METHODS else None
    if optimizer == "onebit":
        freeze = samples + 3  # full steps 2..F: the first and the freezing one are not steady
        kwargs = {"freeze_step": freeze}
        candidates = [(kwargs, freeze + samples + 1)]
    elif optimizer == "zero_one":
        # kappa 2: full steps at 2, 3, then every 2nd, 4th, ... step; the rest of phase 1 is 1-bit gradient
        # steps. Phase 2 syncs every step for alpha = 2 steps, then every second step (H = 2).
        candidates = []
        for freeze in range(4, 200):
            kwargs = {"var_freeze_step": freeze, "var_update_scaler": 2, "local_step_scaler": 2, "local_step_clipper": 2}
            candidates.append((kwargs, freeze + 1 + 2 * samples + 6))
    else:
        raise ValueError(f"onebit_probe: {method!r} is not a 1-bit method")
    for kwargs, steps in candidates:
        counts = steady_counts(make_schedule(optimizer, kwargs), steps)
        if set(counts) == _KINDS[optimizer] and min(counts.values()) >= samples:
            return kwargs, steps
    raise RuntimeError(f"onebit_probe: no probe schedule gives {samples} steady steps of every kind for {method}")


_KINDS = {"onebit": {"full", "onebit_momentum"}, "zero_one": {"full", "onebit_gradient", "sync", "local"}}


def make_schedule(optimizer: str, kwargs: dict):  # noqa: ANN201 (qaccel.optim is imported lazily)
    """A fresh step schedule of the 1-bit ``optimizer`` (``"onebit"`` or ``"zero_one"``) with ``kwargs``."""
    from ..optim import OneBitAdamSchedule, ZeroOneAdamSchedule

    if optimizer not in _KINDS:
        raise ValueError(
            f"make_schedule: optimizer {optimizer!r} has no 1-bit schedule; expected one of {', '.join(_KINDS)}"
        )
    return (ZeroOneAdamSchedule if optimizer == "zero_one" else OneBitAdamSchedule)(**kwargs)


def paper_counts(optimizer: str) -> dict[str, int]:
    """Steps of each kind over the paper's whole schedule (``PAPER_SCHEDULES``) for ``"zero_one"`` or ``"onebit"``."""
    from ..optim import count_step_kinds

    total = PAPER_SCHEDULES["total_steps"]
    counts = count_step_kinds(lambda: make_schedule(optimizer, PAPER_SCHEDULES[optimizer]), total)
    return {kind.value: n for kind, n in counts.items() if n}


def steady_kinds(schedule, steps: int) -> list[tuple[str, bool]]:
    """``(kind, steady)`` for each of ``steps`` steps of a fresh schedule (the rule of :func:`onebit_probe`)."""
    seen: set[str] = set()
    out = []
    for _ in range(steps):
        kind = schedule.next_kind()
        phase = schedule.phase
        schedule.advance(kind)
        steady = kind.value in seen and schedule.phase == phase and kind.value != "init"
        seen.add(kind.value)
        out.append((kind.value, steady))
    return out


def steady_counts(schedule, steps: int) -> dict[str, int]:
    """Steady steps per kind (init excluded) over ``steps`` steps; kinds that never occur count 0."""
    kinds = steady_kinds(schedule, steps)
    counts = {kind: 0 for kind, _ in kinds if kind != "init"}
    for kind, steady in kinds:
        if steady:
            counts[kind] += 1
    return counts
