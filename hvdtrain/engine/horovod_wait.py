"""Horovod's wait for a collective, with the core given back while it lasts.

Every blocking Horovod call (`synchronize`, hence `allreduce`, `broadcast`, `barrier`, the optimizer's
gradients) ends in its extension's `wait_and_clear`, which polls in a loop of `sched_yield`: a rank
waiting for a slower one keeps a whole core busy for as long as the wait lasts. On a host whose cores
also compute (CPU training, more ranks than cores, a GPU node's data-loader workers) that core is taken
from the very rank, or worker, being waited for. Here the wait polls briefly, as Horovod does, then
sleeps between polls for a share of the time waited so far: a short wait ends as soon, a long one
costs a few percent of a core instead of all of it.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

# Waits shorter than this poll without sleeping, as Horovod does: a small collective takes a cycle or
# two of its background thread (1 ms each), and a caller woken late would miss the next cycle.
SPIN_SECONDS = 5e-3
# Then each sleep is this share of the time waited so far (a wait ends at most about this much late),
# within these bounds (a sleep of 1 ms costs about 5% of a core in wake-ups).
NAP_SHARE = 1 / 32
SHORTEST_NAP_SECONDS = 50e-6
LONGEST_NAP_SECONDS = 1e-3


def wait_politely(done: Callable[[], bool]) -> None:
    """Returns once `done()` is true: polled without sleeping for SPIN_SECONDS, then between sleeps."""
    if done():
        return
    started = time.perf_counter()
    while not done():
        waited = time.perf_counter() - started
        if waited < SPIN_SECONDS:
            os.sched_yield()
        else:
            time.sleep(min(LONGEST_NAP_SECONDS, max(SHORTEST_NAP_SECONDS, waited * NAP_SHARE)))


def give_the_core_back_while_waiting(mpi_lib: Any) -> None:
    """Replaces the extension's `wait_and_clear` (once per process) with a polite wait, then Horovod's own,
    which returns at once for a finished collective and raises its error as it always has."""
    busy_wait = mpi_lib.horovod_torch_wait_and_clear
    if getattr(busy_wait, "polite", False):
        return
    poll = mpi_lib.horovod_torch_poll

    def wait_and_clear(handle: int) -> None:
        wait_politely(lambda: poll(handle) != 0)
        busy_wait(handle)

    wait_and_clear.polite = True  # type: ignore[attr-defined]
    mpi_lib.horovod_torch_wait_and_clear = wait_and_clear
