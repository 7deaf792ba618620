"""hvdtrain: a Horovod-style data-parallel trainer for PyTorch.

    horovodrun -np 4 hvdtrain fit --config run.yaml

Use from Python with `hvdtrain.train.fit.fit(config, engine)`; see README.md.
"""

from hvdtrain.config import Config
from hvdtrain.errors import UserError

__all__ = ["Config", "UserError", "__version__"]
__version__ = "0.1.0"
