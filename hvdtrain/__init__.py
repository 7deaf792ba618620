"""hvdtrain: a Horovod-style data-parallel trainer for PyTorch.

    horovodrun -np 4 hvdtrain fit --config run.yaml      # the command
    horovodrun -np 4 python train.py                     # a script calling hvdtrain.fit

From Python: `hvdtrain.fit(model=..., data=..., task=..., epochs=..., ...)` takes objects as well as
everything the command takes, and returns the summary; `hvdtrain.launch(fn_or_settings, np=4)` starts
the processes itself (a notebook); see README.md, "From Python".
"""

from hvdtrain.api import evaluate, export, fit, predict
from hvdtrain.config import Config
from hvdtrain.errors import UserError
from hvdtrain.local_launch import LaunchFailed, launch

__all__ = ["Config", "LaunchFailed", "UserError", "__version__", "evaluate", "export", "fit", "launch", "predict"]
__version__ = "0.1.0"
