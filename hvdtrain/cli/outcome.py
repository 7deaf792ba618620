"""A launcher's exit status and its one line, from its workers' exits: the worker that failed first
named, not one that stopped because its collective broke off or that the launcher ended after it;
nothing for a clean stop on a signal with a checkpoint; a stop the launcher passed on, said as such."""

from __future__ import annotations

import signal
from typing import Any, Iterable

from hvdtrain.cli import forwarding

STOPPED = 75  # every rank stopped on a signal with a checkpoint (hvdtrain.errors.StoppedBySignal)
ANOTHER_RANK_FAILED = 76  # dist: a rank whose collective broke off as another failed (hvdtrain.errors)


def outcome(failures: dict[Any, tuple[int, float]], worker: str = "worker") -> tuple[int, str | None]:
    """The launcher's exit status and its line, from the failed workers' (exit code, time) by rank.

    A rank that stopped (75) did so after every rank had saved and met: a signal the launcher then sent
    to a rank still on its way out cuts nothing short, and is not named. Else the worker that failed
    first, by how it ended: one killed by a signal (SIGKILL, out of memory) before the others, whose
    own errors follow from it (their peer went away); then one that exited with an error of its own;
    then one whose collective broke off (76), a consequence; SIGTERM last of all, which the launcher
    sends to the rest once one failed, and the signal it passed on. Where every worker ended by that
    signal, the job was stopped, not failed. Among equals, the first to end. The status is that worker's
    (128 + N for signal N, as a shell says it)."""
    codes = {rank: code for rank, (code, _) in failures.items()}
    if STOPPED in codes.values():
        return STOPPED, None
    passed_on = forwarding.passed_on()
    for number in passed_on:  # predict, a script: no stop of their own
        if _ended_by(codes.values(), number, passed_on):
            return 128 + number, f"stopped by {signal.Signals(number).name}, which it passed on to the workers"
    rank = min(codes, key=lambda r: (_consequence(codes[r], passed_on), failures[r][1], r))
    code = codes[rank]
    return code if code >= 0 else 128 - code, \
        f"{worker} {rank} {_describe_exit(code)}; the other workers were stopped"


def _ended_by(codes: Iterable[int], number: int, passed_on: list[int]) -> bool:
    """Some worker ended by the signal `number` the launcher passed on (by its default action, or by
    exiting with 128 + number, as for Ctrl-C), and every other by a signal it passed on, by the launcher's
    SIGTERM to the rest after the first, or as its collective broke off (76) when a peer left."""
    def ended_by(code: int, numbers: Iterable[int]) -> bool:
        return any(code in (128 + n, -n) for n in numbers)

    codes = list(codes)
    return any(ended_by(code, [number]) for code in codes) and all(
        ended_by(code, [*passed_on, signal.SIGTERM]) or code == ANOTHER_RANK_FAILED for code in codes)


def _consequence(code: int, passed_on: Iterable[int] = ()) -> int:
    """How far an exit status is from the job's first failure: 0 for a death by a signal other than
    SIGTERM, 1 for an error of its own, 2 for a broken-off collective, 3 for SIGTERM or a signal the
    launcher passed on."""
    if any(code in (-number, 128 + number) for number in (signal.SIGTERM, *passed_on)):
        return 3
    if code == ANOTHER_RANK_FAILED:
        return 2
    return 0 if code < 0 or code > 128 else 1


def _describe_exit(code: int) -> str:
    """`exited with status 2`, or the signal that a shell's 128+N status (or a negative one) stands for,
    with the status a shell gives it: the launcher's own."""
    if code == ANOTHER_RANK_FAILED:
        return f"stopped because another rank failed or left (exit status {code})"
    number = code - 128 if code > 128 else -code if code < 0 else 0
    if number:
        try:
            return f"was killed by {signal.Signals(number).name} (exit status {128 + number})"
        except ValueError:
            pass
    return f"exited with status {code}"
