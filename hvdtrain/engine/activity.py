"""Where this rank is and where its time goes: written by the training thread at every phase and
collective (a few attribute writes per step), read by the stall watchdog, by a report of every rank's
whereabouts (`engine.whereabouts`) and, once per epoch, by the straggler check (`train.stragglers`)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Iterator

SET_UP = "set-up"
"""Where a rank is from its start to its first training step."""
SET_UP_SECONDS = 60.0
"""The least a collective of set-up waits before it is a stall, whatever train.stall_timeout says: ranks
import, read their data and build the model at their own pace (a cold shared file system, a busy host),
far less evenly than they take steps."""
MADE_IN_TURN = "data_first"
"""The set-up phase where the other ranks wait while rank 0, then each other host's first rank, makes the
data (Engine.made_in_turn)."""
DATA_LOADING = "data loading"
"""The phase a rank waits for its next training batch in; its time is the straggler check's `data`."""
COMPUTE = ("batch to device", "forward", "backward", "the optimizer step")
"""The phases of a training step whose time outside collectives is the straggler check's `compute`; the
rest (a checkpoint write, logging, a callback: work rank 0 may do alone) is `other`, not held against a rank."""


@dataclass
class Activity:
    """Where this rank is; written by the training thread, read by the watchdog and the reports."""

    where: str = SET_UP
    collective: str | None = None
    """The collective this rank waits in, or None while it computes."""
    since: float = 0.0
    """time.time() when `collective` began (wall clock: compared across hosts)."""
    phase: str = SET_UP
    """What the training thread does outside collectives: data loading, forward, backward, the optimizer
    step, evaluation, a checkpoint write, a callback."""
    phase_since: float = field(default_factory=time.time, compare=False)
    """time.time() when `phase` began."""
    spent: dict[str, float] = field(default_factory=dict, compare=False)
    """Seconds spent in each phase so far (perf_counter), waits in collectives included."""
    waited: float = field(default=0.0, compare=False)
    """Seconds spent waiting in collectives so far."""
    waited_in: dict[str, float] = field(default_factory=dict, compare=False)
    """Of those, the seconds spent in each phase."""
    _entered: float = field(default_factory=time.perf_counter, compare=False, repr=False)

    def at(self, where: str) -> None:
        self.where = where

    def enter(self, phase: str) -> str:
        """The training thread begins `phase`; the time since the last one goes to that one, which is returned."""
        now, left = time.perf_counter(), self.phase
        self.spent[left] = self.spent.get(left, 0.0) + now - self._entered
        self.phase, self._entered, self.phase_since = phase, now, time.time()
        return left

    def clock(self) -> tuple[float, float, float, float]:
        """(data loading, computing, waiting in collectives, now) in seconds of perf_counter: differences of
        two readings are where an epoch's time went. Data loading and computing leave out their waits."""
        now = time.perf_counter()

        def outside_collectives(phase: str) -> float:
            spent = self.spent.get(phase, 0.0) + (now - self._entered if self.phase == phase else 0.0)
            return spent - self.waited_in.get(phase, 0.0)

        return outside_collectives(DATA_LOADING), sum(map(outside_collectives, COMPUTE)), self.waited, now

    @contextlib.contextmanager
    def waiting(self, collective: str) -> Iterator[None]:
        self.collective, self.since = collective, time.time()
        began, phase = time.perf_counter(), self.phase
        try:
            yield
        finally:
            self.collective = None
            waited = time.perf_counter() - began
            self.waited += waited
            self.waited_in[phase] = self.waited_in.get(phase, 0.0) + waited

    def snapshot(self) -> "Activity":
        """A copy, as one pass of a reader sees it (the training thread changes the live one meanwhile)."""
        return Activity(self.where, self.collective, self.since, self.phase, self.phase_since, dict(self.spent),
                        self.waited, dict(self.waited_in))

    def to_json(self) -> str:
        """As published on a board: where it is, not its clocks."""
        return json.dumps({key: value for key, value in asdict(self).items() if key in _PUBLISHED})

    @classmethod
    def from_json(cls, text: str | bytes) -> "Activity":
        return cls(**{key: value for key, value in json.loads(text).items() if key in _PUBLISHED})

    def describe(self) -> str:
        if self.collective is None:
            return in_phase(self.phase, self.where)
        return f"in {self.collective} at {self.where} for {time.time() - self.since:.0f} s"


def in_phase(phase: str, where: str) -> str:
    """`in evaluation at epoch 2`: where a rank is outside collectives, its phase said once (`where`
    reads `epoch 2, evaluation`, and `set-up` at first, for the collectives' reports)."""
    where = where.removesuffix(f", {phase}")
    return f"in {phase}" if where == phase else f"in {phase} at {where}"


_PUBLISHED = ("where", "collective", "since", "phase", "phase_since")


def allowed_wait(where: str, timeout: float) -> float:
    """Seconds a collective at `where` may wait before it is a stall: `timeout` (train.stall_timeout),
    and SET_UP_SECONDS at least in set-up."""
    return max(timeout, SET_UP_SECONDS) if where == SET_UP else timeout


def stall_line(rank: int, mine: Activity, timeout: float, missing: list[str]) -> str:
    """The stall's error line, as the watchdog and the whereabouts report say it: the rank that waited
    where, the ranks `missing` there (described), and what to do about it."""
    absent = ", ".join(missing) or "none: every rank waits here, so one of them has not reached its part of it"
    return (f"hvdtrain: error: the job stalled: rank {rank} waited {time.time() - mine.since:.0f} s in "
            f"{mine.collective} at {mine.where} ({wait_rule(mine.where, timeout)}); not there: {absent}. "
            f"{_stall_advice(mine.collective)}")


def _stall_advice(collective: str | None) -> str:
    """The stall line's last words: what to do about it."""
    if collective and f"agree.{MADE_IN_TURN}." in collective:
        return ("The others wait while rank 0, then each other host's first rank, makes the data (a download, a "
                "cache): fetch it before the job, or raise train.stall_timeout; a factory that waits for the other "
                "ranks itself (a barrier) needs --set data.in_turn=false")
    return "Every rank must run the same collectives; raise train.stall_timeout if a step can take that long"


def wait_rule(where: str, timeout: float) -> str:
    """The stall report's words for `allowed_wait`."""
    return f"train.stall_timeout {timeout:g} s" + (f", {SET_UP_SECONDS:g} s at least in set-up"
                                                   if allowed_wait(where, timeout) > timeout else "")
