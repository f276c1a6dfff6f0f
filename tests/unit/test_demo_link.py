"""`qaccel demo`'s link (`make demo`): a shaped network namespace where the machine allows it, else one line saying why not.

The namespace is checked with `ip` and `tc` themselves, not with the demo's own bookkeeping.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest

from qaccel.bench import demo

# the bench's probes: whether this machine can make a namespace, and which exist (`ip netns list`)
from tests._launch import namespaces as _namespaces
from tests._launch import netns_unavailable as _netns_unavailable


def test_without_root_the_demo_says_why_in_one_line_and_creates_nothing(monkeypatch):
    before = _namespaces() if shutil.which("ip") else []
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with contextlib.ExitStack() as stack:
        ns, link = demo.open_link(stack, "100mbit")
    assert ns is None and link["rate"] == "none"
    assert "\n" not in link["note"]
    assert "only the bytes show the gain" in link["note"] and "qaccel demo needs root (effective uid 1000)" in link["note"]
    if shutil.which("ip"):
        assert _namespaces() == before


def test_bandwidth_none_runs_unshaped_and_says_so():
    with contextlib.ExitStack() as stack:
        ns, link = demo.open_link(stack, "none")
    assert ns is None and "unshaped" in link["note"]


@pytest.mark.skipif(_netns_unavailable() is not None, reason=str(_netns_unavailable()))
def test_as_root_the_jobs_get_a_shaped_namespace_that_is_removed_afterwards():
    with contextlib.ExitStack() as stack:
        ns, link = demo.open_link(stack, "100mbit")
        assert ns is not None and link["rate"] == "100mbit"
        assert ns.name in _namespaces()
        qdisc = subprocess.run(["tc", "-n", ns.name, "qdisc", "show", "dev", "lo"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 100Mbit" in qdisc, qdisc
        # a job started the demo's way runs inside it: its loopback is the namespace's own (no other interface)
        links = subprocess.run(ns.command(["ip", "-o", "link", "show"]), capture_output=True, text=True).stdout
        assert [line.split(":")[1].strip() for line in links.splitlines()] == ["lo"]
    assert ns.name not in _namespaces()
