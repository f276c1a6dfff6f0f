"""Run one of Accelerate's own distributed test scripts with ``qaccel.Accelerator`` in its place.

``accelerate launch ... _accelerate_script_runner.py test_sync`` runs
``accelerate/test_utils/scripts/test_sync.py`` as ``__main__`` after binding ``accelerate.Accelerator``
to qaccel's subclass, so every ``from accelerate import Accelerator`` in the script gets ours. The
scripts are Accelerate's checks of its own behaviour (their oracles are unwrapped models and plain
torch.distributed results), so passing them says the subclass keeps Accelerate's contract.
"""

import runpy
import sys

import accelerate
import accelerate.test_utils.scripts as upstream_scripts

import qaccel

accelerate.Accelerator = qaccel.Accelerator  # before the script's own `from accelerate import Accelerator`
script = sys.argv.pop(1)
runpy.run_path(f"{upstream_scripts.__path__[0]}/{script}.py", run_name="__main__")
