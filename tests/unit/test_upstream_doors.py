"""The doors to torch's, transformers' and Accelerate's private surfaces (style guide §9).

Each accessor is checked against the real upstream object it reads (a real FSDP2 unit on a
one-rank gloo group, the installed ``transformers.Trainer``, a real ``accelerate.Accelerator``), and
each door is checked to fail with the attribute, the installed version and the checked versions
when the attribute is taken away, also through the qaccel code that uses it.
"""

from __future__ import annotations

import datetime
import importlib
import pickle
import re

import accelerate
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
import transformers.trainer as hf_trainer
from accelerate.state import AcceleratorState
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from qaccel import _torch_internals as door
from qaccel._upstream import PrivateSurface
from qaccel.fsdp import apply_prefetch, find_units
from qaccel.integration import _accelerate_internals, _transformers_internals
from qaccel.integration._transformers_internals import (
    check_trainer_internals,
    redo_device_setup,
    trainer_accelerator_class,
)


def assert_version_message(error: BaseException, what: str, package: str, checked: str, door_name: str) -> None:
    message = str(error)
    assert what in message, message
    assert f"installed {package} {importlib.import_module(package).__version__}" in message, message
    assert f"checked against {package} {checked}" in message, message
    assert door_name in message, message


def assert_torch_message(error: BaseException, what: str) -> None:
    assert_version_message(error, what, "torch", "2.11.0, 2.13.0", "qaccel._torch_internals")


# ---------------------------------------------------------------------------------- PrivateSurface
def test_a_property_that_fails_inside_is_not_reported_as_a_missing_attribute():
    class Holder:
        @property
        def broken(self):
            raise AttributeError("bug inside the property")

    surface = PrivateSurface("torch", ("2.13.0",), "somewhere")
    with pytest.raises(AttributeError, match="bug inside the property"):
        surface.get(Holder(), "broken", "a test")
    with pytest.raises(RuntimeError) as missing:
        surface.get(Holder(), "gone", "a test")
    assert_version_message(missing.value, "Holder.gone", "torch", "2.13.0", "somewhere")


