"""A rank whose collective broke off because another rank failed or left: no second failure. It says
only where the job stood (rank 0), waits for the launcher to end it, and exits ANOTHER_RANK_FAILED: the
command's survivors, and a script's that leaves fit's AnotherRankFailed uncaught (cli/script_exit.py)."""

from __future__ import annotations

import signal
import sys
import time
import traceback
from typing import NoReturn

from hvdtrain.engine.environment import env_rendezvous_launched
from hvdtrain.errors import ANOTHER_RANK_FAILED, AnotherRankFailed

# dist: how long a rank whose collective broke off waits for the launcher to end it. The failed rank's
# exit then comes first, and Open MPI's mpirun names the first rank to exit; hvdtrain's horovodrun and
# torchrun end the others as soon as it has, so the wait costs nothing where a rank did fail. Under their
# 5 s from SIGTERM to SIGKILL: a launcher's SIGTERM that came while this rank was still in the collective
# (noted as a stop signal, not ending the wait) must not let SIGKILL name the survivor as the failure.
SURVIVOR_WAIT_SECONDS = 3.0
# A launcher's end for the ranks still running once one failed (Open MPI, torchrun, horovodrun).
_LAUNCHER_STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def leave_after_another_rank(err: Exception, rank: int, debug: bool) -> NoReturn:
    """This rank's collective broke off because another rank failed or left (or Horovod's stall inspector
    ended the job): not this rank's failure. Rank 0 says where the job stood, as a note; then each such
    rank waits for the launcher to end it and exits with ANOTHER_RANK_FAILED."""
    if debug:
        traceback.print_exc()
    note_and_wait(AnotherRankFailed.of(err), rank)
    sys.exit(ANOTHER_RANK_FAILED)


def note_and_wait(failed: AnotherRankFailed, rank: int) -> None:
    """Rank 0's note on where the job stood, then the wait for the launcher to end this rank."""
    if rank == 0:  # dist: one note, from the rank that holds the run directory
        print(f"hvdtrain: {failed}", file=sys.stderr, flush=True)
    elif env_rendezvous_launched():  # no launcher names the rank that left, and each rank's log is its own (a pod's)
        print(f"hvdtrain: rank {rank}: {failed}", file=sys.stderr, flush=True)
    _wait_for_the_launcher(SURVIVOR_WAIT_SECONDS)


class _Ended(Exception):
    """The launcher's signal came: the wait is over."""


def _wait_for_the_launcher(seconds: float) -> None:
    def ended(number: int, frame: object) -> None:
        raise _Ended

    for number in _LAUNCHER_STOPS:
        signal.signal(number, ended)
    try:
        time.sleep(seconds)
    except _Ended:
        pass
    for number in _LAUNCHER_STOPS:  # a second one ends the exit's own clean-up, as it would any process
        signal.signal(number, signal.SIG_DFL)
