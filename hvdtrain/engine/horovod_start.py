"""How Horovod starts in this process, before `hvd.init()`: the variables it reads then (hvdtrain's, never
over the user's own), and MPI's one start in a process that goes on after fit. Imports no Horovod."""

from __future__ import annotations

import os

from hvdtrain.errors import UserError

# Open MPI busy-polls while a collective waits, and Horovod's background thread waits in one every cycle
# (1 ms): on a host whose cores all compute (CPU training) that thread takes the core from its own rank's
# forward and backward. Yielding gives it back. At np=2 on 2 cores: 3232, 3207, 3274 samples/s against
# 1993, 2372, 2451 busy-polling; allreduce alone (4 KB to 64 MB) equal within the noise (BENCHMARKS.md).
MPI_SETTINGS = {"OMPI_MCA_mpi_yield_when_idle": "1"}

_ours: dict[str, str] = {}  # the Horovod variables hvdtrain set, as it set them
_horovod_finalized_mpi = False  # this process's MPI was Horovod's own, and its shutdown ended it


def set_ours(name: str, value: str | None, over_theirs: bool = False) -> None:
    """Sets (None: removes) a variable Horovod reads at init, unless the user set it: the value an
    earlier start in this process set is hvdtrain's, and follows this start's settings."""
    ours = name in _ours and os.environ.get(name) == _ours[name]
    if not (ours or over_theirs or name not in os.environ):
        return
    if value is None:
        if ours:
            del os.environ[name]
        _ours.pop(name, None)
    else:
        os.environ[name] = _ours[name] = value


def start_mpi(keep: bool) -> None:
    """dist: MPI starts once in a process, and Horovod finalizes the MPI it started when it shuts down:
    a second fit of a script (`keep`: the process goes on) would abort in MPI_Init. MPI started by
    mpi4py is left to the process's exit, and Horovod starts and shuts down on it once per fit."""
    global _horovod_finalized_mpi
    import sys

    if _horovod_finalized_mpi:
        raise UserError("MPI can start only once in a process, and the last fit or evaluate here ended it: "
                        "pip install mpi4py (launch/install.sh installs it with MPI), with which MPI lasts as "
                        "long as the process, or run each in a launch of its own")
    if not keep or "mpi4py.MPI" in sys.modules:  # the command's one start; or the user's own MPI
        return
    try:
        import mpi4py
    except ImportError:
        _horovod_finalized_mpi = True
        return
    mpi4py.rc.errors = "default"  # MPI's errors stay fatal: mpi4py's own default makes them return codes
    mpi4py.rc.thread_level = "multiple"  # as Horovod asks
    from mpi4py import MPI

    previous = sys.excepthook

    def abort_on_uncaught(kind, value, traceback) -> None:
        # dist: MPI_Finalize at exit waits for every rank; a rank whose script failed between two fits
        # would wait there for ranks waiting in the next fit for it. Abort ends the job instead.
        previous(kind, value, traceback)
        MPI.COMM_WORLD.Abort(1)

    sys.excepthook = abort_on_uncaught


def mpi_controls() -> bool:
    """Whether Horovod will run on MPI: an MPI launch that is not horovodrun's Gloo."""
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" in os.environ or os.environ.get("HOROVOD_CONTROLLER") == "gloo":
        return False
    return any(name in os.environ for name in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"))
