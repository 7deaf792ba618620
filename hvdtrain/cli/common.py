"""What every command shares: running work on a started engine, one clear line for a user's error
(from rank 0 only), rank 0's JSON files."""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, ContextManager, NoReturn

import click

from hvdtrain.errors import RendezvousFailed, StoppedBySignal, UserError

# dist: how long a rank that stays quiet about an error waits before it exits. Launchers stop every
# rank once one exits; a quiet rank leaving first would cut off rank 0 before its line (a rank 0 that
# started late on a loaded host was, after a 10 s wait; imports from a cluster's shared file system
# can differ by as much between ranks). Rank 0's exit ends the wait sooner: its launcher stops the
# others then, so the wait costs nothing where rank 0 fails too. HVDTRAIN_QUIET_RANK_WAIT_SECONDS sets
# another (seconds, positive), under horovodrun --gloo at most half of its rendezvous timeout.
QUIET_RANK_WAIT_SECONDS = 30.0
SRUN_QUIET_RANK_WAIT_SECONDS = 10.0
# A failure mid-run on a rank other than 0 is said by that rank, after this long: where rank 0 met it
# too (every rank's callback or model failing alike, the same batch shapes), rank 0's line comes first
# and its exit ends the job, rather than one line per rank and the launcher naming whichever left first.
AFTER_RANK_0_SECONDS = 5.0


class UserPath(click.Path):
    """click's Path with `~` expanded: a shell leaves `--output=~/a.npy` as it is."""

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        return super().convert(os.path.expanduser(value) if isinstance(value, str) else value, param, ctx)


def command_engine(debug: bool, **engine_args: Any) -> ContextManager[Any]:
    """The engine (`start_engine`'s arguments) for a command's work, shut down after it; a failure
    is reported (one line, the exit) before the shutdown."""
    from hvdtrain.engine import running_engine
    from hvdtrain.train import early_signals

    return running_engine(lambda err: report_and_exit(err, debug),
                          process_goes_on=not early_signals.in_the_command(), **engine_args)


def report_and_exit(err: Exception, debug: bool) -> None:
    """Exits with one line for a user error or another rank's failure; returns for anything else."""
    from hvdtrain.engine import RankFailed, launcher_rank
    from hvdtrain.errors import FailedAt

    if isinstance(err, RendezvousFailed):
        # dist: rank 0 hosts the rendezvous; where it could not (its port taken), the others wait for it
        # until the timeout (minutes) unless something ends them: srun alone does not
        fail(str(err), err.exit_code, debug, every_rank=True, end_srun_step=err.others_wait)
    if isinstance(err, UserError):
        fail(str(err), err.exit_code, debug)
    if isinstance(err, StoppedBySignal):
        if (launcher_rank() or 0) == 0:  # dist: rank 0 says where every rank stopped
            click.echo(f"hvdtrain: {err}", err=True)
        sys.exit(err.exit_code)
    if isinstance(err, FailedAt):  # only the failing rank knows why: it says so itself
        from hvdtrain.engine import environment

        if (launcher_rank() or 0) > 0 and environment.launcher_ends_the_job_on_a_failure():
            _wait_for_rank_0_s_word(AFTER_RANK_0_SECONDS)  # (srun, pods, elastic: it would only delay)
        fail(str(err), err.exit_code, debug, every_rank=True)
    if isinstance(err, RankFailed):  # "rank 0 failed: ...": said by every rank where each has a log of its own
        from hvdtrain.engine.environment import env_rendezvous_launched

        fail(str(err), UserError.exit_code if err.kind == "UserError" else 1, debug,
             every_rank=env_rendezvous_launched())
    if _collective_failure(err):  # another rank's failure: the failed rank, or its launcher, names it
        from hvdtrain.train.survivors import leave_after_another_rank

        leave_after_another_rank(err, launcher_rank() or 0, debug)


def _collective_failure(err: Exception) -> bool:
    """The running engine's word that a collective failed because another rank failed or left
    (asked of the engines loaded, so a torch-only install never imports Horovod for it)."""
    engines = (sys.modules.get(name) for name in ("hvdtrain.engine.horovod", "hvdtrain.engine.torch_distributed"))
    return any(engine is not None and engine.is_collective_failure(err) for engine in engines)


class _CtrlC(Exception):
    """Ctrl-C came during the wait for rank 0's word: the wait is over."""


