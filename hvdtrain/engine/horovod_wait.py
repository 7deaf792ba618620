"""Horovod's wait for a collective, with the core given back while it lasts.

Every blocking Horovod call (`synchronize`, hence `allreduce`, `broadcast`, `barrier`, the optimizer's
gradients) ends in its extension's `wait_and_clear`, which polls in a loop of `sched_yield`: a rank
waiting for a slower one keeps a whole core busy for as long as the wait lasts. On a host whose cores
also compute (CPU training, more ranks than cores, a GPU node's data-loader workers) that core is taken
from the very rank, or worker, being waited for. Here the wait polls briefly, as Horovod does, then
sleeps between polls for a share of the time waited so far: a short wait ends as soon, a long one
costs a few percent of a core instead of all of it.

Only where the ranks train on CPUs, where it was measured (BENCHMARKS.md): on a GPU, where each step's
last gradients can arrive tens of milliseconds after backward, a sleep's lateness (up to 1/32 of the
wait) would be paid on every step, and Horovod's own wait is kept. Horovod's wait ran Python's signal
handlers only once the collective had finished; here one that raises (a KeyboardInterrupt outside fit's
own handlers) ends the wait before it has, leaving the collective behind (the command then ends).
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

# Waits shorter than this poll without sleeping, as Horovod does: a small collective takes a cycle or
# two of its background thread (1 ms each), and a caller woken late would miss the next cycle.
SPIN_SECONDS = 5e-3
# Then each sleep is this share of the time waited so far (a wait ends at most about this much late),
# and at most 1 ms (which costs about 5% of a core in wake-ups).
NAP_SHARE = 1 / 32
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
            time.sleep(min(LONGEST_NAP_SECONDS, waited * NAP_SHARE))


def wait_politely_in(mpi_lib: Any, polite: bool) -> None:
    """Sets the extension's `wait_and_clear` to the polite wait (`polite`) or back to Horovod's own. The
    polite one ends in Horovod's, which returns at once for a finished collective and raises its error
    as it always has."""
    current = mpi_lib.horovod_torch_wait_and_clear
    own = getattr(current, "horovods_own", current)
    if not polite:
        mpi_lib.horovod_torch_wait_and_clear = own
        return
    if own is not current:
        return
    poll = mpi_lib.horovod_torch_poll

    def wait_and_clear(handle: int) -> None:
        wait_politely(lambda: poll(handle) != 0)
        own(handle)

    wait_and_clear.horovods_own = own  # type: ignore[attr-defined]
    mpi_lib.horovod_torch_wait_and_clear = wait_and_clear
