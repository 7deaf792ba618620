"""How the `hvdtrain` command and the launcher entries end once their work is done: as the interpreter
would, without tearing it down. Freeing torch's modules takes about 0.4 s of a core, and 0.7 s once an
optimizer has loaded torch._dynamo: in every rank of every launch, for nothing. Imports nothing."""

from __future__ import annotations

import os
import sys


def leave_without_teardown(code: int | str | None) -> None:
    """Ends the process with sys.exit's `code`: the exit handlers run (Horovod's shutdown and its
    MPI_Finalize, TensorBoard's and logging's flushes, data-loader workers ended) and the streams are
    flushed, then os._exit. Returns instead, leaving the interpreter's own way out, where a thread that
    is not a daemon (a user's) would still be waited for, or where mpi4py would finalize MPI. A file a
    user's callback left open is not flushed: close it (in on_fit_end)."""
    import atexit
    import threading

    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.current_thread()) or _mpi4py_finalizes_at_teardown():
        return
    if code is not None and not isinstance(code, int):
        try:
            print(code, file=sys.stderr)  # as the interpreter does for sys.exit("message")
        except (AttributeError, OSError, ValueError):
            pass
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # no stream, or a closed pipe (hvdtrain runs | head)
            pass
    os._exit(code or 0)


def _mpi4py_finalizes_at_teardown() -> bool:
    """MPI started by mpi4py (a user's module imported it; Horovod then leaves MPI to it) is finalized
    in the interpreter's teardown, not by an exit handler: without it mpirun reports the rank as failed."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
    except Exception:  # noqa: BLE001 - a broken MPI: the interpreter's own way out
        return True
