"""hvdtrain: a Horovod-style data-parallel trainer for PyTorch.

    horovodrun -np 4 hvdtrain fit --config run.yaml      # the command
    horovodrun -np 4 python train.py                     # a script calling hvdtrain.fit

From Python: `hvdtrain.fit(model=..., data=..., task=..., epochs=..., ...)` takes objects as well as
everything the command takes, and returns the summary; `hvdtrain.launch(fn_or_settings, np=4)` starts
the processes itself (a notebook); see README.md, "From Python".

The names below load on first use: the `hvdtrain` command imports this package first, and must
reach its signal handling before anything heavy (hvdtrain.cli).
"""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hvdtrain.api import evaluate, export, fit, predict
    from hvdtrain.config import Config
    from hvdtrain.errors import UserError
    from hvdtrain.local_launch import LaunchFailed, launch

__all__ = ["Config", "LaunchFailed", "UserError", "__version__", "evaluate", "export", "fit", "launch", "predict"]
__version__ = "0.1.0"
PARENT_AT_START = os.getppid()
"""This process's parent as it started: torchrun's agent, for a worker (engine/parent_death.py)."""


def _forked() -> None:
    global PARENT_AT_START
    PARENT_AT_START = os.getppid()  # a forked child's parent is the process it was forked from


os.register_at_fork(after_in_child=_forked)

_HOMES = {"evaluate": "hvdtrain.api", "export": "hvdtrain.api", "fit": "hvdtrain.api", "predict": "hvdtrain.api",
          "Config": "hvdtrain.config", "UserError": "hvdtrain.errors", "LaunchFailed": "hvdtrain.local_launch",
          "launch": "hvdtrain.local_launch"}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'hvdtrain' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
