"""A stall timeout for every engine of several processes: a collective that waits too long ends the
job, saying where every rank was.

Each rank records where it is (`Activity`, updated by the engine at every collective and by the loop
at every phase of a step). When a rank has waited in one collective for longer than the timeout, rank
0 asks every rank for its stacks over the report channel (`whereabouts`), prints who was not there and
where, and exits; the launcher then stops the others. Without that channel (elastic training, or a rank
that could not reach rank 0), a background thread publishes each rank's Activity to a key-value store
the job already runs (horovodrun's Gloo rendezvous; the torch engine's process-group store) and the
rank that waited names from there the ranks not in its collective.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import urllib.request
from typing import Any, Callable, Protocol

from hvdtrain.engine.activity import Activity, allowed_wait, stall_line
from hvdtrain.engine.report_channel import end_process

_SCOPE = "hvdtrain-activity"
# A rank that is not the one to report waits this long before it exits itself, so
# that the reporting rank's line is out before the launcher stops everyone.
_GRACE_SECONDS = 5.0
# How long stopping waits for the thread: it is back at once unless a store call is stuck on a rank
# that is gone (a failing job, which ends non-zero anyway and must not wait for it).
_STOP_SECONDS = 2.0


class KeyValueBoard:
    """Every rank's latest Activity, on horovodrun's rendezvous server (HTTP PUT and GET)."""

    def __init__(self, address: str, port: str):
        self.url = f"http://{address}:{port}/{_SCOPE}"
        # The server is horovodrun's own, on the cluster's network: never through a proxy.
        self._open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

    @classmethod
    def from_environment(cls) -> "KeyValueBoard | None":
        address, port = os.environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR"), os.environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT")
        return cls(address, port) if address and port else None

    def publish(self, rank: int, activity: Activity) -> None:
        body = activity.to_json().encode()
        request = urllib.request.Request(f"{self.url}/{rank}", data=body, method="PUT")
        self._open(request, timeout=5).close()

    def read(self, rank: int) -> Activity | None:
        try:
            with self._open(f"{self.url}/{rank}", timeout=5) as response:
                return Activity.from_json(response.read())
        except OSError:  # never published, or the server is gone
            return None


class Board(Protocol):
    """Where ranks publish their Activity and read each other's."""

    def publish(self, rank: int, activity: Activity) -> None: ...

    def read(self, rank: int) -> Activity | None: ...


class _StoppedTime:
    """Seconds this process was stopped (SIGSTOP or Ctrl-Z; Slurm's `scontrol suspend` stops every
    task of a job alike) while in the current collective: not a wait for another rank, and not a stall
    once the job is continued. Told by the watchdog's waits between passes: one that ends more than a
    second late was not run for the difference."""

    def __init__(self) -> None:
        self._since, self._seconds = None, 0.0

    def within(self, activity: Activity, late: float) -> float:
        """Called once per pass, with how late its wait ended: the stopped seconds since `activity`'s
        collective began."""
        if activity.since != self._since:
            self._since, self._seconds = activity.since, 0.0
        if late > 1.0 and activity.collective is not None:
            self._seconds += min(late, max(0.0, time.time() - activity.since - self._seconds))
        return self._seconds


class StallWatchdog:
    """Ends the process when its collective has waited `timeout` seconds, naming the laggards."""

    def __init__(self, activity: Activity, board: Board | None, timeout: float,
                 rank: Callable[[], int], size: Callable[[], int], whereabouts: Any = None):
        self.activity, self.board, self.timeout = activity, board, timeout
        self.rank, self.size, self.whereabouts = rank, size, whereabouts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="hvdtrain-stall-watchdog", daemon=True)

    def start(self) -> "StallWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread and waits for it: a thread still inside a C++ call (a store's) when the
        interpreter exits is ended by a forced unwind, which C++ turns into `terminate` (SIGABRT)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=_STOP_SECONDS)

    def _watch(self) -> None:
        interval = max(0.2, min(2.0, self.timeout / 5))
        published = None
        stopped = _StoppedTime()
        while True:
            began = time.monotonic()
            if self._stop.wait(interval):
                return
            late = time.monotonic() - began - interval  # of the wait alone, not of a store call that blocked
            try:
                rank = self.rank()
            except ValueError:  # Horovod shut down (or is re-initialising in elastic training)
                continue
            # One copy per pass: the training thread changes the live one meanwhile.
            current = self.activity.snapshot()
            if self.board is not None and current != published:
                with contextlib.suppress(OSError, RuntimeError):  # the store is unreachable: next pass
                    self.board.publish(rank, current)
                    published = current
            waited = time.time() - current.since - stopped.within(current, late)
            if current.collective is not None and waited > allowed_wait(current.where, self.timeout):
                self._stalled(rank, current)

    def _stalled(self, rank: int, mine: Activity) -> None:
        if self.whereabouts is not None and self.whereabouts.report_stall(rank, mine, self.timeout):
            time.sleep(_GRACE_SECONDS)  # rank 0 reports and leaves; the launcher stops this rank meanwhile
            end_process(1)
        now = time.time()
        board = self.board
        others = {other: board.read(other) if board else None for other in range(self.size()) if other != rank}
        missing = [f"rank {r} ({a.describe() if a else 'never reported'})" for r, a in others.items()
                   if a is None or (a.collective, a.where) != (mine.collective, mine.where)]
        if any(r < rank and a and a.collective and now - a.since > allowed_wait(a.where, self.timeout)
               for r, a in others.items()):
            time.sleep(_GRACE_SECONDS)  # a lower rank is stalled too and reports; give it time
        sys.stderr.write(stall_line(rank, mine, self.timeout, missing) + "\n")
        sys.stderr.flush()
        end_process(1)  # the training thread is blocked inside a collective; nothing else would end it
