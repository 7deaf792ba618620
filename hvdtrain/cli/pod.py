"""PID 1 of a container that runs ranks: a Kubernetes pod, an MPIJob's launcher or worker.

    python -m hvdtrain.cli.pod /usr/sbin/sshd -De                     # an MPIJob worker
    python -m hvdtrain.cli.pod mpirun -np 8 hvdtrain fit --resume auto  # its launcher, or a pod of its own

Kubernetes ends a pod (eviction, preemption, deletion, a node drain) with SIGTERM to PID 1 only,
then SIGKILL after terminationGracePeriodSeconds. As PID 1, sshd or mpirun would pass nothing on
to the ranks (sshd exits; mpirun ends them itself), so everything since the last checkpoint would be
lost. This entry runs the command as its child and passes a stop signal to the hvdtrain ranks
among its descendants, which stop together at one step with a checkpoint (exit 75). With no rank
in the pod (an MPIJob's launcher) it sends mpirun SIGUSR1, which Open MPI passes on to every rank.
It exits with the command's status once the ranks are gone, and reaps orphans as PID 1 must.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hvdtrain.cli.launchers import FORWARDED, forward_to_ranks, ranks_below

POLL_SECONDS = 0.2


def main(argv: list[str] | None = None) -> None:
    command = list(sys.argv[1:] if argv is None else argv) or ["/usr/sbin/sshd", "-De"]
    child = subprocess.Popen(command)

    def pass_on(number: int, frame: object = None) -> None:
        if ranks_below():
            forward_to_ranks(number)
        elif os.path.basename(command[0]) in ("mpirun", "mpiexec", "orterun", "prterun"):
            child.send_signal(signal.SIGUSR1)  # Open MPI passes SIGUSR1 on to the ranks; SIGTERM it acts on
        else:
            child.send_signal(number)

    for number in FORWARDED:
        signal.signal(number, pass_on)
    code = None
    while code is None:
        time.sleep(POLL_SECONDS)
        code = _reap(child.pid) if os.getpid() == 1 else child.poll()
    sys.exit(code if code >= 0 else 128 - code)


def _reap(pid: int) -> int | None:
    """As PID 1: waits for every exited process (orphans are this process's to reap); the exit
    code of `pid` once it is among them."""
    code = None
    try:
        while True:
            done, status = os.waitpid(-1, os.WNOHANG)
            if done == 0:
                return code
            if done == pid:
                code = os.waitstatus_to_exitcode(status)
    except ChildProcessError:
        return code


if __name__ == "__main__":
    main()
