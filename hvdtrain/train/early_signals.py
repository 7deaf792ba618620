"""Stop signals that arrive while `fit` is still starting: before the imports, the engine and the
set-up are done, SIGTERM or SIGUSR1 (Slurm's --signal can come within seconds of the start) would
kill a rank with its default action, and a requeue script would see a failure instead of a stop.
`hold` notes them from the first moment; `preemption.StopSignals` takes the note over and stops at
the first step with a checkpoint. Imports nothing heavy: it runs before torch is imported.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

HELD = (signal.SIGTERM, signal.SIGUSR1)  # SIGINT keeps Python's default: Ctrl-C while starting ends at once

_noted: list[int] = []
_previous: dict[int, Any] = {}


def hold() -> None:
    """Notes HELD signals instead of dying on them, until `release`."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in HELD:
        _previous[number] = signal.signal(number, _note)


def release(wanted: set[int]) -> int | None:
    """Gives the signals back; returns the first one noted that is `wanted` (a stop signal of the
    run). One noted that is not wanted acts now as it would have when it came."""
    for number, handler in _previous.items():
        signal.signal(number, handler)
    _previous.clear()
    noted, _noted[:] = list(_noted), []
    for number in noted:
        if number not in wanted:
            signal.raise_signal(number)
    return next((number for number in noted if number in wanted), None)


def restore() -> None:
    """Gives the signals back if `release` did not (fit ended before training), dropping any noted."""
    for number, handler in _previous.items():
        signal.signal(number, handler)
    _previous.clear()
    _noted.clear()


def _note(number: int, frame: Any) -> None:
    _noted.append(number)