# ------------------------------------------------------------------------------------------- torch
@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    assert not dist.is_initialized()
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _sharded(mesh, param_dtype=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model[2], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def test_fsdp2_accessors_read_a_real_unit(one_rank):
    model = _sharded(one_rank, param_dtype=torch.bfloat16)
    block = model[0]
    state = door.fsdp_state(block)
    assert state is door.fsdp_state(block) and state is not door.fsdp_state(model)
    assert door.state_modules(state) == (block,)
    (group,) = door.param_groups(state)
    # The group's parameters are exactly the ones fully_shard registered on the block, in order.
    assert [door.sharded_param(p) for p in door.group_params(group)] == list(block.parameters())
    for fsdp_param in door.group_params(group):
        assert torch.equal(door.sharded_local_tensor(fsdp_param), door.sharded_param(fsdp_param).to_local())
    assert door.group_param_dtype(group) is torch.bfloat16
    assert door.group_param_dtype(door.param_groups(door.fsdp_state(_sharded(one_rank)[0]))[0]) is None
    assert door.group_post_forward_mesh_size(group) is None  # reshard_after_forward=True: the regular shards
    collectives = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    comms = door.installed_comms(group)
    assert isinstance(comms["_all_gather_comm"], collectives.DefaultAllGather)
    assert isinstance(comms["_reduce_scatter_comm"], collectives.DefaultReduceScatter)
    door.set_unshard_async_op(group, True)
    assert group.unshard_async_op is True
    block.set_modules_to_forward_prefetch([model[2]])
    assert state._states_to_forward_prefetch == [door.fsdp_state(model[2])]
    door.clear_prefetch_targets(state)
    assert state._states_to_forward_prefetch == [] and state._states_to_backward_prefetch == []


def test_the_reduce_scatter_overlap_accessors_read_a_real_unit(one_rank):
    """What the overlapped reduce-scatter (qaccel.fsdp._rs_overlap) reads of FSDP2 and autograd."""
    model = _sharded(one_rank)
    (group,) = door.param_groups(door.fsdp_state(model[0]))
    weight, bias = door.group_params(group)
    assert door.param_sharded_size(weight) == torch.Size((6, 4)) and door.param_sharded_size(bias) == torch.Size((6,))
    assert door.param_contiguous_sharded_stride(weight) == (4, 1)
    assert door.param_offloads_to_cpu(weight) is False and door.param_shard_dim(weight) == 0
    assert door.group_force_sum_reduction(group) is False
    model[0].set_force_sum_reduction_for_comms(True)
    assert door.group_force_sum_reduction(group) is True
    model(torch.randn(2, 4)).sum().backward()  # FSDP2 sets the dtypes at its lazy init, in the first forward
    assert door.group_orig_dtype(group) is torch.float32  # the parameters' dtype, which FSDP2 casts the shard back to
    collectives = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_collectives")
    assert door.gradient_divide_factors() is collectives._get_gradient_divide_factors
    parameter = nn.Parameter(torch.ones(3))
    assert door.has_post_accumulate_grad_hooks(parameter) is False
    parameter.register_post_accumulate_grad_hook(lambda p: None)
    assert door.has_post_accumulate_grad_hooks(parameter) is True
    # inside a backward pass the graph task id is >= 0 and a queued callback runs once the pass ends
    seen = []

    def hook(grad):
        seen.append(door.current_graph_task_id())
        door.queue_backward_callback(lambda: seen.append("after"))
        return grad

    x = torch.ones(2, requires_grad=True)
    x.register_hook(hook)
    (x * 2).sum().backward()
    assert door.current_graph_task_id() == -1 and seen[0] >= 0 and seen[1:] == ["after"]


def test_a_missing_graph_task_id_names_the_versions(monkeypatch):
    monkeypatch.delattr(torch._C, "_current_graph_task_id")
    with pytest.raises(RuntimeError) as error:
        door.current_graph_task_id()
    assert_torch_message(error.value, "_current_graph_task_id")


def test_the_comm_base_classes_are_fsdp2s():
    api = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_api")
    assert door.fsdp2_comm_bases() == (api.AllGather, api.ReduceScatter)


def test_a_missing_comm_base_class_names_the_versions(monkeypatch):
    api = importlib.import_module("torch.distributed.fsdp._fully_shard._fsdp_api")
    monkeypatch.delattr(api, "ReduceScatter")
    with pytest.raises(RuntimeError) as error:
        door.fsdp2_comm_bases()
    assert_torch_message(error.value, "torch.distributed.fsdp._fully_shard._fsdp_api.ReduceScatter")


def test_missing_fsdp2_state_attributes_stop_qaccel_with_the_versions(one_rank, monkeypatch):
    model = _sharded(one_rank)
    state = door.fsdp_state(model[0])
    monkeypatch.delattr(type(state), "_fsdp_param_group", raising=False)  # torch 2.13's compatibility property
    monkeypatch.delattr(state, "_fsdp_param_groups", raising=False)  # torch 2.13's list
    monkeypatch.delattr(state, "_fsdp_param_group", raising=False)  # torch 2.11's one group
    with pytest.raises(RuntimeError) as error:
        find_units(model)
    assert_torch_message(error.value, "FSDPState._fsdp_param_groups")
    with pytest.raises(RuntimeError) as error:
        apply_prefetch(model)
    assert_torch_message(error.value, "FSDPState._fsdp_param_groups")


def test_a_unit_of_torch_2_11_keeps_its_one_group_under_the_older_name(one_rank, monkeypatch):
    # torch 2.11's FSDPState has `_fsdp_param_group` (one group or None) where 2.13 has a list.
    model = _sharded(one_rank)
    state = door.fsdp_state(model[0])
    (group,) = door.param_groups(state)
    monkeypatch.delattr(type(state), "_fsdp_param_group", raising=False)  # torch 2.13's compatibility property
    monkeypatch.delattr(state, "_fsdp_param_groups", raising=False)
    monkeypatch.setattr(state, "_fsdp_param_group", group, raising=False)
    assert door.param_groups(state) == [group]
    monkeypatch.setattr(state, "_fsdp_param_group", None)
    assert door.param_groups(state) == []


def test_setting_an_attribute_fsdp2_no_longer_has_fails_instead_of_creating_it(one_rank, monkeypatch):
    model = _sharded(one_rank)
    (group,) = door.param_groups(door.fsdp_state(model[0]))
    monkeypatch.delattr(group, "unshard_async_op")
    with pytest.raises(RuntimeError) as error:
        door.set_unshard_async_op(group, True)
    assert_torch_message(error.value, "FSDPParamGroup.unshard_async_op")
    assert not hasattr(group, "unshard_async_op")


def test_storage_use_count_counts_views():
    tensor = torch.empty(16)
    alone = door.storage_use_count(tensor)
    view = tensor[4:]
    assert door.storage_use_count(tensor) == alone + 1
    del view
    assert door.storage_use_count(tensor) == alone


def test_a_missing_storage_use_count_names_the_versions(monkeypatch):
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    with pytest.raises(RuntimeError) as error:
        door.storage_use_count(torch.empty(4))
    assert_torch_message(error.value, "torch._C._storage_Use_Count")


@pytest.mark.parametrize("ord", [2, float("inf")], ids=["l2", "max"])
def test_foreach_norm_matches_per_tensor_norms(ord):
    tensors = [torch.randn(5, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    expected = [torch.linalg.vector_norm(t, ord) for t in tensors]
    torch.testing.assert_close(door.foreach_norm(tensors, ord), expected)


def test_foreach_mul_scales_in_place_and_missing_ops_name_the_versions(monkeypatch):
    tensors = [torch.ones(3), torch.full((2,), 2.0)]
    door.foreach_mul_(tensors, torch.tensor(0.5))
    assert [t.tolist() for t in tensors] == [[0.5, 0.5, 0.5], [1.0, 1.0]]
    monkeypatch.delattr(torch, "_foreach_norm")
    with pytest.raises(RuntimeError) as error:
        door.foreach_norm(tensors)
    assert_torch_message(error.value, "torch._foreach_norm")


# ------------------------------------------------------------------------------------ transformers
def assert_transformers_message(error: BaseException, what: str) -> None:
    assert_version_message(error, what, "transformers", "5.24.0", "qaccel.integration._transformers_internals")


def test_the_installed_transformers_has_every_internal_the_trainer_uses():
    check_trainer_internals()
    for name in _transformers_internals.TRAINER_OVERRIDES:
        # qaccel's override must be the one the Trainer's MRO finds first.
        assert name in vars(_transformers_internals.TrainerHooks)


def test_a_missing_trainer_method_stops_qaccel_trainer_with_the_versions(monkeypatch):
    from qaccel.integration import Trainer

    monkeypatch.delattr(transformers.Trainer, "_clip_grad_norm")
    with pytest.raises(RuntimeError) as error:
        Trainer(model=nn.Linear(2, 2))
    assert_transformers_message(error.value, "Trainer._clip_grad_norm")


def test_a_resigned_trainer_method_names_both_parameter_lists(monkeypatch):
    monkeypatch.setattr(transformers.Trainer, "_get_grad_norm", lambda self, model: None)
    with pytest.raises(RuntimeError, match=re.escape("Trainer._get_grad_norm(model, grad_norm)")) as error:
        check_trainer_internals()
    assert "it takes (model)" in str(error.value)
    assert_transformers_message(error.value, "Trainer._get_grad_norm")


def test_the_accelerator_name_is_swapped_and_restored(monkeypatch):
    original = hf_trainer.Accelerator

    def factory(**kwargs):
        return kwargs

    with pytest.raises(KeyError), trainer_accelerator_class(factory):
        assert hf_trainer.Accelerator is factory
        raise KeyError("the parent failed")
    assert hf_trainer.Accelerator is original
    monkeypatch.delattr(hf_trainer, "Accelerator")
    with pytest.raises(RuntimeError) as error, trainer_accelerator_class(factory):
        pass
    assert_transformers_message(error.value, "transformers.trainer.Accelerator")


def test_redo_device_setup_recomputes_the_cached_device(tmp_path, monkeypatch):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    args.__dict__["_setup_devices"] = torch.device("meta")  # a stale cached value
    assert args.device.type == "meta"
    assert redo_device_setup(args).type == "cpu"
    monkeypatch.setattr(transformers.TrainingArguments, "_setup_devices", property(lambda self: torch.device("cpu")))
    with pytest.raises(RuntimeError) as error:
        redo_device_setup(args)
    assert_transformers_message(error.value, "TrainingArguments._setup_devices")


# -------------------------------------------------------------------------------------- accelerate
def test_prepared_optimizers_lists_every_prepare_call_and_names_the_versions_when_gone(monkeypatch):
    accelerator = accelerate.Accelerator(cpu=True)
    try:
        first = accelerator.prepare(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
        second = accelerator.prepare(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
        assert _accelerate_internals.prepared_optimizers(accelerator) == [first, second]
        monkeypatch.delattr(accelerator, "_optimizers")
        with pytest.raises(RuntimeError) as error:
            _accelerate_internals.prepared_optimizers(accelerator)
        assert_version_message(
            error.value, "Accelerator._optimizers", "accelerate", "1.15.0, 1.16.0", "qaccel.integration._accelerate_internals"
        )
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)


def _pickled_globals(path) -> set[tuple[str, str]]:
    """(module, name) of every global a pickle resolves (a file this test wrote, so loading it is safe)."""
    found: set[tuple[str, str]] = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            return super().find_class(module, name)

    with open(path, "rb") as fh:
        Recording(fh).load()
    return found


def test_dcp_metadata_refers_to_exactly_the_private_globals_the_door_allows(tmp_path):
    door.dcp_metadata_private_globals.cache_clear()
    dcp.save({"weight": torch.arange(6.0).reshape(2, 3), "step": 3}, checkpoint_id=str(tmp_path))
    private = {(module, name) for module, name in _pickled_globals(tmp_path / ".metadata") if name.startswith("_")}
    assert private == door.dcp_metadata_private_globals()


def test_a_missing_dcp_metadata_global_names_the_versions(monkeypatch):
    door.dcp_metadata_private_globals.cache_clear()
    monkeypatch.delattr(torch.serialization, "_get_layout")
    try:
        with pytest.raises(RuntimeError) as error:
            door.dcp_metadata_private_globals()
    finally:
        door.dcp_metadata_private_globals.cache_clear()
    assert_torch_message(error.value, "torch.serialization._get_layout")
