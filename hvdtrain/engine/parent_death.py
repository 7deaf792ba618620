"""A torchrun worker ends with its agent. torchrun's workers are its agent's children; an agent that
dies at once (kill -9, the out-of-memory killer, a node agent's crash) left them training on, orphans
that no one would stop, each printing a C++ traceback every two seconds as it published to the store
the agent hosted. Linux sends a process a signal of its choice when its parent dies (prctl's
PR_SET_PDEATHSIG): SIGTERM, a stop signal, so the workers stop together at one step with a
checkpoint to resume from (or, where SIGTERM is not a stop signal, end as SIGTERM ends them).

horovodrun's and mpirun's ranks need nothing of the kind: Open MPI ends them when mpirun dies
(cli/mpirun_child.py gives mpirun SIGHUP when hvdtrain's horovodrun entry dies).
"""

from __future__ import annotations

import ctypes
import os
import signal

import hvdtrain
from hvdtrain.engine.environment import torchrun_launched

PR_SET_PDEATHSIG = 1


def end_with_the_agent() -> None:
    """Under torchrun on Linux: SIGTERM to this process once its agent has died (at once if it died
    already)."""
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    if not torchrun_launched() or prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if agent_gone():  # it died before the line above: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)


def agent_gone() -> bool:
    """Under torchrun: this worker's agent has died (its parent changed since it started)."""
    return torchrun_launched() and os.getppid() != hvdtrain.PARENT_AT_START
