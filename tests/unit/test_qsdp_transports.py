"""QSDP's comms as transports: one padding / merge rule, construction-time choices, pooled buffers, the flat collectives.

Oracles: segment maps and paddings worked out by hand from FSDP2's layout rule (dim 0 padded to a
multiple of the shard count, adjacent raw parameters one segment); the pool's reuse seen through
storage pointers; the flat all-gather's result against the input it gathered (one rank: the
output is the input) and the torch function it called, recorded by a wrapper.
"""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from qaccel import _torch_internals as torch_internals
from qaccel.comm import BufferPool, WireCodec, WireMeter
from qaccel.fsdp import (
    CountedAllGather,
    CountedReduceScatter,
    QuantizedAllGather,
    QuantizedReduceScatter,
    ReplicaChunking,
    SeedSchedule,
    UnitPlan,
    merge_segments,
    padded_shard_numel,
)

CODEC = WireCodec(bits=8, bucket_size=64)


@pytest.mark.parametrize(
    ("shape", "world", "expected"),
    [((10, 3), 4, 3 * 3), ((8, 5), 4, 2 * 5), ((7,), 2, 4), ((), 4, 1), ((3, 2, 2), 8, 1 * 4)],
    ids=["rows-padded", "rows-exact", "1d", "scalar", "more-ranks-than-rows"],
)
def test_padded_shard_numel_pads_dim0_to_a_multiple_of_the_world(shape, world, expected):
    assert padded_shard_numel(torch.Size(shape), world) == expected


def test_merge_segments_drops_empty_ones_and_joins_adjacent_raw_ones():
    pairs = [(4, False), (0, True), (2, False), (6, True), (0, False), (3, False), (1, False), (5, True), (5, True)]
    # (4 raw) + (2 raw) -> 6 raw; the empty quantized one vanishes; 3 + 1 raw after a quantized one join.
    assert merge_segments(pairs) == ((6, False), (6, True), (4, False), (5, True), (5, True))


def test_replica_chunks_and_unit_plans_share_the_merge_rule():
    # Pieces of ceil(n / 2): 3, 2, 0, 1, 4 -> (3 q), (2 + 0 + 1 raw), (4 q).
    chunking = ReplicaChunking(((5, True), (3, False), (0, False), (2, False), (7, True)), replicas=2)
    assert chunking.chunk_segments == ((3, True), (3, False), (4, True))
    assert chunking.chunk_numel == 10 and chunking.shard_numel == 17
    plan = UnitPlan.build(
        0, "u", [torch.Size([64, 64]), torch.Size([64]), torch.Size([64]), torch.Size([64, 64])], [2048, 32, 32, 2048],
        param_min_numel=1024, unit_min_numel=0,
    )  # fmt: skip
    assert plan.segments == ((2048, True), (64, False), (2048, True)) and plan.numel == 4160 and plan.enabled


def test_replica_chunking_split_then_join_gives_the_shard_back():
    chunking = ReplicaChunking(((5, True), (3, False), (2, False), (7, True)), replicas=3)
    shard = torch.arange(17, dtype=torch.float32) + 1
    chunks = torch.full((3, chunking.chunk_numel), float("nan"))
    chunking.split(shard, chunks)
    assert not chunks.isnan().any()  # every slot written, padding zero
    back = torch.zeros(17)
    chunking.join(chunks, back)
    assert torch.equal(back, shard)


def _plan(enabled: bool = True) -> UnitPlan:
    return UnitPlan.build(0, "block", [torch.Size([64, 64])], [2048], param_min_numel=1024, unit_min_numel=0 if enabled else 10**9)


@pytest.mark.parametrize("cls", [QuantizedAllGather, QuantizedReduceScatter], ids=["all_gather", "reduce_scatter"])
def test_a_quantized_transport_without_a_codec_is_refused_and_names_the_counted_one(cls):
    with pytest.raises(ValueError, match=cls.__name__.replace("Quantized", "Counted")):
        cls(_plan(), None, SeedSchedule(0), WireMeter())
    with pytest.raises(ValueError, match="not enabled"):
        cls(_plan(enabled=False), CODEC, SeedSchedule(0), WireMeter())


def test_reduce_scatters_pool_their_input_and_never_their_output():
    pool = BufferPool()
    plan = _plan()  # a chunk of S = 2048 elements
    for comm in (QuantizedReduceScatter(plan, CODEC, SeedSchedule(0), WireMeter(), pool), CountedReduceScatter(plan, WireMeter(), pool)):
        first = comm.allocate((4 * 2048,), dtype=torch.float32, device=torch.device("cpu"))
        pointer = first.data_ptr()
        del first
        again = comm.allocate((4 * 2048,), dtype=torch.float32, device=torch.device("cpu"))
        assert again.data_ptr() == pointer  # the input came back from the pool
        outputs = [comm.allocate((2048,), dtype=torch.float32, device=torch.device("cpu")) for _ in range(2)]
        assert (outputs[0].numel(), outputs[1].numel()) == (2048, 2048)
        del outputs
        del again
    assert pool.nbytes() == 4 * 2048 * 4  # the inputs' one buffer: FSDP2 may keep an output as the gradient


def test_all_gathers_pool_everything_and_share_the_models_pool():
    pool = BufferPool()
    comms = (QuantizedAllGather(_plan(), CODEC, SeedSchedule(0), WireMeter(), pool), CountedAllGather(WireMeter(), pool))
    for comm in comms:
        assert comm.buffers is pool
        comm.allocate((16,), dtype=torch.float32, device=torch.device("cpu"))
    assert pool.nbytes() == 16 * 4  # one buffer: the second comm reused the first one's


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.filterwarnings("ignore:`torch.distributed.all_gather_into_tensor` is deprecated:FutureWarning")
@pytest.mark.parametrize("torch_has_single", [True, False], ids=["all_gather_single", "all_gather_into_tensor"])
def test_all_gather_single_calls_the_torch_function_there_is(one_rank_group, monkeypatch, torch_has_single):
    if torch_has_single and not hasattr(dist, "all_gather_single"):
        pytest.skip("this torch has no dist.all_gather_single (torch 2.11 has only all_gather_into_tensor)")
    called = []
    name = "all_gather_single" if torch_has_single else "all_gather_into_tensor"
    original = getattr(dist, name)

    def recording(output, input, group=None, async_op=False):
        called.append(name)
        return original(output, input, group=group, async_op=async_op)

    if not torch_has_single:
        monkeypatch.delattr(dist, "all_gather_single", raising=False)  # an older torch: only the *_tensor name
    monkeypatch.setattr(dist, name, recording)
    source = torch.arange(6, dtype=torch.float32)
    output = torch.zeros(6)
    work = torch_internals.all_gather_single(output, source, one_rank_group, async_op=True)
    work.wait()
    assert called == [name] and torch.equal(output, source)


def test_reduce_scatter_single_sums_with_the_given_op(one_rank_group):
    output = torch.zeros(4)
    assert torch_internals.reduce_scatter_single(output, torch.tensor([1.0, 2.0, 3.0, 4.0]), one_rank_group) is None
    assert torch.equal(output, torch.tensor([1.0, 2.0, 3.0, 4.0]))
