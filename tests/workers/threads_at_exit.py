"""`hvdtrain fit` as the command runs it, reporting at exit which threads are still alive.

    torchrun --nproc-per-node 2 tests/workers/threads_at_exit.py FIT_ARGS...

A thread left inside a C++ call (the process group's store) while the interpreter exits is
ended by a forced unwind that C++ turns into `terminate`: the rank dies of SIGABRT after a
finished run. At exit only the main thread may be left.
"""

import atexit
import os
import sys
import threading

from hvdtrain.cli import main


def _report() -> None:
    names = [thread.name for thread in threading.enumerate()]
    sys.stderr.write(f"rank {os.environ.get('RANK', os.environ.get('OMPI_COMM_WORLD_RANK'))} threads at exit: "
                     f"{','.join(names)}\n")
    sys.stderr.flush()


atexit.register(_report)
main(sys.argv[1:])