def _wait_for_rank_0_s_word(seconds: float, quiet: bool = False) -> None:
    """dist: a rank other than 0 about to report a failure waits `seconds` first, where a launcher ends
    the job on one: rank 0 failing too says the one line and its exit ends the job, and this rank, first.
    Neither a scheduler's warning signal nor a Ctrl-C meanwhile may end this rank without its line (the
    only one where rank 0 did not fail): the warning is ignored, a Ctrl-C ends the wait (the caller says
    its line and exits at once), and only the launcher's SIGTERM ends the rank. A `quiet` rank (one whose
    error rank 0 says) ends on it at once, by its default action: a handler in place then that only
    noted it would keep the rank waiting until the launcher's SIGKILL, named as the job's failure.
    A rank with a line of its own (a failure only it met) keeps the handler, and says its line. The
    launcher's SIGTERM or a Ctrl-C that fit noted but did not act on, as it failed first, acts as if it
    came now: the job is ending already."""
    import signal

    from hvdtrain.train import early_signals

    noted = set(early_signals.take_unserved()) & {signal.SIGTERM, signal.SIGINT}

    def ctrl_c(number: int, frame: object) -> None:
        raise _CtrlC

    held = {}
    for number, handler in ((signal.SIGINT, ctrl_c), (signal.SIGUSR1, signal.SIG_IGN), (signal.SIGUSR2, signal.SIG_IGN),
                            *([(signal.SIGTERM, signal.SIG_DFL)] if quiet else [])):
        try:
            held[number] = signal.signal(number, handler)
        except (ValueError, OSError):  # not the main thread: the wait as it is
            pass
    try:
        for number in sorted(noted, reverse=True):  # SIGTERM (15) first: by the handler in place
            signal.raise_signal(number)
        if not noted:
            time.sleep(seconds)
    except _CtrlC:
        pass
    finally:
        for number, handler in held.items():
            signal.signal(number, handler)


def fail(message: str, code: int, debug: bool, every_rank: bool = False, wait: bool = True,
         end_srun_step: bool = False) -> NoReturn:
    """Exits with `code` after one line of `message` from rank 0 (`every_rank`: from each rank that
    fails so). `end_srun_step`: rank 0 then cancels its srun step, whose other tasks would wait for it."""
    from hvdtrain.engine import environment, launcher_rank

    if debug:
        traceback.print_exc()
    rank = launcher_rank() or 0
    if every_rank or rank == 0:  # dist: one line from rank 0, not one per rank
        click.echo(f"hvdtrain: error: {message}", err=True)
        step = environment.srun_step_left_waiting() if end_srun_step and rank == 0 else None
        if step:
            environment.end_srun_step(step)
        sys.exit(code)
    if environment.env_rendezvous_launched():  # no launcher: each rank's log is its own (a pod's), where
        click.echo(f"hvdtrain: error: rank {rank}: {message}", err=True)  # rank 0's line is not
        sys.exit(code)
    if wait and environment.launcher_ends_the_job_on_a_failure():
        _wait_for_rank_0_s_word(_quiet_rank_wait(), quiet=True)
        # Still here: rank 0 did not fail this way (its exit would have ended the job), a config file
        # missing on this host, say. Left quiet, the job would end without a word of why.
        click.echo(f"hvdtrain: error: rank {rank}: {message}", err=True)
    elif wait:  # srun: it ends the other tasks only when told to (--kill-on-bad-exit), and rank 0's line
        time.sleep(SRUN_QUIET_RANK_WAIT_SECONDS)  # ends nothing: a second line would repeat it
    sys.exit(code)


def _quiet_rank_wait() -> float:
    """QUIET_RANK_WAIT_SECONDS, but under horovodrun --gloo half of Gloo's rendezvous timeout (30 s
    unless HOROVOD_GLOO_TIMEOUT_SECONDS): a rank 0 that did not fail waits there for this rank, and
    aborts at the timeout (SIGABRT, named as the failure) unless this rank has spoken and left first."""
    wait = _seconds("HVDTRAIN_QUIET_RANK_WAIT_SECONDS", QUIET_RANK_WAIT_SECONDS)
    if "HOROVOD_GLOO_RENDEZVOUS_ADDR" not in os.environ:
        return wait
    return min(wait, _seconds("HOROVOD_GLOO_TIMEOUT_SECONDS", 30.0) / 2)


def _seconds(name: str, default: float) -> float:
    """A variable's seconds; the default where it is unset or no positive number (an error path reads
    it, which must not fail in turn)."""
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if 0 < value < math.inf else default


def is_rank_0() -> bool:
    from hvdtrain.engine import launcher_rank

    return (launcher_rank() or 0) == 0


def write_json(path: str | None, payload: Any) -> None:
    """`payload` as JSON into `path` (nothing without one); `-` prints it on stdout."""
    if path:
        import json

        from hvdtrain.io.atomic import atomic_write

        text = json.dumps(payload, indent=2) + "\n"
        if path == "-":
            click.echo(text, nl=False)
            return
        atomic_write(Path(path), lambda handle: handle.write(text.encode()))


def report(text: str, json_path: str | None, payload: Any) -> None:
    """A command's text and its JSON: `--json -` puts the JSON alone on stdout (for jq), the text on stderr."""
    click.echo(text, err=json_path == "-")
    write_json(json_path, payload)


def not_stdout(path: str | None, what: str) -> None:
    """`--output -` means stdout to many tools; a model or an image would be a file named '-' here."""
    if path == "-":
        raise UserError(f"--output '-' would be a file named '-': give the {what} a file name")