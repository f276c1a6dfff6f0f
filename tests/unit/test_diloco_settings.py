"""``DiLoCo``'s settings and step counting in one process (no process group: one island).

References: the messages name the bad value and what is allowed; with one island the outer step is
plain ``torch.optim.SGD`` on the pseudo-gradient (computed here by hand), and a call inside gradient
accumulation (``sync_gradients`` False) does not count as a step.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from qaccel.optim import DiLoCo, DiLoCoConfig
from qaccel.optim._diloco_fragments import fragment_offset, split_fragments

ACCELERATOR = SimpleNamespace(sync_gradients=True)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"sync_every": 0}, "DiLoCoConfig.sync_every=0: must be an int >= 1"),
        ({"sync_every": True}, "DiLoCoConfig.sync_every=True: must be an int >= 1"),
        ({"sync_every": 2.5}, "DiLoCoConfig.sync_every=2.5: must be an int >= 1"),
        ({"sync_every": 5, "outer_lr": 0}, "DiLoCoConfig.outer_lr=0: must be a finite number > 0"),
        ({"sync_every": 5, "outer_lr": math.nan}, "DiLoCoConfig.outer_lr=nan: must be a finite number > 0"),
        ({"sync_every": 5, "outer_momentum": 1.0}, r"DiLoCoConfig.outer_momentum=1.0: must be a number in \[0, 1\)"),
        ({"sync_every": 5, "outer_bits": 1}, r"DiLoCoConfig.outer_bits=1: must be an int in \[2, 8\], or off"),
        ({"sync_every": 5, "outer_bits": 16}, r"DiLoCoConfig.outer_bits=16: must be an int in \[2, 8\], or off"),
        ({"sync_every": 5, "outer_bits": 4, "outer_error_feedback": "maybe"}, "DiLoCoConfig.outer_error_feedback='maybe': not a boolean"),
    ],
)
def test_bad_settings_are_refused_naming_the_value(settings, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DiLoCo(ACCELERATOR, nn.Linear(2, 2), **settings)


def test_the_config_reads_flags_environment_and_recipe_in_that_order():
    environ = {"QACCEL_DILOCO_OUTER_BITS": "4", "QACCEL_DILOCO_SYNC_EVERY": "50"}
    config = DiLoCoConfig.from_env(environ, recipe={"sync_every": 20, "outer_lr": 0.5}, sync_every=10)
    assert (config.sync_every, config.outer_bits, config.outer_lr, config.outer_momentum) == (10, 4, 0.5, 0.9)
    assert DiLoCoConfig.from_env({}, recipe={"outer_bits": "off"}).outer_bits is None
    with pytest.raises(ValueError, match=r"DiLoCoConfig.outer_bits=9: must be an int in \[2, 8\].* \(from QACCEL_DILOCO_OUTER_BITS\)"):
        DiLoCoConfig.from_env({"QACCEL_DILOCO_OUTER_BITS": "9"})


def test_step_outside_the_context_is_refused():
    with pytest.raises(RuntimeError, match=r"DiLoCo.step\(\) outside its context"):
        DiLoCo(ACCELERATOR, nn.Linear(2, 2), sync_every=1).step()


def test_one_island_takes_the_outer_sgd_step_on_its_pseudo_gradient_every_period():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    accelerator = SimpleNamespace(sync_gradients=True)
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    with DiLoCo(accelerator, model, sync_every=2, outer_lr=0.5, outer_momentum=0.0) as diloco:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # an inner step
        accelerator.sync_gradients = False
        diloco.step()  # a micro-step of gradient accumulation: not counted
        accelerator.sync_gradients = True
        diloco.step()
        assert diloco.syncs == 0
        diloco.step()  # the second optimizer step ends the period
        assert diloco.syncs == 1
    # pseudo-gradient start - (start + 1) = -1; SGD: start - 0.5 * (-1) = start + 0.5
    torch.testing.assert_close(torch.cat([p.detach().reshape(-1) for p in model.parameters()]), start + 0.5, rtol=0, atol=1e-6)


def test_a_checkpoint_of_another_period_is_refused():
    saved = DiLoCo(ACCELERATOR, nn.Linear(2, 2), sync_every=3).state_dict()
    with pytest.raises(ValueError, match="DiLoCo checkpoint: sync_every=3 but this run has sync_every=4"):
        DiLoCo(ACCELERATOR, nn.Linear(2, 2), sync_every=4).load_state_dict(saved)



def test_fragments_split_the_parameters_by_size_and_must_divide_the_period():
    sizes = [8192, 512, 2048, 4]
    assert split_fragments(sizes, 1) == [[0, 1, 2, 3]]
    assert split_fragments(sizes, 2) == [[0], [1, 2, 3]]  # the first parameter holds half of the values
    assert split_fragments([1, 1, 1, 100], 3) == [[0, 1], [2], [3]]  # every fragment keeps at least one parameter
    assert [fragment_offset(f, 4, 8) for f in range(4)] == [2, 4, 6, 0]
    with pytest.raises(ValueError, match="DiLoCo fragments=5: the model has 4 trainable parameters"):
        split_fragments(sizes, 5)
    with pytest.raises(ValueError, match=r"DiLoCoConfig.fragments=3: must divide sync_every=4"):
        DiLoCo(ACCELERATOR, nn.Linear(2, 2), sync_every=4, fragments=3)


def test_a_restored_state_knows_its_last_sync_so_leaving_does_not_sync_again():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    with DiLoCo(ACCELERATOR, model, sync_every=2) as diloco:
        diloco.step()
        diloco.step()  # syncs
        saved = diloco.state_dict()
    restored = DiLoCo(ACCELERATOR, model, sync_every=2)
    restored.load_state_dict(saved)
    assert not restored.pending and restored.syncs == 1
    with torch.no_grad():
        model.weight.add_(1.0)  # were leaving to sync, this change would be averaged away
    with restored:
        pass
    assert restored.syncs == 1
