"""Horovod's Gloo launcher, watched by hvdtrain's `horovodrun` entry (cli/launchers.py): every worker's
exit status (Horovod reports only the first to exit), a worker that stopped on a signal with a
checkpoint counted as no failure, one Horovod had to kill after another failed counted as ended by
its SIGTERM, and the workers' stderr less what reads as a second failure."""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from typing import Any

from hvdtrain.cli import forwarding
from hvdtrain.cli.outcome import STOPPED

# After a rank stopped on a signal, how long the others have to finish their own way out of the stop.
STOPPED_GRACE_SECONDS = 30.0
# A worker's status through `sh` when Horovod's launcher ends it: SIGTERM, and SIGKILL 5 s later.
ENDED_BY_SIGTERM, KILLED = 128 + signal.SIGTERM, 128 + signal.SIGKILL


class GlooWorkers:
    """Horovod's Gloo launcher, watched: every worker's (exit code, time), which it collects but reports
    only the first to exit of; the workers' stderr, less a peer's report that another went away and
    the shells' word of the workers it ended."""

    def __init__(self, gloo_run) -> None:
        from horovod.runner.util import threads

        self.threads = threads
        self.exits: dict[int, tuple[int, float]] = {}  # by rank, once all have ended
        self.output = PeerGoneHeldBack(sys.stderr)
        self.commands = _StoppedIsNoFailure(gloo_run)
        gloo_run.threads = self  # launch_gloo's one call, below

    @property
    def stopped(self) -> bool:
        return bool(self.commands.stopped)

    def __getattr__(self, name: str) -> object:
        return getattr(self.threads, name)

    def execute_function_multithreaded(self, *args: object, **kwargs: object) -> dict:
        sys.stderr = self.output  # where Horovod forwards each worker's stderr, looked up as they start
        try:
            results = self.threads.execute_function_multithreaded(*args, **kwargs)
        finally:
            sys.stderr = self.output.stream
        self.exits.update(results)
        for rank in self.commands.stopped & set(self.exits):
            self.exits[rank] = (STOPPED, self.exits[rank][1])
        return results


HOROVOD_EXIT_REPORT = re.compile(r"Process \d+ exit with status code -?\d+\.|Terminating remaining workers after "
                                 r"failure of Process \d+\.")


class _StoppedIsNoFailure:
    """Horovod's Gloo launcher runs each worker's command through this (`safe_shell_exec.execute`): a
    worker that stopped on a signal (75) is no failure to it. Horovod would say "Terminating remaining
    workers after failure" and kill the others while they left the same stop their own way (rank 0,
    still removing its files, died of it under Ctrl-C): they get STOPPED_GRACE_SECONDS to end. Not under
    the elastic driver, which counts a worker's exit its own way."""

    def __init__(self, gloo_run) -> None:
        from horovod.runner.common.util import safe_shell_exec

        self.shell = safe_shell_exec
        self.stopped: set[int] = set()  # the ranks that exited with STOPPED
        self.ended_late: set[int] = set()  # the ranks still running STOPPED_GRACE_SECONDS after that, ended
        self.grace_over = threading.Event()
        self.elastic = False
        gloo_run.safe_shell_exec = self
        exec_command_fn = gloo_run._exec_command_fn

        def watched(settings: Any) -> Any:
            self.elastic = bool(settings.elastic)
            return exec_command_fn(settings)

        gloo_run._exec_command_fn = watched
        gloo_run.print = self.print

    def print(self, *args: Any, **kwargs: Any) -> None:
        """Horovod's prints, less its report of each worker's exit ("Process 1 exit with status code 143.",
        which read as a second failure for a worker it ended itself): the entry's one line says which failed."""
        if self.elastic or not (len(args) == 1 and HOROVOD_EXIT_REPORT.fullmatch(str(args[0]))):
            print(*args, **kwargs)

    def __getattr__(self, name: str) -> object:
        return getattr(self.shell, name)

    def execute(self, command: str, *args: Any, index: int | None = None, events: list | None = None,
                **kwargs: Any) -> int:
        forwarding.launch_begins()  # a worker: the job itself starts
        if self.elastic:
            return self.shell.execute(command, *args, index=index, events=events, **kwargs)
        failure_seen = _first_set(events or [])
        code = self.shell.execute(command, *args, index=index, events=[*(events or []), self.grace_over], **kwargs)
        if code != STOPPED and self.grace_over.is_set():  # ended by the grace's end, after the others' stop
            self.ended_late.add(-1 if index is None else index)
            return 0
        if code == KILLED and failure_seen and time.monotonic() - failure_seen[0] >= self.shell.GRACEFUL_TERMINATION_TIME_S:
            # Horovod ended it after another worker failed, and it outlived the SIGTERM (5 s, then SIGKILL):
            # the launcher's end, as a SIGTERM would have been, not a failure before the other's. One killed
            # sooner after the failure was killed by something else (the kernel's out-of-memory killer), and
            # may be what the other failed of.
            return ENDED_BY_SIGTERM
        if code != STOPPED:
            return code
        if not self.stopped:
            timer = threading.Timer(STOPPED_GRACE_SECONDS, self.grace_over.set)
            timer.daemon = True
            timer.start()
        self.stopped.add(-1 if index is None else index)
        return 0  # to Horovod; to the entry, STOPPED (`_GlooWorkers.exits`)


def _first_set(events: list[threading.Event]) -> list[float]:
    """A list that gets the time (time.monotonic) the first of `events` is set."""
    when: list[float] = []

    def note(event: threading.Event) -> None:
        event.wait()
        if not when:
            when.append(time.monotonic())

    for event in events:
        threading.Thread(target=note, args=(event,), daemon=True).start()
    return when


class PeerGoneHeldBack:
    """A text stream that holds back the line Horovod's background thread prints when a peer went away
    (an error, with Horovod's and Gloo's build paths, from a rank that did not fail): the failed
    worker's own end explains it. `release` says it after all where no worker failed of itself. A
    worker's shell saying it was ended ("Terminated") is dropped: the entry's line says so."""

    PEER_GONE = re.compile(r"Horovod background loop uncaught exception: .*(reset by peer|closed by peer|Read error"
                           r"|Broken pipe)")
    # A worker's shell saying that Horovod ended it, after another failed (or ended late after a stop).
    ENDED_BY_LAUNCHER = re.compile(r".*\[\d+\]<stderr>:(Terminated|Killed)\s*")

    def __init__(self, stream) -> None:
        self.stream, self.held = stream, []

    def write(self, text: str) -> int:
        if self.ENDED_BY_LAUNCHER.fullmatch(text):
            return len(text)
        if self.PEER_GONE.search(text):
            self.held.append(text)
            return len(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def release(self) -> None:
        self.stream.write("".join(self.held))
        self.stream.flush()
        self.held = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.stream, name)
