"""How the `hvdtrain` command and the launcher entries end once their work is done: as the interpreter
would, without tearing it down. Freeing torch's modules takes about 0.4 s of a core, and 0.7 s once an
optimizer has loaded torch._dynamo: in every rank of every launch, for nothing. Imports nothing."""

from __future__ import annotations

import os
import sys


def leave_without_teardown(code: int | str | None) -> None:
    """Ends the process with sys.exit's `code`: the exit handlers run (Horovod's shutdown, MPI_Finalize,
    TensorBoard's and logging's flushes, data-loader workers ended) and the streams are flushed, then
    os._exit. Returns instead, leaving the interpreter's own way out, where a thread that is not a
    daemon (a user's) would still be waited for."""
    import atexit
    import threading

    if any(thread.is_alive() and not thread.daemon for thread in threading.enumerate()
           if thread is not threading.current_thread()):
        return
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)  # as the interpreter does for sys.exit("message")
        code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (hvdtrain runs | head): nothing more to say there
            pass
    os._exit(code or 0)
