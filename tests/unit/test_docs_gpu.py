"""The ``gpu-check`` and ``onebit-fused`` document blocks, against reports written out by hand."""

from __future__ import annotations

from qaccel.bench import _docs_gpu

ENV = {"device": "NVIDIA H200", "capability": [9, 0], "torch": "2.11.0+cu130", "torch_cuda": "13.0", "python": "3.12.3"}


class _Sources:
    def __init__(self, reports: dict) -> None:
        self.reports = reports

    def json(self, name: str) -> dict:
        return self.reports[name]


def _rows(text: str) -> dict[str, list[str]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| `"):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def test_a_rerun_replaces_only_the_sections_it_ran_and_each_row_names_its_report():
    first = {"environment": ENV, "build": {"seconds": 21.6}, "sections": ["bit_identical", "zero_one_adam"],
             "bit_identical": {"ok": True, "cases": 420, "mismatches": 0},
             "zero_one_adam": {"ok": False, "error": "Traceback ...\nRuntimeError: boom"}}  # fmt: skip
    steps = [{"kind": "init"}, {"kind": "full", "moments_vs_torch_adam": 2e-7}]
    rerun = {"environment": ENV, "sections": ["zero_one_adam"],
             "zero_one_adam": {"ok": True, "warmup_vs_torch_adam": {"steps": steps},
                               "all_step_kinds": {"kinds": ["full"] * 24, "weights_vs_plain_loop": 1.7e-6, "host_syncs": []}}}  # fmt: skip
    text = _docs_gpu.render_gpu_check(_Sources({"a": first, "b": rerun}), ("a", "b"))
    assert text.splitlines()[0] == "NVIDIA H200 (sm_90), torch 2.11.0+cu130, CUDA 13.0, Python 3.12.3; kernels JIT-built in 22 s."
    rows = _rows(text)
    assert rows["bit_identical"] == ["passed", "420 cases, 0 mismatches", "`a.json`"]
    assert rows["zero_one_adam"][0] == "passed" and rows["zero_one_adam"][2] == "`b.json`"
    assert "rel. 2.0e-07" in rows["zero_one_adam"][1] and "24 steps" in rows["zero_one_adam"][1]
    alone = _rows(_docs_gpu.render_gpu_check(_Sources({"a": first}), ("a",)))
    assert alone["zero_one_adam"] == ["**error**", "RuntimeError: boom", "`a.json`"]


def test_the_fused_1bit_rows_come_from_each_setting_and_backend():
    row = {"numel": 1024, "encode_fused_ns_per_value": 0.5, "encode_unfused_ns_per_value": 1.0, "encode_speedup": 2.0,
           "server_fused_ns_per_value": 0.25, "server_unfused_ns_per_value": 0.3, "server_speedup": 1.2}  # fmt: skip
    report = {"settings": {"cuda": {"onebit": {"cuda": row}}, "cpu_threads_1": {"backends": {}}}}
    lines = _docs_gpu.render_onebit_fused(_Sources({"q": report}), ("q",)).splitlines()
    assert lines[2:] == ["| cuda | cuda | 1,024 | 0.5000 / 1.0000 | 2.00x | 0.2500 / 0.3000 | 1.20x |"]
