"""The GPU side of ``qaccel bench project``: the assumed GPU figures, a GPU node's links, and the projection.

Step time and speedup over stock FSDP2 and stock HSDP for the GPU recipes on several nodes of ``G`` GPUs at
the given rates between nodes. Every GPU figure is an assumption (:class:`Assumptions`), named in the output
with its value; a ``quant`` report written on a GPU replaces the assumed codec throughput by the measured one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ._e2e_methods import parse_rate
from ._project_bytes import METHODS, policy_dtypes, step_collectives
from ._project_inputs import COMPUTE_DTYPES, RecipeModel
from ._project_model import CodecRates, Link, Platform, step_time

__all__ = ["Assumptions", "gpu_platform", "gpu_codec", "project", "recipe_summary"]


@dataclass(frozen=True)
class Assumptions:
    """The GPU figures the projection assumes (every one is printed with the results)."""

    gpus_per_node: int = 8
    gpu: str = "H100/H200 SXM"
    tflops_16bit: float = 989.0  # dense bf16/fp16 tensor-core peak, TFLOP/s (datasheet)
    mfu: float = 0.40
    nvlink_gbytes_per_s: float = 360.0
    inter_node_efficiency: float = 0.90
    latency_us: float = 20.0
    overlap: float = 1.0
    codec_quantize_gelems_per_s: float = 200.0
    codec_dequantize_gelems_per_s: float = 300.0

    def flops(self, compute: str) -> float:
        """Peak FLOP/s at ``compute`` precision: the 16-bit figure, halved for fp32 (TF32 tensor cores)."""
        return self.tflops_16bit * 1e12 * (0.5 if compute == "fp32" else 1.0)

    def describe(self, codec_measured: str | None) -> list[dict]:
        """Every assumption as ``{name, flag, value, unit, note}``; ``codec_measured`` names the GPU codec measurement, if any."""
        codec_note = (f"measured: {codec_measured}" if codec_measured else
                      "assumed: memory-bound kernels at roughly a third of H100 HBM3 bandwidth (3.35 TB/s) for ~5 B "
                      "moved per element; no GPU measurement in the --quant report")  # fmt: skip
        return [
            {
                "name": "gpus_per_node",
                "flag": "--gpus_per_node",
                "value": self.gpus_per_node,
                "unit": "GPUs",
                "note": "one NIC per node carries all of its inter-node traffic",
            },
            {
                "name": "gpu",
                "flag": None,
                "value": self.gpu,
                "unit": "",
                "note": "the GPU the compute figures describe",
            },
            {
                "name": "tflops_16bit",
                "flag": "--gpu_tflops",
                "value": self.tflops_16bit,
                "unit": "TFLOP/s",
                "note": "dense bf16/fp16 tensor-core peak per GPU (datasheet); fp32 recipes get half (TF32)",
            },
            {
                "name": "mfu",
                "flag": "--mfu",
                "value": self.mfu,
                "unit": "",
                "note": "model FLOPs utilisation: T_compute = 6 * params * tokens / (peak * mfu); attention FLOPs are folded in",
            },
            {
                "name": "nvlink_gbytes_per_s",
                "flag": "--nvlink_gbytes_per_s",
                "value": self.nvlink_gbytes_per_s,
                "unit": "GB/s",
                "note": "NCCL bus bandwidth per GPU and direction inside a node (NVLink 4: 450 GB/s raw)",
            },
            {
                "name": "inter_node_efficiency",
                "flag": "--inter_node_efficiency",
                "value": self.inter_node_efficiency,
                "unit": "",
                "note": "fraction of the NIC's line rate NCCL achieves, full duplex",
            },
            {
                "name": "latency_us",
                "flag": "--latency_us",
                "value": self.latency_us,
                "unit": "us",
                "note": "per message step of a collective that crosses nodes (ring: P-1 steps per pass)",
            },
            {
                "name": "overlap",
                "flag": "--gpu_overlap",
                "value": self.overlap,
                "unit": "",
                "note": "alpha on GPUs: NCCL on its own streams hides every collective but the edges behind compute",
            },
            {
                "name": "codec_quantize_gelems_per_s",
                "flag": "--quant",
                "value": self.codec_quantize_gelems_per_s,
                "unit": "G elements/s",
                "note": codec_note,
            },
            {
                "name": "codec_dequantize_gelems_per_s",
                "flag": "--quant",
                "value": self.codec_dequantize_gelems_per_s,
                "unit": "G elements/s",
                "note": codec_note,
            },
        ]



def gpu_platform(rate_bits: float, a: Assumptions, codec: CodecRates) -> Platform:
    """A GPU node: NVLink ports inside, one NIC per node between nodes, NCCL overlapping as assumed."""
    inter = Link("nic", rate_bits / 8 * a.inter_node_efficiency, a.latency_us * 1e-6)
    return Platform(
        Link("port", a.nvlink_gbytes_per_s * 1e9), inter, codec, overlap={True: a.overlap, False: a.overlap}
    )


def project(
    recipes: list, methods: list[str], nodes_list: list[int], rates: list[str], a: Assumptions, codec: CodecRates
) -> list[dict]:
    """Step time of every (recipe, nodes, rate, method), with speedups over stock FSDP2 and HSDP."""
    rows = []
    for r in recipes:
        dtype = COMPUTE_DTYPES[r.compute]
        compute_s = 6 * r.shapes.num_params * r.tokens_per_gpu_step / (a.flops(r.compute) * a.mfu)
        for nodes in nodes_list:
            per_method = {}
            for name in methods:
                param, reduce = policy_dtypes(METHODS[name], dtype, accelerate=True)
                per_method[name] = step_collectives(r.shapes, METHODS[name], nodes=nodes, per_node=a.gpus_per_node, param_dtype=param,
                                                    reduce_dtype=reduce, backend="nccl", micro_batches=r.micro_batches)  # fmt: skip
            for rate in rates:
                platform = gpu_platform(parse_rate(rate), a, codec)
                times = {
                    name: step_time(cs, platform, compute_s=compute_s, prefetch=True, micro_batches=r.micro_batches)
                    for name, cs in per_method.items()
                }
                for name, t in times.items():
                    rows.append({
                        "recipe": r.name, "nodes": nodes, "gpus": nodes * a.gpus_per_node, "bandwidth": rate, "rate_bits_per_s": parse_rate(rate),
                        "method": name, "step_s": t.total_s, "compute_s": t.compute_s, "codec_s": t.codec_s, "comm_s": t.comm_s,
                        "exposed_comm_s": t.total_s - t.compute_s - t.codec_s, "edge_s": t.edge_s, "link_busy_s": t.link_busy_s,
                        "inter_node_bytes_per_node_step": t.bytes_per_step["inter_node"],
                        "intra_node_bytes_per_gpu_step": t.bytes_per_step["intra_node"],
                        "comm_bound": t.total_s > t.compute_s + t.codec_s + t.edge_s + 1e-12,
                        "speedup_vs_fsdp2": times["fsdp2"].total_s / t.total_s if "fsdp2" in times else None,
                        "speedup_vs_hsdp": times["hsdp"].total_s / t.total_s if "hsdp" in times else None,
                    })  # fmt: skip
    return rows



def gpu_codec(assumptions: Assumptions, measured: CodecRates | None) -> tuple[Assumptions, CodecRates]:
    """The GPU codec rates: the ``quant`` report's CUDA rows when it has them (``assumptions`` then names their
    figures), else the assumed throughput."""
    if measured is None:
        return assumptions, CodecRates(
            {8: 1e-9 / assumptions.codec_quantize_gelems_per_s},
            {8: 1e-9 / assumptions.codec_dequantize_gelems_per_s},
            source="assumed",
        )
    assumptions = replace(assumptions, codec_quantize_gelems_per_s=1e-9 / _nearest_value(measured.quantize_s),
                          codec_dequantize_gelems_per_s=1e-9 / _nearest_value(measured.dequantize_s))  # fmt: skip
    return assumptions, measured


def recipe_summary(r: RecipeModel) -> dict:
    """What the report says about one projected recipe."""
    return {"name": r.name, "params": r.shapes.num_params, "units": len(r.shapes.units), "compute": r.compute,
            "tokens_per_gpu_step": r.tokens_per_gpu_step, "micro_batches": r.micro_batches}  # fmt: skip


def _nearest_value(table: dict[int, float]) -> float:
    """The 8-bit figure (the projection's common width), else the widest measured."""
    return table.get(8, table[max(table)])
