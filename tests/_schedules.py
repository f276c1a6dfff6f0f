"""The 0/1 Adam schedule's step kinds in closed form, written from DeepSpeed's rules independently of qaccel's schedule.

DeepSpeed's ``ZeroOneAdam``: steps 2..F+1 are phase 1, with a variance (FULL) step when t is a multiple of an
interval that doubles after every ``kappa`` variance steps; in phase 2 a sync when t is a multiple of an interval
that doubles every ``alpha`` steps up to ``H``, a local step otherwise.
"""

from __future__ import annotations

__all__ = ["closed_form_kinds"]


def closed_form_kinds(total: int, F: int, kappa: int, alpha: int, H: int) -> list[str]:
    """The kind of each of steps 1..total ("init", "full", "onebit_gradient", "sync", "local")."""
    last_phase1 = max(F + 1, 2)  # DeepSpeed never freezes at the init step, so step 2 is always phase 1
    variance, t, j = set(), 2, 0
    while t <= last_phase1:
        variance.add(t)
        j += 1
        interval = 2 ** (j // kappa)
        t = interval * (t // interval + 1)
    kinds = ["init"]
    for t in range(2, total + 1):
        if t <= last_phase1:
            kinds.append("full" if t in variance else "onebit_gradient")
        else:
            k = t - last_phase1
            h = min(H, 2 ** ((k - 1) // alpha))
            kinds.append("sync" if t % h == 0 else "local")
    return kinds
