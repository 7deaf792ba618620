"""PID 1 of a container that runs ranks: a Kubernetes pod, an MPIJob's launcher or worker.

    python -m hvdtrain.cli.pod /usr/sbin/sshd -De                     # an MPIJob worker
    python -m hvdtrain.cli.pod mpirun -np 8 hvdtrain fit --resume auto  # its launcher, or a pod of its own

Kubernetes ends a pod (eviction, preemption, deletion, a node drain) with SIGTERM to PID 1 only,
then SIGKILL after terminationGracePeriodSeconds. As PID 1, sshd or mpirun would pass nothing on
to the ranks (sshd exits; mpirun ends them itself), so everything since the last checkpoint would be
lost. This entry runs the command as its child and passes a stop signal to the hvdtrain ranks
among its descendants, which stop together at one step with a checkpoint (exit 75). With no rank
in the pod (an MPIJob's launcher) it sends mpirun SIGUSR1, which Open MPI passes on to every rank.
Once those ranks have stopped, the command gets the signal too (sshd would never end by itself);
it exits with the command's status and reaps orphans as PID 1 must.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from hvdtrain.cli.forwarding import FORWARDED, forward_to_ranks, launch_begins, ranks_below

POLL_SECONDS = 0.2
COMMAND_GRACE_SECONDS = 5.0


def main(argv: list[str] | None = None) -> None:
    command = list(sys.argv[1:] if argv is None else argv) or ["/usr/sbin/sshd", "-De"]
    pending: list[int] = []  # signals passed on to ranks; the command itself follows once they are gone
    child: subprocess.Popen | None = None

    def pass_on(number: int, frame: object = None) -> None:
        if child is None:  # before the command started: for it, once it has
            pending.append(number)
        elif ranks_below():
            forward_to_ranks(number)
            pending.append(number)
        elif os.path.basename(command[0]) in ("mpirun", "mpiexec", "orterun", "prterun"):
            child.send_signal(signal.SIGUSR1)  # Open MPI passes SIGUSR1 on to the ranks; SIGTERM it acts on
        else:
            child.send_signal(number)

    # Before the command starts: as PID 1, a signal without a handler is lost. A pod has no terminal to
    # close, and SIGHUP there means "reload" (sshd's restarts itself on it instead of ending).
    for number in set(FORWARDED) - {signal.SIGHUP}:
        signal.signal(number, pass_on)
    launch_begins()  # the command is the job: a signal no rank took goes to it
    child = subprocess.Popen(command)
    if pending:
        pass_on(pending.pop())
    code, ranks_gone = None, None
    while code is None:
        time.sleep(POLL_SECONDS)
        code = _reap(child.pid) if os.getpid() == 1 else child.poll()
        if code is None and pending and not ranks_below():
            ranks_gone = ranks_gone or time.monotonic()
            # The ranks have stopped and the command is still there: it would never end by itself
            # (sshd; mpirun ends a moment after its ranks and keeps their status): it follows them.
            if time.monotonic() - ranks_gone > COMMAND_GRACE_SECONDS:
                child.send_signal(pending.pop())
                pending.clear()
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
