"""`hvdtrain fit` as the command runs it, reporting at exit which threads are still alive.

    torchrun --nproc-per-node 2 tests/workers/threads_at_exit.py FIT_ARGS...

A thread left inside a C++ call (the process group's store) while the interpreter exits is
ended by a forced unwind that C++ turns into `terminate`: the rank dies of SIGABRT after a
finished run. At exit only the main thread may be left. The command leaves with os._exit after the
exit handlers, past the interpreter's teardown, so the report is made at both: the exit handlers' (a
user's handler must run under every engine) and os._exit's.
"""

import atexit
import os
import sys
import threading

from hvdtrain.cli import main


def _report(how: str = "its exit handlers") -> None:
    names = [thread.name for thread in threading.enumerate()]
    sys.stderr.write(f"rank {os.environ.get('RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))} threads at {how}: "
                     f"{','.join(names)}\n")
    sys.stderr.flush()


def _reporting_exit(code: int, _exit=os._exit) -> None:
    atexit.unregister(_report)
    _report("os._exit")
    _exit(code)


atexit.register(_report)
os._exit = _reporting_exit
main(sys.argv[1:])
