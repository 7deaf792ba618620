"""A stop signal that arrives while `fit` is still starting: Slurm's --signal (SIGUSR1 in
launch/slurm.sbatch) can come within seconds of the start, before the imports, the engine and the
set-up are done, and its default action would kill the rank: a requeue script would see a failure
instead of a stop. `hold` notes SIGUSR1 from the first moment; `stop_policy.StopSignals` takes the
note over and stops at the first step with a checkpoint. SIGTERM and SIGINT keep their defaults
while starting: a launcher ending a job that failed to start, or Ctrl-C, ends it at once (there is
nothing to save yet). Once training has ended well, `ignore_after_training` ignores SIGUSR1 until
the exit: the same --signal can come while the engine shuts down, with nothing left to stop. Imports
nothing heavy: it runs before torch is imported.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

HELD = (signal.SIGUSR1,)
# A repeat within this many seconds is the same delivery reaching the process twice; a later one
# insists, and acts as its default would.
SAME_DELIVERY_SECONDS = 2.0

_noted: list[tuple[int, float]] = []  # (signal, time.monotonic())
_original: dict[int, Any] = {}
_command_process = False  # the `hvdtrain` command's own process: it ends when fit does
_holding = False  # between `hold` and `restore`: someone gives the signals back
_ignored: set[int] = set()  # by `ignore_after_training`
_unserved: list[int] = []  # noted by a fit that then failed (`note_unserved`)


def in_the_command_s_process() -> None:
    """Said by the `hvdtrain` entry point (not by a call from Python, whose process goes on): `restore`
    keeps the signals as fit left them, up to the process's end."""
    global _command_process
    _command_process = True


def in_the_command() -> bool:
    """Whether this is the `hvdtrain` command's own process, which ends when its command does."""
    return _command_process


def hold() -> None:
    """Notes HELD signals instead of dying on them, until `take_over` or `restore`. Once is enough:
    the command holds them at its first line, and fit holds them again for a call from Python."""
    global _holding
    if _holding or threading.current_thread() is not threading.main_thread():
        return
    _holding = True
    for number in HELD:
        _original[number] = signal.signal(number, _note)


def take_over(wanted: set[int]) -> tuple[int | None, dict[int, Any]]:
    """For StopSignals, once its own handlers for `wanted` are in place (so no signal falls between
    the two): the first held signal noted that is wanted, and the handlers there were before `hold`
    (to put back at the end). A held signal that is not wanted gets its handler back, and one noted
    acts now as it would have when it came."""
    originals = dict(_original)
    for number, handler in _original.items():
        if number not in wanted:
            signal.signal(number, handler)
    _original.clear()
    noted, _noted[:] = [number for number, _ in _noted], []
    for number in noted:
        if number not in wanted:
            signal.raise_signal(number)
    return next((number for number in noted if number in wanted), None), originals


def ignore_after_training(handlers: dict[int, Any]) -> None:
    """Training ended well: the HELD signals in `handlers` are ignored until `restore` puts these
    handlers (what there was before fit) back. SIG_IGN, not a Python handler: Python resets its own
    handlers to the default while the interpreter ends, and the signal may come then. Nothing without
    `hold` first (a direct call of train.fit.fit: nobody would restore them)."""
    if not _holding:
        return
    for number, handler in handlers.items():
        if number in HELD:
            _original[number] = handler
            _ignored.add(number)
            signal.signal(number, signal.SIG_IGN)


def restore() -> None:
    """Gives the signals back as fit ends: if StopSignals did not take them over (fit ended before
    training), or after training (the Python API: the process goes on). In the command's process the
    signals ignored after training stay ignored: its end may still be signalled (and it starts no
    child to inherit SIG_IGN)."""
    global _holding
    kept = _ignored if _command_process else set()
    for number, handler in _original.items():
        if number not in kept:
            signal.signal(number, handler)
    _original.clear()
    _noted.clear()
    _ignored.clear()
    _holding = False


def note_unserved(number: int) -> None:
    """A stop signal fit noted but did not act on, as it failed first: most often the launcher's SIGTERM
    to the rest once another rank left with the same failure. `take_unserved` hands it to the wait for
    rank 0's word, which acts on it as if it came then. Only in the command's process: one that goes on
    (the Python API) has its failure raised to it."""
    if _command_process:
        _unserved.append(number)


def take_unserved() -> list[int]:
    """The signals `note_unserved` kept, forgotten here."""
    taken, _unserved[:] = list(_unserved), []
    return taken


def _note(number: int, frame: Any) -> None:
    now = time.monotonic()
    if any(number == noted and now - at >= SAME_DELIVERY_SECONDS for noted, at in _noted):
        signal.signal(number, _original.get(number, signal.SIG_DFL))  # insisting: as if never held
        signal.raise_signal(number)
        return
    _noted.append((number, now))
