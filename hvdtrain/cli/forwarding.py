"""Passing a stop signal from a launcher on to its ranks: the `horovodrun` and `torchrun` entries
(`launchers`) and a pod's PID 1 (`pod`). SIGTERM, SIGINT, SIGHUP, SIGUSR1 and SIGUSR2 (a scheduler's,
a user's kill or Ctrl-C, the terminal closed) go to the rank processes below, which stop together at one step with a
checkpoint; not to mpirun (which would end them itself), the shells around them or their
data-loader workers.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Callable

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
# What a rank notes from its first moment instead of dying (hvdtrain.train.early_signals.HELD).
HELD_BY_STARTING_RANKS = (signal.SIGUSR1,)
RANKS_START_SECONDS = 30.0
# A process with one of these is a rank (or a rank's own worker process, which inherits them).
RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "TORCHELASTIC_RUN_ID")
_waiting: set[int] = set()  # held signals a thread passes on once the ranks hold them
_launch_begun = False  # the launcher proper runs (it may start and end children of its own)
_nothing_started: Callable[[int], None] | None = None  # the launcher's own end on a stop with nothing running
_ranks_reached = False  # a signal reached ranks here (they stop, then leave)
# How long a launcher whose ranks here are gone may take to end by itself before a signal reaches it.
LAUNCHER_ENDS_SECONDS = 10.0
_passed_on: list[int] = []  # the signals passed on to the job, in order


def launch_begins(nothing_started: Callable[[int], None] | None = None) -> None:
    """Said by a launcher entry as the job itself starts (torchrun's agent; horovodrun's mpirun or first
    worker, after its probes): from here its children are the job's, and get a stop signal no rank here
    took. One while it runs nothing (torchrun waiting for other nodes) is `nothing_started(number)`
    (torchrun's agent: its own exception, which ends what it started), else the signal's default:
    swallowed, it left the launcher waiting, or training once its ranks came."""
    global _launch_begun, _nothing_started
    _launch_begun, _nothing_started = True, nothing_started


def launch_has_begun() -> bool:
    return _launch_begun


def passed_on() -> list[int]:
    """The signals this launcher passed on to the job (a user's Ctrl-C, a scheduler's SIGTERM), first first."""
    return list(dict.fromkeys(_passed_on))


def forward_to_ranks(number: int, frame: object = None) -> None:
    """Sends the signal to every rank below this launcher (not to mpirun, which would end them
    itself, nor to shells around them or to their data-loader workers). With no rank of its own
    here (all on other hosts) it goes to the launcher's own children (mpirun, ssh), which end
    theirs: never swallowed. A scheduler's warning (SIGUSR1) waits until the ranks here hold it:
    one that came before the ranks started, or while one was still starting (its default would
    kill it), stops them at the first step like a later one. A repeat while it waits is the same."""
    if number in HELD_BY_STARTING_RANKS:
        ranks = ranks_below()
        if not _all_settled(ranks, number):
            if number not in _waiting:
                _waiting.add(number)
                threading.Thread(target=_forward_once_held, args=(number,), daemon=True).start()
            return
        _send(number, ranks)
        return
    _send(number, ranks_below())


def _send(number: int, ranks: list) -> None:
    """To `ranks`, else (none here) to the job's processes among this launcher's children; with neither,
    the launcher ends (`launch_begins`)."""
    import psutil

    global _ranks_reached
    sent = False
    for process in ranks:
        try:
            process.send_signal(number)
            sent = True
        except psutil.Error:  # gone meanwhile
            pass
    if sent:
        _ranks_reached = True
        _passed_on.append(number)
        return
    children = psutil.Process().children()
    if _ranks_reached:
        if children:  # a second Ctrl-C after the ranks here stopped on the first
            threading.Thread(target=_send_unless_ended, args=(number, children), daemon=True).start()
        return
    if _launch_begun or number in HELD_BY_STARTING_RANKS:
        for process in children:  # the job's own (mpirun, ssh to other hosts): they end theirs
            try:
                process.send_signal(number)
                _passed_on.append(number)
            except psutil.Error:
                pass
        if children or number in HELD_BY_STARTING_RANKS:
            return
        if _nothing_started is not None:
            _nothing_started(number)
            return
    # Nothing of the job's runs yet (a launcher's probes, such as `mpirun --version`, are no part of it: told,
    # one died of it and the launcher said MPI was missing, or the stop was lost): the signal's default.
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


def _send_unless_ended(number: int, children: list) -> None:
    """The ranks here stopped on an earlier signal and are gone: the launcher below (mpirun, ending the job
    after them) ends by itself, and Open MPI's mpirun, given SIGINT as it ends, crashes (a segmentation fault
    in PMIx_Finalize, exit 139, not the ranks' 75). It gets the signal only if it is still there after
    LAUNCHER_ENDS_SECONDS: stuck, or waiting for ranks on other hosts. Watched, not waited for: a wait
    would reap it, and the launcher entry waiting for its status would read 0."""
    deadline = time.monotonic() + LAUNCHER_ENDS_SECONDS
    while (running := [process for process in children if _running(process)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    for process in running:
        try:
            process.send_signal(number)
        except Exception:  # noqa: BLE001 - psutil.Error: gone meanwhile
            pass


def _running(process) -> bool:
    """Alive and not yet exited (an exited child stays a zombie until its parent reaps it)."""
    import psutil

    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _forward_once_held(number: int) -> None:
    """Polls until the ranks here hold the signal, then sends it to the ones it found holding it
    (one that starts later hears of the stop from them, at the first step). With no rank here after
    RANKS_START_SECONDS (all on other hosts), to the launcher's children; with ranks that still do
    not catch it then (a script that calls hvdtrain.fit late), to them as to any program."""
    deadline = time.monotonic() + RANKS_START_SECONDS
    ranks = ranks_below()
    while not _all_settled(ranks, number) and time.monotonic() < deadline:
        time.sleep(0.1)
        ranks = ranks_below()
    _waiting.discard(number)
    holding = [process for process in ranks if _handles(process.pid, number)]
    _send(number, holding or ranks)


def _all_settled(ranks: list, number: int) -> bool:
    """Whether there are ranks here and each catches the signal or ignores it (a rank whose training
    ended ignores a late warning): none dies of it."""
    return bool(ranks) and all(_handles(process.pid, number, or_ignores=True) for process in ranks)


def _handles(pid: int, number: int, or_ignores: bool = False) -> bool:
    """Whether the process has a handler for the signal (SigCgt in /proc), or ignores it (SigIgn);
    a process gone meanwhile counts as handling it (nothing to send it to)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    masks = {line.split(":")[0]: int(line.split()[1], 16) for line in status.splitlines()
             if line.startswith(("SigCgt:", "SigIgn:"))}
    bit = 1 << (number - 1)
    return bool(masks.get("SigCgt", 0) & bit or (or_ignores and masks.get("SigIgn", 0) & bit))


def take_signals() -> None:
    """The launcher entries' first step: a signal from here on is passed on (psutil loads first: a
    handler importing it while Horovod's runner is importing it would find it half loaded)."""
    import psutil  # noqa: F401

    for number in FORWARDED:
        if number != signal.SIGHUP or signal.getsignal(number) != signal.SIG_IGN:  # nohup's jobs outlive the terminal
            signal.signal(number, forward_to_ranks)


def tracker_outlives_a_hang_up() -> None:
    """Starts multiprocessing's resource tracker (Horovod's Gloo launch uses its semaphores) with SIGHUP
    blocked, as it stays there: in the terminal's process group, it died when the terminal closed while
    the ranks stopped, and its successor printed a KeyError traceback for each semaphore let go after. Blocked
    here meanwhile, not ignored: a hang-up in that moment waits, and is passed on after it."""
    from multiprocessing import resource_tracker

    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def ranks_below() -> list:
    """The rank processes among this process's descendants (psutil.Process), not their own
    data-loader workers."""
    import psutil

    me = psutil.Process()
    found = []
    for process in me.children(recursive=True):
        try:
            parent = process.parent()
            # A rank's own workers inherit its variables; the launcher may have them too (srun torchrun).
            if _is_rank(process) and (parent is None or parent.pid == me.pid or not _is_rank(parent)):
                found.append(process)
        except psutil.Error:  # gone meanwhile
            pass
    return found


def _is_rank(process) -> bool:
    import psutil

    try:
        # The interpreter, not the name: a rank started as the `hvdtrain` script is named after it.
        return os.path.basename(process.exe()).startswith("python") and \
            any(name in process.environ() for name in RANK_VARIABLES)
    except psutil.Error:
        return False
