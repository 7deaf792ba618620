"""hvdtrain: a Horovod-style data-parallel trainer for PyTorch.

    horovodrun -np 4 hvdtrain fit --config run.yaml      # the command
    horovodrun -np 4 python train.py                     # a script calling hvdtrain.fit

From Python: `hvdtrain.fit(model=..., data=..., task=..., epochs=..., ...)` takes objects as well as
everything the command takes, and returns the summary; see README.md, "From Python".
"""

from hvdtrain.api import fit
from hvdtrain.config import Config
from hvdtrain.errors import UserError

__all__ = ["Config", "UserError", "__version__", "fit"]
__version__ = "0.1.0"
