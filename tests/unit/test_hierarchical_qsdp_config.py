"""Hierarchical QSDP's settings, its cut of a gradient shard into replica chunks, and what Accelerate may not ask of it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType

from qaccel import QSDPPlugin
from qaccel.comm import CollectiveTally
from qaccel.fsdp import QSDPConfig, ReplicaChunking, bytes_by_level
from qaccel.integration import _qsdp


def test_replica_grad_bits_reads_every_source_like_the_other_bits_fields(monkeypatch):
    assert QSDPConfig().replica_grad_bits == 4
    assert QSDPConfig().replica_grad_codec().bits == 4 and QSDPConfig().replica_grad_codec().bucket_size == 128
    assert QSDPConfig(replica_grad_bits="off").replica_grad_codec() is None
    assert QSDPConfig(replica_grad_bits=8).replica_grad_codec().bucket_size == 1024
    monkeypatch.setenv("QACCEL_QSDP_REPLICA_GRAD_BITS", "OFF")
    assert QSDPConfig.from_env().replica_grad_bits is None
    monkeypatch.setenv("QACCEL_QSDP_REPLICA_GRAD_BITS", "3")
    assert QSDPPlugin().qsdp_config.replica_grad_bits == 3
    assert QSDPPlugin(replica_grad_bits=2).qsdp_config.replica_grad_bits == 2  # the keyword wins over the variable
    with pytest.raises(ValueError, match=r"QSDPConfig\.replica_grad_bits=9: must be an int in \[2, 8\]"):
        QSDPConfig(replica_grad_bits=9)
    assert QSDPConfig(replica_grad_bits=8).differences(QSDPConfig()) == {"replica_grad_bits": (8, 4)}


def _reference_chunks(shard: torch.Tensor, segments, replicas: int) -> torch.Tensor:
    """Pad every segment with zeros to a multiple of R, view it as R rows, put the rows side by side."""
    columns, offset = [], 0
    for numel, _ in segments:
        piece = -(-numel // replicas)
        padded = torch.cat([shard[offset : offset + numel], shard.new_zeros(piece * replicas - numel)])
        columns.append(padded.view(replicas, piece))
        offset += numel
    return torch.cat(columns, dim=1)


@pytest.mark.parametrize("replicas", [2, 3, 4])
def test_replica_chunks_cut_every_segment_into_equal_pieces_and_join_back(replicas):
    segments = ((1000, True), (7, False), (5, False), (333, True), (1, False))
    shard = torch.randn(sum(n for n, _ in segments))
    chunking = ReplicaChunking(segments, replicas)
    chunks = torch.full((replicas, chunking.chunk_numel), float("nan"))
    chunking.split(shard, chunks)
    assert torch.equal(chunks, _reference_chunks(shard, segments, replicas))
    back = torch.full_like(shard, float("nan"))
    chunking.join(chunks, back)
    assert torch.equal(back, shard)
    # The two adjacent raw segments share one raw segment of the chunk; every chunk has one segment map.
    pieces = [-(-n // replicas) for n, _ in segments]
    assert chunking.chunk_segments == ((pieces[0], True), (pieces[1] + pieces[2], False), (pieces[3], True), (pieces[4], False))


def test_bytes_by_level_puts_the_replica_collectives_across_nodes():
    tallies = {
        "qsdp.all_gather": CollectiveTally(2, 100, 100),
        "qsdp.replica_reduce_scatter": CollectiveTally(1, 7, 7),
        "qsdp.replica_all_gather": CollectiveTally(1, 5, 5),
        "hsdp.replica_all_reduce": CollectiveTally(1, 3, 3),
        "fsdp.reduce_scatter": CollectiveTally(1, 11, 11),
    }
    assert bytes_by_level(tallies) == {"intra_node": 111, "inter_node": 15}


@pytest.mark.parametrize("sizes, named", [({"tp_size": 2}, "tp_size=2"), ({"cp_size": 2}, "cp_size=2")])
def test_tensor_and_context_parallel_meshes_are_refused_before_prepare(sizes, named):
    plugin = QSDPPlugin()
    parallelism = ParallelismConfig(dp_shard_size=2, **sizes)
    accelerator = SimpleNamespace(distributed_type=DistributedType.FSDP, state=SimpleNamespace(fsdp_plugin=plugin), parallelism_config=parallelism)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(NotImplementedError, match=rf"QSDP: parallelism_config {named}: .*hierarchical 2-D \(dp_replicate_size x dp_shard_size"):
        _qsdp.before_prepare(accelerator, (model, torch.optim.SGD(model.parameters(), lr=0.1)))
    # A 2-D data-parallel mesh (HSDP) passes the check.
    accelerator.parallelism_config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    _qsdp.before_prepare(accelerator, (model, torch.optim.SGD(model.parameters(), lr=0.1)))


def test_accelerate_shards_on_the_intra_node_dimension_only_while_preparing():
    from qaccel.integration._accelerate_internals import fsdp2_shards_within_nodes

    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    accelerator = SimpleNamespace(state=SimpleNamespace(parallelism_config=config))
    assert config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]  # Accelerate's own: native HSDP
    with fsdp2_shards_within_nodes(accelerator):
        inside = accelerator.state.parallelism_config
        assert inside.fsdp_dim_names == ["dp_shard_cp"]
        assert (inside.dp_replicate_size, inside.dp_shard_size, inside.total_size) == (2, 2, 4)
    assert accelerator.state.parallelism_config is config and config.fsdp_dim_names == ["dp_replicate", "dp_shard_cp"]


def test_accelerates_parallelism_check_is_held_back_then_run_on_the_callers_copy():
    from qaccel.integration._accelerate_internals import defer_parallelism_check, run_deferred_parallelism_check

    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)
    deferred = defer_parallelism_check(config)
    assert deferred is not config and "_validate_accelerator" not in vars(config)
    deferred._validate_accelerator(object())  # what Accelerator.__init__ calls: held back, no error
    # Accelerate's own check, run afterwards: 4 processes fit 2 x 2, 3 do not.
    good = SimpleNamespace(parallelism_config=deferred, multi_device=False, num_processes=4, is_fsdp2=True, distributed_type=DistributedType.FSDP)
    run_deferred_parallelism_check(good)
    assert "_validate_accelerator" not in vars(deferred)
    bad = SimpleNamespace(parallelism_config=defer_parallelism_check(config), multi_device=False, num_processes=3, is_fsdp2=True, distributed_type=DistributedType.FSDP)
    with pytest.raises(ValueError, match=r"total_size \(4\) does not match num_processes \(3\)"):
        run_deferred_parallelism_check(bad)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["--replicas", "3", "--world_size", "4"], "--replicas 3: --world_size 4 is not divisible by it"),
        (["--tasks", "nope"], "--tasks: unknown task 'nope'"),
        (["--replicas", "2", "--world_size", "4", "--tasks", "minilm-finetune"], "minilm-finetune"),
    ],
)
def test_bad_convergence_flags_are_one_line_and_exit_2_before_any_run(argv, named, capsys):
    from qaccel.cli import main

    assert main(["bench", "convergence", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("qaccel bench convergence: ") and named in err[0]
