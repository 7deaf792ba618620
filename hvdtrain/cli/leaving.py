"""How the `hvdtrain` command, the launcher entries and a torch-engine rank end once their work is done:
without tearing the interpreter down. Freeing torch's modules takes about 0.4 s of a core, and 0.7 s once an
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
    import threading

    _end_data_loader_workers()  # the interpreter's own way out runs multiprocessing's handler too
    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.current_thread()) or _mpi4py_finalizes_at_teardown():
        return
    _leave(code)


def leave_at_once(code: int | str | None) -> None:
    """Ends a torch-engine rank whose engine has shut down as `leave_without_teardown` does (the exit
    handlers, a user's too, then the flushes), but always past the interpreter's teardown: its teardown
    of torch.distributed's C++ side can abort."""
    _end_data_loader_workers()
    _leave(code)


def _leave(code: int | str | None) -> None:
    """The exit handlers, the flushes, then os._exit with sys.exit's `code` as the status."""
    import atexit

    status = _status(code)
    atexit._run_exitfuncs()
    flush_and_exit(status)


def _end_data_loader_workers() -> None:
    """Ends the daemonic child processes (data-loader workers) before the exit handlers run: multiprocessing's
    handler sends them SIGTERM and waits for them, and hvdtrain's workers ignore SIGTERM (it is their rank's
    to stop them). A finished run's loaders have ended theirs; a failed run's outlive its exception (in
    reference cycles with its frames) and are killed, as their rank's death would end them. Without this a
    rank that failed with workers waited for ever, and the launcher named the rank it killed to end the job."""
    multiprocessing = sys.modules.get("multiprocessing")
    left = [child for child in multiprocessing.active_children() if child.daemon] if multiprocessing else []
    if not left:
        return
    import signal

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # torch's handler raises for a worker killed: here on purpose
    for child in left:
        child.kill()
    for child in left:
        child.join(5)


def _status(code: int | str | None) -> int:
    """sys.exit's `code` as the exit status, its message printed as the interpreter does."""
    if code is None or isinstance(code, int):
        return code or 0
    try:
        print(code, file=sys.stderr)  # sys.exit("message")
    except (AttributeError, OSError, ValueError):
        pass
    return 1


def flush_and_exit(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):  # no stream, or a closed pipe (hvdtrain runs | head)
            pass
    os._exit(status)


def _mpi4py_finalizes_at_teardown() -> bool:
    """MPI started by mpi4py (a user's module imported it; Horovod then leaves MPI to it) is finalized
    in the interpreter's teardown, not by an exit handler: without it mpirun reports the rank as failed."""
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized()
    except Exception:  # noqa: BLE001 - a broken MPI: the interpreter's own way out
        return True
